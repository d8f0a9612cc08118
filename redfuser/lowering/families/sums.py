"""The sum families: a state vector of sums S of basis functions at the running anchors.

An element re-anchors S to the moved anchors and adds its basis values (``SumLowering``); a
merge re-anchors both sides and adds (or only adds, when both lanes are held at the same
anchors); at finalize a re-anchored sum (``AnchoredSumLowering``) settles at the true final
anchors.  A sum with no anchors is the same update with the identity matrix, and nothing to
settle.
"""

from __future__ import annotations

from algebra.families import Family

from ...tvm.ir import T
from .registry import Element, Join, register


class SumLowering:
    """``sum`` with no anchor (the count, sum(x), sum(x**2))."""

    direct = False

    def update(self, em, st, comp, e: Element) -> None:
        new = em.moved_anchors(st, e.lane, e.r, comp, e.moved)
        em.reanchor_add(st, comp, [(e.lane, e.old, e.count)], e.lane, new, e.r,
                        em.basis_values(comp, e.r, e.i, new, e.dots))

    def tile_step(self, em, st, comp, e: Element, basis) -> None:
        """The tile's anchors are final for it (held by ``hold_for``): A = I, so the step
        adds the element's basis values; a basis value that is also a stashed output's first
        factor is written to the stash on the way."""
        anchors = em.held(st, e.lane, [a.name for a in comp.anchors])
        cols = [c.name for c in comp.columns]
        width = max(st.widths.get(c, 1) for c in cols)
        values = em.basis_values(comp, e.r, e.i, anchors, e.dots, basis)
        stash = {k: (buf, row) for k, buf, row in em.stashed.get(id(comp), ())}
        with em.slots(width) as slot:
            for k, (c, value) in enumerate(zip(cols, values(slot), strict=True)):
                if k in stash:
                    value = T.bind(value)
                    buf, row = stash[k]
                    T.buffer_store(buf, value, [e.r if row is None else row, e.i, slot])
                if c != st.count:
                    st.set(c, e.lane, st.get(c, e.lane, slot) + value, slot)

    def merge(self, em, st, comp, j: Join) -> None:
        if j.aligned:  # A(a, a) = I: add, with no matrix and no exp
            cols = [c.name for r, c in enumerate(comp.columns) if not comp.counts(r)]
            with em.slots(max(st.widths.get(c, 1) for c in cols)) as slot:
                for c in cols:
                    st.set(c, j.a, st.get(c, j.a, slot) + st.get(c, j.b, slot), slot)
            return
        new = em.moved_anchors(st, j.a, j.r, comp, j.moved)
        em.reanchor_add(st, comp, [(j.a, j.left, j.n_a), (j.b, j.right, j.n_b)], j.a, new,
                        j.r, None)

    def settle(self, em, st, comp, r) -> None:
        """Nothing to settle: no anchor moved the state."""

    def reselect(self, em, st, comp, r) -> None:
        """A sum selects nothing."""


class AnchoredSumLowering(SumLowering):
    """A re-anchored sum (softmax's exp(x - m) sums): settled at the true final anchors with
    IEEE arithmetic at finalize; a plain ``sum`` reduction's result is then recomputed
    from the settled states."""

    def settle(self, em, st, comp, r) -> None:
        em.settle(st, comp, r)
        if comp.reduction.op == "sum":
            em.recompute(st, comp, r)


register(Family.SUM, SumLowering())
register(Family.ANCHORED_SUM, AnchoredSumLowering())
