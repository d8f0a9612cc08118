"""Emitter steps for anchors: the running values re-anchored states are moved to, and the
working values they are held at (``algebra.state``); mixed into ``emitter.Emitter``.

An anchor is a map slot -> value.  A per-row anchor (one value for the whole feature
vector) is bound once and answers every slot; a feature-vector anchor (``m = max(v[i, :])``
is one max per feature) is read or computed at the slot being emitted, so it is only ever
asked for inside a slot loop.
"""

from __future__ import annotations

from collections.abc import Callable

from algebra.state import WORKING_FALLBACK

from ..tvm.ir import T, tirx
from .fastmath import isfinite
from .registers import States, working
from .texpr import const

Anchors = dict[str, Callable]  # anchor name -> (slot -> PrimExpr)


def at(anchors: Anchors, slot) -> dict:
    """The anchors' values at ``slot``."""
    return {a: value(slot) for a, value in anchors.items()}


def _once(value):
    return lambda slot=0: value


class AnchorSteps:
    def _row_anchor(self, name: str) -> bool:
        return self.geo.width(name) == 1

    def row_values(self, anchors: Anchors) -> dict:
        """The per-row anchors' values (what code outside a slot loop may read)."""
        return {a: value(0) for a, value in anchors.items() if self._row_anchor(a)}

    def running(self, st: States, lane, r, names) -> Anchors:
        """Running (true) anchor values at this state; per-row ones bound once."""
        def value(a, slot):
            return T.bind(self.expr(self.rule.running[a], self.state_lookup(st, lane, r, slot)))

        return {a: _once(value(a, 0)) if self._row_anchor(a) else
                (lambda slot, a=a: value(a, slot)) for a in names}

    def working(self, st: States, lane, r, names) -> Anchors:
        """The working anchors at this state (``algebra.state.working_value``): the
        running value where finite (and not 0, for an anchor the state keeps a power of),
        else the fallback."""
        def value(a, run, slot):
            v, guarded = run(slot), a in self.guarded
            usable = tirx.And(isfinite(v), v != const(0)) if guarded else isfinite(v)
            return T.bind(tirx.Select(usable, v, const(WORKING_FALLBACK[guarded])))

        return {a: _once(value(a, run, 0)) if self._row_anchor(a) else
                (lambda slot, a=a, run=run: value(a, run, slot))
                for a, run in self.running(st, lane, r, names).items()}

    @staticmethod
    def held(st: States, lane, names) -> Anchors:
        """The working anchors the lane's states are held at (their registers)."""
        return {a: (lambda slot=0, a=a: st.get(working(a), lane, slot)) for a in names}

    def hold(self, st: States, lane, values: Anchors):
        for a, value in values.items():
            with self.slots(st.widths[working(a)]) as slot:
                st.set(working(a), lane, value(slot), slot)

    def hold_for(self, st: States, comp, lane, r):
        """Hold the lane at the working anchors of ``comp`` (its upstream is complete)."""
        self.hold(st, lane, self.working(st, lane, r, [a.name for a in comp.anchors]))

    def moved_anchors(self, st: States, lane, r, comp, new: Anchors) -> Anchors:
        """Working anchors of ``comp`` after its upstream moved (computed once per anchor)."""
        names = [a.name for a in comp.anchors]
        new.update(self.working(st, lane, r, [a for a in names if a not in new]))
        return {a: new[a] for a in names}
