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

import dataclasses
from dataclasses import dataclass

import sympy as sp

from .cascade import INDEX, Cascade
from .components import LinearComponent
from .names import fresh
from .prove import Obligation
from .selects import has_select

STASH_LAW = "stash: the output is the stashed basis value times an element-free factor"
TILE_MARK = "_t"  # m_t: the anchor m at a tile


@dataclass(frozen=True)
class OutputStash:
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


def stashes(cascade: Cascade, components) -> dict[str, OutputStash]:
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
                 varying: set) -> OutputStash | None:
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
                return OutputStash(name, index, column, factor, ob)
    return None


# Row stashes: a later stage of a staged rule reads a basis value an earlier stage wrote ---
ROW_STASH_LAW = ("row stash: the later stage reads the earlier stage's basis value at the "
                 "final anchors in place of the sub-expression it equals up to a per-row factor")
ROW_STASH_BASE = "stash"  # the name of the stream standing for the stashed value


@dataclass(frozen=True)
class RowRewrite:
    """A stage's cascade rewritten to read a stashed basis value ``psi`` as the stream
    ``stream``: every sub-expression ``psi * F`` (``F`` free of the element) of its bodies
    and per-element outputs became ``stream * F``; ``obligations`` prove each rewritten
    expression equal to the original with ``stream = psi``."""

    stream: sp.Symbol
    cascade: Cascade
    obligations: tuple[Obligation, ...]


def worth_stashing(psi: sp.Expr) -> bool:
    """A basis value is worth a row buffer when it calls a function (``exp``, ``log``, a
    select): reading it back then saves that call per element; a polynomial of the element
    costs about the load that would replace it."""
    return bool(psi.atoms(sp.Function))


def row_rewrite(reader: Cascade, psi: sp.Expr) -> RowRewrite | None:
    """``reader`` (a later stage's cascade, whose anchors are final per-row values) reading
    ``psi`` (an earlier stage's basis at those final anchors) from a row stash, or None where
    no sub-expression of it is ``psi`` times an element-free factor.

    Examples
    --------
    >>> from algebra import derive
    >>> stages = derive("threshold_mass").stages
    >>> psi = stages[0].rule.components[1].basis[0]
    >>> rw = row_rewrite(stages[1].rule.cascade, psi)
    >>> rw.cascade.reductions[0].body, all(o.check() for o in rw.obligations)
    (where(stash/d >= t, stash, 0), True)
    """
    varying = {s.name for s in reader.streams} | {INDEX}
    if not ({s.name for s in psi.free_symbols} & varying):
        return None
    stream = sp.Symbol(fresh(ROW_STASH_BASE, set(reader.names)),
                       **({"positive": True} if psi.is_positive else {"real": True}))
    exprs = {r.name: r.body for r in reader.reductions} | dict(reader.elementwise)
    new = {n: _replace(e, psi, stream, varying) for n, e in exprs.items()}
    if not any(stream in e.free_symbols for e in new.values()):
        return None
    obligations = tuple(Obligation(f"{n}: row stash", ROW_STASH_LAW, exprs[n],
                                   new[n].subs(stream, psi)) for n in exprs if new[n] != exprs[n])
    reads = set().union(*(e.free_symbols for e in new.values()))
    cascade = dataclasses.replace(
        reader, streams=tuple(s for s in reader.streams if s in reads) + (stream,),
        reductions=tuple(dataclasses.replace(r, body=new[r.name]) for r in reader.reductions),
        elementwise={n: new[n] for n in reader.elementwise},
        names=reader.names | {stream.name})
    return RowRewrite(stream, cascade, obligations)


def _replace(e, psi: sp.Expr, stream: sp.Symbol, varying: set):
    """``e`` with its largest sub-expressions ``psi * F`` (``F`` element-free) as
    ``stream * F``, top-down (a select is searched branch by branch: its condition reads
    the element, so it is no such product itself)."""
    if isinstance(e, sp.Expr) and {s.name for s in e.free_symbols} & varying and \
            not has_select(e):
        factor = sp.powsimp(sp.simplify(e / psi))
        if not ({s.name for s in factor.free_symbols} & varying or factor.has(sp.zoo, sp.nan)):
            return stream * factor
    if not e.args:
        return e
    return e.func(*(_replace(a, psi, stream, varying) for a in e.args))
