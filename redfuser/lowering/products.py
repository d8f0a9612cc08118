"""Matrix products inside a rule: sums whose every element is a per-row scalar times one
shared feature-axis stream (``y = sum(x[i] / r * w[i, :])`` once 1/r has moved to
finalize), i.e. ``Y[row, :] += a(row, i) * W[i, :]``, a plain GEMM.

Found from the rule's structure, never by name: a linear component with one column and
the identity re-anchoring matrix (nothing is rescaled during the pass: any anchor factor
was moved to finalize by the derivation), whose basis is ``a * w`` with ``w`` a stream
carrying the feature axis that every row shares and ``a`` free of the feature axis, of
anchors and of ``w``.  The refusal reasons are data (``CONDITIONS``); the lowering of a
product is ``lowering.cpu.gemm``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy as sp

from algebra.components import LinearComponent
from algebra.functions import Dot
from algebra.rule import FusionRule

from .geometry import Geometry


@dataclass(frozen=True)
class Product:
    """One matrix-product component: ``state[row, :] = sum_i a(row, i) * weight[i, :]``."""

    comp: LinearComponent
    state: str  # the accumulated state (the GEMM's output before finalize)
    weight: str  # the shared feature-axis stream (the GEMM's B matrix, N x D)
    row_factor: sp.Expr  # a(row, i): the A matrix's element, an expression of row streams


def _weights(comp: LinearComponent, geo: Geometry) -> list[sp.Symbol]:
    """Factors of the basis that are a stream carrying the feature axis, shared by all rows."""
    (basis,) = comp.basis
    return [f for f in sp.Mul.make_args(basis) if f.is_Symbol and f.name in geo.inputs and
            geo.inputs[f.name].length == geo.n and geo.inputs[f.name].width == geo.d and
            geo.inputs[f.name].count == 1]


def _row_factor(comp: LinearComponent, geo: Geometry) -> sp.Expr:
    (basis,) = comp.basis
    return basis / _weights(comp, geo)[0]


def _names(e: sp.Expr) -> set[str]:
    return {s.name for s in e.free_symbols}


# (condition a component must meet, why a component failing it is no matrix product)
CONDITIONS: tuple[tuple[Callable[[object, Geometry], bool], str], ...] = (
    (lambda c, geo: geo.n > 0, "the stream is empty"),
    (lambda c, geo: c.family.linear, "not a sum"),
    (lambda c, geo: len(c.columns) == 1 and not c.counts(0), "more than one column"),
    (lambda c, geo: c.matrix == sp.eye(1), "its state is re-anchored during the pass"),
    (lambda c, geo: len(_weights(c, geo)) == 1,
     "no single factor of its element is a feature-axis stream shared by every row"),
    (lambda c, geo: not c.basis[0].atoms(Dot), "its element holds a dot product"),
    (lambda c, geo: not (_names(_row_factor(c, geo)) & (set(geo.vec) |
                                                        {a.name for a in c.anchors})),
     "the other factor carries the feature axis or an anchor"),
)


def why_not(comp, geo: Geometry) -> str | None:
    """None when ``comp`` is a matrix product at ``geo``, else the first failed condition.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("rmsnorm_gemm")
    >>> geo = shape_geometry(rule, {"x": (8, 64), "w": (64, 32)})
    >>> [why_not(c, geo) for c in rule.components]
    ['no single factor of its element is a feature-axis stream shared by every row', None]
    """
    for holds, why in CONDITIONS:
        if not holds(comp, geo):
            return why
    return None


def products(rule: FusionRule, geo: Geometry) -> tuple[Product, ...]:
    """The matrix products of ``rule`` at ``geo`` that can run as GEMMs; empty when none, or
    when another component's anchor reads one of them during the pass (it would need the
    product's running value, which a blocked GEMM only has at the end).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("rmsnorm_gemm")
    >>> [(p.state, p.weight, p.row_factor)
    ...  for p in products(rule, shape_geometry(rule, {"x": (8, 64), "w": (64, 32)}))]
    [('y', 'w', x)]
    """
    found = [c for c in rule.components if why_not(c, geo) is None]
    states = {c.columns[0].name for c in found}
    for c in rule.components:
        for a in c.anchors:
            if c not in found and _names(rule.running[a.name]) & states:
                return ()
    return tuple(Product(c, c.columns[0].name, _weights(c, geo)[0].name, _row_factor(c, geo))
                 for c in found)


def without(rule: FusionRule, found: tuple[Product, ...]) -> FusionRule:
    """``rule`` less the product components: the rest of the cascade (the statistics folded
    in the same pass over the rows, e.g. RMSNorm's ``sum(x**2)``), with the results that do
    not read a product's state."""
    comps = {id(p.comp) for p in found}
    states = {p.state for p in found}
    keep = tuple(c for c in rule.components if id(c) not in comps)
    running = {k: e for k, e in rule.running.items() if not _names(e) & states}
    owners = [c for c in rule.components for _ in c.obligations]
    # the proof status of the kept obligations (an unfused pass's rule carries none)
    status = tuple(ok for c, ok in zip(owners, rule.status, strict=False) if id(c) not in comps)
    return FusionRule(rule.cascade, keep, running, status, rule.name)
