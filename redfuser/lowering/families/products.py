"""The product family: the plain product of an anchor-free factor (a prod()'s signs).

An element multiplies its factor in, a merge multiplies the two lanes; the state is never
re-anchored, so there is nothing to settle or select again.
"""

from __future__ import annotations

from algebra.families import Family

from .registry import Element, Join, register


class ProductLowering:
    """``P <- P * G(x)``, merged as ``P_L * P_R``."""

    direct = False

    def update(self, em, st, comp, e: Element) -> None:
        name = comp.state[0].symbol.name
        with em.slots(st.widths[name]) as slot:
            st.set(name, e.lane, st.get(name, e.lane, slot) *
                   em.expr(comp.factor, em.base_lookup(e.r, e.i, slot, e.dots)), slot)

    def tile_step(self, em, st, comp, e: Element, basis) -> None:
        """Not re-anchored: the same step inside and outside tiles."""
        self.update(em, st, comp, e)

    def merge(self, em, st, comp, j: Join) -> None:
        name = comp.state[0].symbol.name
        with em.slots(st.widths[name]) as slot:
            st.set(name, j.a, st.get(name, j.a, slot) * st.get(name, j.b, slot), slot)

    def settle(self, em, st, comp, r) -> None:
        """Never re-anchored: nothing to settle."""

    def reselect(self, em, st, comp, r) -> None:
        """A product selects nothing."""


register(Family.PRODUCT, ProductLowering())
