"""The selection families: max/min, argmax/argmin and top-k keep the best elements.

max/min keeps one value per slot with the target's own float max and a NaN mark
(``Emitter.fold_best``); argmax/argmin keeps (value, index) pairs by the full ranking
(``Emitter.keep_better``: NaN first, then the value, then the lower index); top-k inserts
into a sorted list (``Emitter.insert_k``).  A merge folds the other lane's entries in the
same way.  At finalize an anchored selection selects again where a final anchor is not
finite (``Emitter.reselect``).  A top-k list is folded straight into the running lane
(``direct``): it is not re-anchored, so a tile would gain nothing, and a tile's empty list
would take almost every element where the running list refuses most with one test.
"""

from __future__ import annotations

from algebra.families import Family

from ...tvm.ir import T, tirx
from ..registers import nan_mark
from ..signature import I64
from ..steps import names_of
from .registry import Element, Join, register


class _Selection:
    """What every selection shares: the element's candidate, no settle, the reselect."""

    direct = False

    @staticmethod
    def candidate(em, comp, e: Element, slot):
        return em.expr(comp.core, em.base_lookup(e.r, e.i, slot, e.dots))

    def tile_step(self, em, st, comp, e: Element, basis) -> None:
        """Not re-anchored: the same step inside and outside tiles."""
        self.update(em, st, comp, e)

    def settle(self, em, st, comp, r) -> None:
        """A selection is never re-anchored: nothing to settle."""

    def reselect(self, em, st, comp, r) -> None:
        if comp.anchors:
            em.reselect(st, comp, r)


class ExtremeLowering(_Selection):
    """max/min (no index), one per slot of its feature vector."""

    def update(self, em, st, comp, e: Element) -> None:
        vname = names_of(comp)[0]
        with em.slots(st.widths[vname]) as slot:
            em.fold_best(st, comp, e.lane, self.candidate(em, comp, e, slot), slot)

    def merge(self, em, st, comp, j: Join) -> None:
        """The better of the two values; the NaN marks combine by their max."""
        vname = names_of(comp)[0]
        mark, pick = nan_mark(vname), tirx.max if comp.direction > 0 else tirx.min
        with em.slots(st.widths[vname]) as slot:
            st.set(vname, j.a, pick(st.get(vname, j.a, slot), st.get(vname, j.b, slot)), slot)
            st.set(mark, j.a, tirx.max(st.get(mark, j.a, slot), st.get(mark, j.b, slot)), slot)


class ArgExtremeLowering(_Selection):
    """argmax/argmin: (value, index), one pair per slot of its feature vector."""

    def update(self, em, st, comp, e: Element) -> None:
        vname = names_of(comp)[0]
        with em.slots(st.widths[vname]) as slot:
            em.keep_better(st, comp, e.lane, self.candidate(em, comp, e, slot),
                           tirx.Cast(I64, e.i), slot)

    def merge(self, em, st, comp, j: Join) -> None:
        vname, jname = names_of(comp)
        with em.slots(st.widths[vname]) as slot:
            em.keep_better(st, comp, j.a, st.get(vname, j.b, slot), st.get(jname, j.b, slot),
                           slot)


class TopKLowering(_Selection):
    """top-k values (and indices): a sorted list of k entries."""

    direct = True

    def update(self, em, st, comp, e: Element) -> None:
        vname, jname = names_of(comp)
        em.insert_k(st, comp, e.lane, self.candidate(em, comp, e, 0), tirx.Cast(I64, e.i),
                    vname, jname, ascending=True)

    def merge(self, em, st, comp, j: Join) -> None:
        """The other lane's entries inserted one by one (their indices are not above the
        list's: no ``ascending`` shortcut)."""
        vname, jname = names_of(comp)
        with T.serial(0, comp.k) as t:
            em.insert_k(st, comp, j.a, st.get(vname, j.b, t),
                        st.get(jname, j.b, t) if jname else None, vname, jname,
                        ascending=False)


register(Family.EXTREME, ExtremeLowering())
register(Family.ARG_EXTREME, ArgExtremeLowering())
register(Family.TOP_K, TopKLowering())
