"""The float64 multi-pass oracle: the spec's text evaluated as written, one pass a reduction.

It shares nothing with the fused path but the parser's checks and the array layout: the
expressions are evaluated from the spec's syntax tree, node by node, with numpy in float64,
never from the sympy expressions the engine simplified (sympy folds ``x/x`` to 1 and
``not (a > b)`` to ``a <= b``, which IEEE arithmetic does not; an oracle built on them would
agree with a kernel that did the same).  So tests that compare a kernel or ``evaluate``
with it test the algebra and the lowering both.

Semantics: numpy's (NaN propagates through max/sum; every comparison with NaN is false but
``!=``; argmax/argmin return the first extreme element, the first NaN if there is one;
top-k values descending, ties to the lower index, NaN ranked first like argmax).  An empty
stream (N = 0) gives each reduction its identity: sum 0, prod 1, max -inf, min +inf.
"""

from __future__ import annotations

import ast
import operator

import numpy as np

from .cascade import INDEX, LENGTH, Cascade
from .layout import resolve, to_user
from .library import resolve_spec
from .spec import CONSTANTS, parse
from .vocabulary import FUNCTIONS

F64 = np.dtype(np.float64)
EMPTY = {"max": -np.inf, "min": np.inf}  # max and min of no elements (numpy has no default)
REDUCTIONS = ("sum", "prod", "max", "min", "argmax", "argmin", "topk", "argtopk")

# the spec's operators as numpy computes them (``&``/``|``/``^`` join conditions only)
BINARY = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply, ast.Div: np.divide,
          ast.Pow: np.power, ast.BitAnd: np.logical_and, ast.BitOr: np.logical_or,
          ast.BitXor: np.logical_xor}
COMPARE = {ast.Lt: np.less, ast.LtE: np.less_equal, ast.Gt: np.greater,
           ast.GtE: np.greater_equal, ast.Eq: np.equal, ast.NotEq: np.not_equal}
UNARY = {ast.USub: np.negative, ast.UAdd: operator.pos, ast.Not: np.logical_not,
         ast.Invert: np.logical_not}
# functions the sympy table spells as other nodes (sqrt as a power): numpy's own here
SPELLED = {"sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x), "pow": np.power}


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


class _Evaluator:
    """Evaluates the statements of a parsed spec in order (the parser has checked them)."""

    def __init__(self, env: dict, n: int):
        self.env, self.n = env, n

    def statement(self, stmt: ast.Assign):
        target = stmt.targets[0]
        name = target.value.id if isinstance(target, ast.Subscript) else target.id
        self.env[name] = self.value(stmt.value)

    def value(self, node: ast.AST):
        return getattr(self, "v_" + type(node).__name__)(node)

    def v_Constant(self, node):
        return F64.type(node.value)

    def v_Name(self, node):
        if node.id in self.env:
            return self.env[node.id]
        return F64.type(float(CONSTANTS[node.id]))  # pi, inf

    def v_Subscript(self, node):  # x[i], x[i, :], g[:]: the layout already shaped them
        return self.env[node.value.id]

    def v_UnaryOp(self, node):
        return UNARY[type(node.op)](self.value(node.operand))

    def v_BinOp(self, node):
        return BINARY[type(node.op)](self.value(node.left), self.value(node.right))

    def v_BoolOp(self, node):
        join = np.logical_and if isinstance(node.op, ast.And) else np.logical_or
        values = [self.value(v) for v in node.values]
        out = values[0]
        for v in values[1:]:
            out = join(out, v)
        return out

    def v_Compare(self, node):  # chained: each adjacent pair, joined with and
        sides = [self.value(node.left), *(self.value(c) for c in node.comparators)]
        out = np.True_
        for op, a, b in zip(node.ops, sides, sides[1:], strict=False):
            out = np.logical_and(out, COMPARE[type(op)](a, b))
        return out

    def v_Call(self, node):
        name = node.func.id
        if name in REDUCTIONS:
            body = np.asarray(self.value(node.args[0]), F64)
            body = np.broadcast_to(body, np.broadcast_shapes(body.shape, (self.n, 1)))
            k = node.args[1].value if len(node.args) > 1 else None
            return _reduce(name, body, k)
        args = [np.asarray(self.value(a)) for a in node.args]
        if name == "where":
            return np.where(*args)
        kernel = SPELLED.get(name) or FUNCTIONS[name].numpy
        return kernel(*(a if a.dtype == bool else a.astype(F64, copy=False) for a in args))


def reference(spec, inputs: dict) -> dict[str, np.ndarray]:
    """Evaluate a cascade the plain multi-pass way in float64 (the test oracle).

    ``spec``: spec text, a library name, a ``Cascade`` or a rule (one-pass or staged: its
    cascade's text).  Every reduction is its own full pass over the stream, and every
    operation is done as written: ``sum(x[i] / x[i])`` is NaN where an element is 0, inf
    or NaN, as numpy computes it.

    Examples
    --------
    >>> x = np.array([[0.0, np.log(3.0)]])
    >>> reference("m = max(x[i]); d = sum(exp(x[i] - m))", {"x": x})["d"]
    array([1.33333333])
    >>> reference("r = sum(x[i] / x[i])", {"x": np.array([[1.0, 0.0]])})["r"]
    array([nan])
    """
    spec = getattr(spec, "cascade", spec)  # a FusionRule or StagedRule: its cascade
    cascade = spec if isinstance(spec, Cascade) else parse(resolve_spec(spec))
    lay = resolve(cascade, inputs, dtype=F64)
    env = {**lay.arrays, LENGTH: F64.type(lay.n),
           INDEX: np.arange(lay.n, dtype=F64).reshape(lay.n, 1)}
    evaluator = _Evaluator(env, lay.n)
    with np.errstate(all="ignore"):
        for stmt in ast.parse(cascade.text).body:
            evaluator.statement(stmt)
    results = {name: np.asarray(env[name]) for name in cascade.outputs}
    return to_user(cascade, lay, results)
