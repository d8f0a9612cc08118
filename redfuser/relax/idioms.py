"""Op chains that importers emit for one idea, recognised as that idea.

PyTorch's decomposed ``scaled_dot_product_attention`` (what torch.export produces) writes
its *safe* softmax, which gives 0 instead of NaN in a row whose keys are all masked, as

    p = softmax(s);  flag = not(bool(max(int8(not(s == -inf)), -1)));  where(flag, 0, p)

The flag says "every score of this row is -inf" (a NaN score is not -inf: its row keeps
``p``, NaN), which is exactly "the softmax's own max is -inf" (the max propagates NaN, and
is +inf or finite as soon as one score is).  So the whole chain lifts as
``where(m == -inf, 0, p)``: one statement, no int8 reduction, and the P.V matmul after it
fuses into the same kernel.  It must not read the sum of exponentials instead
(``where(d > 0, p, 0)``): ``d`` is NaN in a row with a +inf or NaN score, and that row
would become 0 where torch gives NaN.
"""

from __future__ import annotations

import re

import numpy as np

from ..tvm.graph import GenericConst, relax
from .values import Lifting, Node

# the flag's chain from the where's condition back to the scores: (op, check of the call)
FLAG_CHAIN = (
    ("relax.logical_not", None),
    ("relax.astype", lambda call: str(call.attrs.dtype) == "bool"),
    ("relax.max", lambda call: call.attrs.keepdims and [int(a) for a in call.attrs.axis]
     in ([-1], [len(call.args[0].ty.shape.values) - 1])),
    ("relax.astype", lambda call: str(call.attrs.dtype) in ("int8", "int32", "int64")),
    ("relax.logical_not", None),
)


def _call(values: dict, var, op: str):
    value = values.get(var) if isinstance(var, relax.Var) else None
    if isinstance(value, relax.Call) and getattr(value.op, "name", "") == op:
        return value
    return None


def _is_const(values: dict, expr, target: float) -> bool:
    if isinstance(expr, relax.Var) and isinstance(values.get(expr), GenericConst):
        expr = values[expr]
    if not isinstance(expr, GenericConst):
        return False
    array = expr.value.numpy()
    return array.ndim == 0 and bool(array == target)


def fully_masked_flag(values: dict, cond) -> tuple | None:
    """(scores, chain vars) when ``cond`` is the safe softmax's "row fully masked" flag of
    ``scores``; None otherwise."""
    chain, var = [], cond
    for op, check in FLAG_CHAIN:
        call = _call(values, var, op)
        if call is None or (check is not None and not check(call)):
            return None
        chain.append(var)
        var = call.args[0]
    equal = _call(values, var, "relax.equal")
    if equal is None or not _is_const(values, equal.args[1], -np.inf):
        return None
    return equal.args[0], (*chain, var)


def zeros_like(values: dict, expr, of) -> bool:
    """Is ``expr`` the constant 0, or ``full_like(of, 0)``?"""
    if _is_const(values, expr, 0.0):
        return True
    call = _call(values, expr, "relax.full_like")
    return call is not None and call.args[0].same_as(of) and _is_const(values, call.args[1],
                                                                     0.0)


GUARD = "where({m} == -inf, 0, {p})"  # the safe softmax's statement
_GUARD = re.compile(r"where\((\w+) == -inf, 0, (\w+)\)")


def guard_of(stmt) -> tuple[str, str] | None:
    """(m, p) of a safe-softmax statement ``where(m == -inf, 0, p)``; None for any other.
    A sum over the stream of its values is ``where(m == -inf, 0, sum(p ...))``: the
    condition is one per row, so it selects on the result (a condition on a running value
    inside a sum would not be separable).

    Examples
    --------
    >>> from redfuser.relax.frag import Stmt
    >>> guard_of(Stmt(4, "t4", GUARD.format(m="t1", p="t2"), "let", frozenset(), "where"))
    ('t1', 't2')
    """
    match = _GUARD.fullmatch(stmt.text) if stmt is not None else None
    return (match[1], match[2]) if match else None


def safe_softmax(lf: Lifting, call) -> Node | None:
    """where(row fully masked, 0, softmax(s)) as torch.export writes a safe softmax
    (above): ``where(m == -inf, 0, p)`` on the softmax's own max ``m``."""
    cond, zero, p = call.args
    found, node = fully_masked_flag(lf.values, cond), lf.nodes.get(p)
    softmax = lf.values.get(p)
    if found is None or node is None or node.kind != "elem" or not zeros_like(
            lf.values, zero, p) or getattr(getattr(softmax, "op", None), "name", "") != \
            "relax.nn.softmax" or not softmax.args[0].same_as(found[0]):
        return None
    reductions = sorted((s for s in node.frag.stmts.values()
                         if s.op == f"softmax {p.name}" and s.kind == "red"),
                        key=lambda s: s.seq)
    node, m = lf.node(p), reductions[0]  # the softmax's steps: max first (ops.STATS)
    flag_max = tuple(f"max {v.name}" for v in found[1]
                     if _call(lf.values, v, "relax.max") is not None)
    stmt = lf.stmt(GUARD.format(m=m.name, p=node.text), "let", node.deps | {m.name},
                   "relax.where", absorbed=flag_max)  # the report names the int8 max
    lf.quiet.update(found[1])  # the flag's chain (its int8 max) dies with the where
    if isinstance(zero, relax.Var):
        lf.absorbed.add((zero, p))  # full_like reads p's shape only, and dies too
    return Node("elem", node.frag.with_stmt(stmt), stmt.name, frozenset({stmt.name}),
                node.shape, (), node.dots)
