"""The float64 multi-pass oracle: each reduction as written, one full pass each.

It shares only the parser and the expression compiler with the fused path, never
the derivation, so tests that compare ``evaluate`` with it test the algebra.
Semantics: numpy's (NaN propagates through max/sum; argmax/argmin return the first
extreme element, the first NaN if there is one; top-k values descending, ties to the
lower index, NaN ranked first like argmax).  An empty stream (N = 0) gives each reduction
its identity: sum 0, prod 1, max -inf, min +inf.
"""

from __future__ import annotations

import numpy as np
import sympy as sp

from .cascade import INDEX, LENGTH, Cascade
from .layout import resolve, to_user
from .library import resolve_spec
from .numeric import compile_expr
from .spec import parse

F64 = np.dtype(np.float64)
EMPTY = {"max": -np.inf, "min": np.inf}  # max and min of no elements (numpy has no default)


def _reduce(op: str, v: np.ndarray, k: int | None) -> np.ndarray:
    if op in ("sum", "prod"):
        return getattr(np, op)(v, axis=-2, keepdims=True)
    if op in ("max", "min"):  # an empty stream: the identity, as torch's logsumexp reads it
        return getattr(np, op)(v, axis=-2, keepdims=True, initial=EMPTY[op]) if \
            v.shape[-2] == 0 else getattr(np, op)(v, axis=-2, keepdims=True)
    if op in ("argmax", "argmin"):  # the first extreme element; the first NaN if any
        return getattr(np, op)(v, axis=-2, keepdims=True).astype(np.int64)
    # top-k: descending, ties to the lower index, NaN first (NaN wins, as in argmax)
    index = np.broadcast_to(np.arange(v.shape[-2]).reshape(-1, 1), v.shape)
    order = np.argsort(-v, axis=-2, kind="stable")
    nan_first = np.argsort(~np.isnan(np.take_along_axis(v, order, axis=-2)), axis=-2,
                           kind="stable")
    order = np.take_along_axis(order, nan_first, axis=-2)[..., :k, :]
    return np.take_along_axis(v, order, axis=-2) if op == "topk" else \
        np.take_along_axis(index, order, axis=-2).astype(np.int64)


def reference(spec, inputs: dict) -> dict[str, np.ndarray]:
    """Evaluate a cascade the plain multi-pass way in float64 (the test oracle).

    ``spec``: spec text, a library name, a ``Cascade`` or a rule (one-pass or staged: its
    cascade).  Every reduction is its own full pass, so a staged rule's oracle is the same
    as its one-pass rule's would be: the stages are the fused side's business.

    Examples
    --------
    >>> x = np.array([[0.0, np.log(3.0)]])
    >>> reference("m = max(x[i]); d = sum(exp(x[i] - m))", {"x": x})["d"]
    array([1.33333333])
    """

    spec = getattr(spec, "cascade", spec)  # a FusionRule or StagedRule: its cascade
    cascade = spec if isinstance(spec, Cascade) else parse(resolve_spec(spec))
    lay = resolve(cascade, inputs, dtype=F64)
    env = {**lay.arrays, LENGTH: F64.type(lay.n),
           INDEX: np.arange(lay.n, dtype=F64).reshape(lay.n, 1)}
    pending = dict(cascade.epilogues)
    results = cascade.results
    with np.errstate(all="ignore"):
        for r in cascade.reductions:
            _epilogues(pending, results, env)
            body = np.asarray(compile_expr(r.body)(env, F64), F64)
            body = np.broadcast_to(body, np.broadcast_shapes(body.shape, (lay.n, 1)))
            env[r.name] = _reduce(r.op, body, r.k)
        _epilogues(pending, results, env)
        for name, expr in cascade.elementwise.items():
            env[name] = compile_expr(expr)(env, F64)
    return to_user(cascade, lay, env)


def _epilogues(pending: dict[str, sp.Expr], results, env):
    for name, expr in list(pending.items()):
        if all(s.name in env for s in expr.free_symbols if s in results.values()):
            env[name] = compile_expr(expr)(env, F64)
            del pending[name]
