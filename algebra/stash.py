"""Stashes: a per-element output written by the statistics pass, finished with one multiply.

A per-element output ``E(x, results)`` that is a basis function of a re-anchored sum times a
factor free of the element, ``E = psi_k(x, a_t) * F(a_t, results)``, can be produced while
the statistics pass folds ``x`` at some working anchor ``a_t`` (a tile's): that pass computes
``psi_k(x, a_t)`` anyway, so it writes it into the output, and once the results are final a
second pass over the row (in cache) multiplies it by ``F``.  Softmax's
``exp(x - m) / d = exp(x - m_t) * (exp(m_t - m) / d)`` then costs one exp per element
instead of two.  The identity ``E == psi_k(x, a_t) * F`` is a proof obligation like any
other: an output whose identity sympy does not reduce to zero is not stashed.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .cascade import INDEX, Cascade
from .components import LinearComponent
from .names import fresh
from .prove import Obligation

STASH_LAW = "stash: the output is the stashed basis value times an element-free factor"
TILE_MARK = "_t"  # m_t: the anchor m at a tile


@dataclass(frozen=True)
class Stash:
    """Output ``output`` = (basis ``column`` of component ``component`` at the tile anchors)
    times ``factor``, which reads the tile anchors (``tile_anchor``) and the results."""

    output: str
    component: int  # position in ``FusionRule.components``
    column: int  # which of the component's basis functions is written
    factor: sp.Expr
    obligation: Obligation


def tile_anchor(anchor: sp.Symbol, cascade: Cascade) -> sp.Symbol:
    """The working anchor a stashed value was computed at: m -> m_t (fresh against the spec's
    names: a parameter called m_t is another value)."""
    return sp.Symbol(fresh(anchor.name + TILE_MARK, set(cascade.names)), **anchor.assumptions0)


def stashes(cascade: Cascade, components) -> dict[str, Stash]:
    """Every per-element output that can be stashed, with its proven identity.

    Examples
    --------
    >>> from algebra import derive
    >>> rule = derive("softmax")
    >>> s = stashes(rule.cascade, rule.components)["y"]
    >>> s.factor, s.obligation.check()
    (exp(-m + m_t)/d, True)
    >>> stashes(derive("log_softmax").cascade, derive("log_softmax").components)
    {}
    """
    varying = {s.name for s in cascade.streams} | {INDEX}
    out = {}
    for name, expr in cascade.elementwise.items():
        found = _first_stash(name, expr, cascade, components, varying)
        if found is not None:
            out[name] = found
    return out


def _first_stash(name: str, expr: sp.Expr, cascade: Cascade, components,
                 varying: set) -> Stash | None:
    for index, comp in enumerate(components):
        if not isinstance(comp, LinearComponent) or not comp.anchors:
            continue  # without an anchor the basis is the plain element: nothing to save
        at_tile = {a: tile_anchor(a, cascade) for a in comp.anchors}
        for column, psi in enumerate(comp.basis):
            psi_t = psi.subs(at_tile, simultaneous=True)
            if comp.counts(column) or not ({s.name for s in psi_t.free_symbols} & varying):
                continue
            factor = sp.powsimp(sp.simplify(expr / psi_t))
            if {s.name for s in factor.free_symbols} & varying or factor.has(sp.zoo, sp.nan):
                continue
            ob = Obligation(f"{name}: stash", STASH_LAW, expr, psi_t * factor)
            if ob.check():
                return Stash(name, index, column, factor, ob)
    return None
