"""Operation counts of a rule, read off its derived components (what the cost model prices).

``rule_work`` counts, per element, the fold with anchors held fixed (each basis
function, selections' compares and top-k insertions, products, the count and the
accumulations), the re-anchoring on top of it (the running anchors and the matrix
entries: paid per element by a plain fold, once per tile by a tile folded at fixed
anchors), one merge, the finalize, the per-element outputs' second pass (only the
parts that read the stream: ``1/d`` is hoisted per row) and, for the unfused
baseline, one fold per reduction.  Shared subexpressions (the ``exp(x - m)`` of a
sum and of an output) are counted once (sympy ``cse``).  Operations are arithmetic
(``ops``) or transcendental calls (``calls``: exp, log, tanh, ...), each per element or
per element and feature slot (``vops``/``vcalls``: attention's ``v * exp(s - m)`` and
the dot products' multiply-adds).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from algebra import derive
from algebra.cascade import carries_feature_axis
from algebra.families import Family, element_exprs
from algebra.functions import Dot

from ..lowering import Geometry, shape_geometry
from ..lowering.cpu.space import stage_lanes
from ..lowering.cpu.tiles import levels
from ..lowering.emitter import folded

CALLS = {"exp", "log", "tanh", "erf", "sin", "cos", "log1p", "expm1", "Sigmoid", "Softplus"}
ONE_OP = {"Max", "Min", "Maximum", "Minimum", "Abs", "sign", "floor", "ceiling", "Relu",
          "Step", "Round", "Heaviside"}
SQRT_OPS = 4  # a vector square root costs about as much as 4 multiply-adds
DIV_OPS = 4


@dataclass(frozen=True)
class Work:
    """Operation counts: ``ops``/``calls`` per element, ``vops``/``vcalls`` per element
    and feature slot (to be multiplied by D)."""

    ops: float = 0.0
    calls: float = 0.0
    vops: float = 0.0
    vcalls: float = 0.0

    def __add__(self, o: Work) -> Work:
        return Work(self.ops + o.ops, self.calls + o.calls, self.vops + o.vops,
                    self.vcalls + o.vcalls)

    def __mul__(self, k: float) -> Work:
        return Work(self.ops * k, self.calls * k, self.vops * k, self.vcalls * k)


def count(expr: sp.Expr, vec: frozenset[str] = frozenset()) -> Work:
    """Operations of one expression; nodes that carry the feature axis count per slot.

    Examples
    --------
    >>> x, m = sp.symbols("x m")
    >>> count(sp.exp(x) * m + 1)
    Work(ops=2.0, calls=1.0, vops=0.0, vcalls=0.0)
    """
    if expr.is_Atom:
        return Work()
    name = type(expr).__name__
    if name == "Dot":  # d multiply-adds per element, vectorized over the slots
        inner = sum((count(a, vec) for a in expr.args), Work())
        return inner + Work(vops=2.0)
    own = _own_ops(expr, name)
    wide = carries_feature_axis(expr, set(vec))
    here = Work(vops=own[0], vcalls=own[1]) if wide else Work(ops=own[0], calls=own[1])
    return sum((count(a, vec) for a in expr.args), here)


def _own_ops(expr: sp.Expr, name: str) -> tuple[float, float]:
    """(arithmetic ops, calls) of the node itself, not its arguments."""
    if name in CALLS:
        return (2.0 if name in ("Sigmoid", "Softplus") else 0.0), 1.0
    if name in ONE_OP:
        return max(1.0, len(expr.args) - 1.0), 0.0
    if isinstance(expr, sp.Pow):
        e = expr.exp
        if e.is_Integer:
            return (abs(int(e)) - 1.0 + (DIV_OPS if e < 0 else 0.0)), 0.0
        if e in (sp.S.Half, -sp.S.Half):
            return SQRT_OPS + (DIV_OPS if e < 0 else 0.0), 0.0
        return 1.0, 2.0  # x**y = exp(y * log(x))
    if isinstance(expr, sp.Add | sp.Mul):
        negate = isinstance(expr, sp.Mul) and expr.args[0] == -1
        return len(expr.args) - 1.0 - (0.5 if negate else 0.0), 0.0
    return float(max(1, len(expr.args))), 0.0


def shared_count(exprs: list[sp.Expr], vec: frozenset[str] = frozenset()) -> Work:
    """Operations of several expressions evaluated together (common parts counted once)."""
    exprs = [sp.sympify(e) for e in exprs if not sp.sympify(e).is_Atom]
    if not exprs:
        return Work()
    defs, reduced = sp.cse(exprs, symbols=sp.numbered_symbols("_cse"))
    wide = set(vec)
    total = Work()
    for sym, value in defs:
        total = total + count(value, frozenset(wide))
        if carries_feature_axis(value, wide):
            wide.add(sym.name)
    return sum((count(e, frozenset(wide)) for e in reduced), total)


@dataclass(frozen=True)
class RuleWork:
    """The counts the model needs for one rule at one geometry (see the module docstring)."""

    fold: Work  # per element, anchors held fixed (inside a tile)
    reanchor: Work  # per element of a plain fold on top of ``fold``; per tile when tiled
    merge: Work  # one merge of two states
    finalize: Work  # once per row
    elementwise: Work  # per element of the second pass (0 when the spec has none)
    stages: tuple[Work, ...]  # the unfused baseline: one fold per reduction
    stage_lanes: tuple[bool, ...]  # may that stage run in vector lanes?
    anchored: bool
    chain: float  # dependent steps per element through the states, anchors held fixed
    pass_chains: tuple[float, ...]  # the same for each unfused pass
    wide_loads: float = 0.0  # feature-axis stream values loaded per element and slot
    wide_states: float = 0.0  # feature-axis states (each a load and a store per update)
    dots: float = 0.0  # dot products per element (a horizontal sum when not tiled)


SELECT_CHAIN = 2.0  # compare and select: the steps a max adds to its state's chain
INSERT_CHAIN = 2.0  # per slot of a top-k insertion (compare, shift), value and index alike
INSERT_OPS = 6.0  # per slot of a top-k insertion: compares, selects, moves


def element_work(rule_or_spec) -> Work:
    """The per-element work of a plain fold (anchors moving every element).

    Examples
    --------
    >>> element_work("m = max(x[i]); d = sum(exp(x[i] - m))").calls
    2.0
    """
    rule = derive(rule_or_spec) if isinstance(rule_or_spec, str) else rule_or_spec
    w = rule_work(rule, _flat_geometry(rule))
    return w.fold + w.reanchor


def _flat_geometry(rule) -> Geometry:
    shapes = {s.name: (1, 64) for s in rule.cascade.streams}
    return shape_geometry(rule, shapes, d=1)


def rule_work(rule, geo: Geometry) -> RuleWork:
    """Count the fold, re-anchoring, merge, finalize, per-element outputs and stages
    (cached in the rule, per geometry).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> w = rule_work(rule, shape_geometry(rule, {"x": (4, 256)}))
    >>> w.fold.calls, w.reanchor.calls, w.elementwise.calls
    (1.0, 1.0, 1.0)
    """
    return rule.compiled(("tune.rule_work", geo.key(), geo.vec), lambda: _rule_work(rule, geo))


def _rule_work(rule, geo: Geometry) -> RuleWork:
    vec = geo.vec
    fold, reanchor = [], []
    for comp in rule.components:
        fold += [_primed(comp, e) for e in element_exprs(comp)]
        if comp.family.anchored:
            reanchor += [rule.running[a.name] for a in comp.anchors]
            reanchor += [v * c for r in range(comp.matrix.rows)
                         for v, c in zip(comp.matrix.row(r), comp.columns, strict=True) if v]
    select = sum((_select_ops(c) for c in rule.components), Work())
    wide = sum(s.symbol.name in vec for s in rule.state)
    accumulate = Work(ops=float(len(rule.state) - wide), vops=float(wide))
    sides = frozenset(vec | {f"{n}{side}" for n in vec for side in ("_L", "_R")})
    # a selection's merge is described in words (the best of L and R): priced as its fold
    merge = shared_count([rhs for _, rhs in rule.merge_lines() if isinstance(rhs, sp.Basic)],
                         sides) + select
    reds = rule.cascade.reductions
    return RuleWork(
        shared_count(fold, vec) + select + accumulate, shared_count(reanchor, vec), merge,
        shared_count(list(rule.running.values()), vec), _elementwise_work(rule, geo),
        tuple(count(r.body, vec) + _reduce_ops(r.k) for r in reds), stage_lanes(rule, geo),
        any(c.family.anchored for c in rule.components),
        sum(max(map(_chain, level)) for level in levels(rule, folded(rule)[0])),
        tuple(_chain_of(r.op, r.k) for r in reds),
        float(sum(g.width > 1 and g.length > 1 for g in geo.inputs.values())), float(wide),
        float(len(set().union(*(e.atoms(Dot) for e in fold)))))


def _reduce_ops(k: int | None) -> Work:
    return Work(ops=INSERT_OPS * k) if k and k > 1 else Work(ops=1.0)


def _chain(comp) -> float:
    return _chain_of(comp.reduction.op, getattr(comp, "k", None))


def _chain_of(op: str, k: int | None) -> float:
    """Dependent steps one element adds to a reduction's state (anchors held fixed)."""
    if k and k > 1:
        return INSERT_CHAIN * k
    return SELECT_CHAIN if op in ("max", "min", "argmax", "argmin") else 1.0


def _primed(comp, expr):
    return expr.subs({a: sp.Symbol(a.name + "'", **a.assumptions0) for a in comp.anchors})


def _select_ops(comp) -> Work:
    if comp.family.selects:
        return Work(ops=INSERT_OPS * comp.k if comp.k > 1 else 2.0)
    if comp.family is Family.PRODUCT:
        return Work(ops=1.0)
    return Work()


def _elementwise_work(rule, geo: Geometry) -> Work:
    """Per-element outputs: only the parts that read the stream (1/d is hoisted per row)."""
    streams = {s.name for s in rule.cascade.streams} | {"i"}
    return shared_count([_varying(e, streams) for e in rule.cascade.elementwise.values()],
                        geo.vec)


def _varying(expr: sp.Expr, streams: set[str]) -> sp.Expr:
    """``expr`` with every subexpression that does not read the stream made one symbol."""
    if expr.is_Atom or not {s.name for s in expr.free_symbols} & streams:
        return sp.Dummy() if not expr.is_Atom else expr
    return expr.func(*[_varying(a, streams) for a in expr.args])
