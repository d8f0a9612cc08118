"""The other orientation's mask on a sorted stream, as a range of the stream.

Causal attention's gradients summed over the rows (dk, dv) read its mask as
``where(at <= pos[i], ...)``: the key's position ``at`` is the row's, each query's position
``pos[i]`` is the stream's.  A block of queries that no key of a row block can see is then
still read element by element: the block skip (``algebra.skip``) needs a condition on the
index ``i`` itself.  But where ``pos`` does not decrease along the stream (queries in order,
as every causal mask torch and transformers build has them),

    {i : at <= pos[i]} = {i : i >= first},   first = searchsorted(pos, at, side="left")

(the first position whose value reaches ``at``), and likewise for the other comparisons
(``SIDES``).  The cascade with the condition on ``i`` computes the same sums on such a
stream, and its kernel skips the blocks before ``first``.  The law is one of the data, not
of the algebra, so nothing here is proven by sympy: the caller checks that the stream does
not decrease on every row (``redfuser.torch_columns``) and runs the general cascade where it
does not (NaN included: a comparison with NaN is false, so a NaN fails the check).

Examples
--------
>>> from algebra import derive
>>> s = sorted_columns(derive("causal_attention").backward())
>>> s.stream, [(b.name, b.value, b.op, b.side) for b in s.bounds]
('pos', [('first', at, '>=', 'left')])
>>> print(s.spec.splitlines()[1])
dv = sum(where(i >= first, do[i, :]*exp(-m[i] + scale[i]*dot(q[i, :], k))/d[i], 0))
>>> sorted_columns(derive("attention").backward()) is None
True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy as sp

from .backward import Backward
from .backward_text import written
from .cascade import POSITION, Cascade
from .names import fresh
from .skip import RELATIONS
from .spec import parse

# ``e op s[i]`` (s the sorted stream, e a per-row value) -> (how the index compares with
# the bound, numpy/torch searchsorted's side): the bound counts the elements of s below e
# ("left": s < e) or not above it ("right": s <= e).
SIDES = {
    "<=": (">=", "left"),   # s[i] >= e from the first element not below e on
    "<": (">=", "right"),   # s[i] > e from the first element above e on
    ">=": ("<", "right"),   # s[i] <= e up to the last element not above e
    ">": ("<", "left"),     # s[i] < e up to the last element below e
}
_INDEXRELATIONS = {">=": sp.GreaterThan, "<": sp.StrictLessThan}
_ARITHMETIC = (sp.Symbol, sp.Number, sp.Add, sp.Mul)


@dataclass(frozen=True)
class Bound:
    """The parameter ``name`` replacing a condition ``value op stream[i]``: the index is
    ``op`` it (``>=`` or ``<``), and it is ``searchsorted(stream, value, side)`` per row."""

    name: str
    value: sp.Expr  # of the column cascade's per-row values
    op: str
    side: str


@dataclass(frozen=True)
class SortedColumns:
    """``spec``: the column cascade with each condition on ``stream`` made one on the
    index, through ``bounds``; equal to the general one where ``stream`` does not decrease
    along any row."""

    stream: str
    bounds: tuple[Bound, ...]
    spec: str


def sorted_columns(b: Backward) -> SortedColumns | None:
    """``b``'s column cascade with its conditions on one scalar stream compared with
    per-row values made conditions on the index (module docstring); None where it has no
    such condition, or also one this cannot rewrite (on another stream, or the index)."""
    if not b.columns:
        return None
    c = parse(b.columns)
    conds = sorted({w for r in c.reductions for w in r.body.atoms(sp.Rel)}, key=str)
    found = [_compared(c, cond) for cond in conds]
    if not found or any(f is None for f in found) or len({f[0] for f in found}) != 1:
        return None
    taken, bounds, swap = set(c.names), [], {}
    for cond, (_, value, op) in zip(conds, found, strict=True):
        index_op, side = SIDES[op]
        name = fresh("first" if index_op == ">=" else "last", taken)
        taken.add(name)
        bounds.append(Bound(name, value, index_op, side))
        swap[cond] = _INDEXRELATIONS[index_op](POSITION, sp.Symbol(name, real=True))
    reductions = tuple(dataclasses.replace(r, body=r.body.xreplace(swap))
                       for r in c.reductions)
    return SortedColumns(found[0][0], tuple(bounds),
                         written(dataclasses.replace(c, reductions=reductions)))


def _compared(c: Cascade, cond: sp.Basic) -> tuple[str, sp.Expr, str] | None:
    """(stream, e, op) for ``cond`` spelled ``e op stream[i]`` (either side) with a scalar
    stream and ``e`` a sum of products of numbers and per-row values (free of the index
    and of every stream), else None."""
    if type(cond) not in RELATIONS:
        return None
    streams = {s.name for s in c.streams}
    scalar = streams - set(c.vector_inputs)
    rel = cond if getattr(cond.rhs, "name", None) in scalar else cond.reversed
    if getattr(rel.rhs, "name", None) not in scalar:
        return None
    if any(s.name in streams or s == POSITION for s in rel.lhs.free_symbols):
        return None
    if any(not isinstance(a, _ARITHMETIC) for a in sp.preorder_traversal(rel.lhs)):
        return None  # its caller computes e with tensors' own arithmetic
    return rel.rhs.name, rel.lhs, RELATIONS[type(rel)]
