"""Op chains that importers emit for one idea, recognised as that idea.

PyTorch's decomposed ``scaled_dot_product_attention`` (what torch.export produces) writes
its *safe* softmax, which gives 0 instead of NaN in a row whose keys are all masked, as

    p = softmax(s);  flag = not(bool(max(int8(not(s == -inf)), -1)));  where(flag, 0, p)

The flag says "every score of this row is -inf", which is exactly "the softmax's sum of
exponentials is 0" under the kernels' select semantics (a masked slot adds nothing).  So
the whole chain lifts as ``where(d > 0, p, 0)`` with ``d`` the softmax's own sum: one
statement, no int8 reduction, and the P.V matmul after it fuses into the same kernel.
"""

from __future__ import annotations

import re

import numpy as np

from ..tvm_adapter import GenericConst, relax
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


GUARD = "where({d} > 0, {p}, 0)"  # the safe softmax's statement
_GUARD = re.compile(r"where\((\w+) > 0, (\w+), 0\)")


def guard_of(stmt) -> tuple[str, str] | None:
    """(d, p) of a safe-softmax statement ``where(d > 0, p, 0)``; None for any other.  A
    sum over the stream of its values is ``where(d > 0, sum(p ...), 0)``: the condition is
    one per row, so it selects on the result (a condition on a running value inside a
    sum would not be separable).

    Examples
    --------
    >>> from redfuser.relax.frag import Stmt
    >>> guard_of(Stmt(4, "t4", GUARD.format(d="t3", p="t2"), "let", frozenset(), "where"))
    ('t3', 't2')
    """
    match = _GUARD.fullmatch(stmt.text) if stmt is not None else None
    return (match[1], match[2]) if match else None


def safe_softmax(lf: Lifting, call) -> Node | None:
    """where(row fully masked, 0, softmax(s)) as torch.export writes a safe softmax
    (above): ``where(d > 0, p, 0)`` on the softmax's own sum ``d``."""
    cond, zero, p = call.args
    found, node = fully_masked_flag(lf.values, cond), lf.nodes.get(p)
    softmax = lf.values.get(p)
    if found is None or node is None or node.kind != "elem" or not zeros_like(
            lf.values, zero, p) or getattr(getattr(softmax, "op", None), "name", "") != \
            "relax.nn.softmax" or not softmax.args[0].same_as(found[0]):
        return None
    sums = sorted((s for s in node.frag.stmts.values()
                   if s.op == f"softmax {p.name}" and s.kind == "red"), key=lambda s: s.seq)
    node, d = lf.node(p), sums[-1]
    flag_max = tuple(f"max {v.name}" for v in found[1]
                     if _call(lf.values, v, "relax.max") is not None)
    stmt = lf.stmt(GUARD.format(d=d.name, p=node.text), "let", node.deps | {d.name},
                   "relax.where", absorbed=flag_max)  # the report names the int8 max
    lf.quiet.update(found[1])  # the flag's chain (its int8 max) dies with the where
    if isinstance(zero, relax.Var):
        lf.absorbed.add((zero, p))  # full_like reads p's shape only, and dies too
    return Node("elem", node.frag.with_stmt(stmt), stmt.name, frozenset({stmt.name}),
                node.shape, (), node.dots)
