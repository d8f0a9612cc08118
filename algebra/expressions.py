"""Stage 2, lift expressions: one spec expression (a Python ``ast`` node) -> sympy.

``ExpressionLifter`` is mixed into the spec's statement walker (``algebra.spec``): it lifts
numbers, conditions, operators and function calls to sympy, with the shape of each value
(scalar / feature vector / unknown / k values), keeping what IEEE arithmetic computes
(``algebra.ieee.as_written``) and bounding the size of what it builds (``algebra.limits``).
Names and reductions are the walker's (``name``, ``reduction``).
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass

import sympy as sp

from .cascade import INDEX, Shape
from .errors import SpecError
from .functions import Dot
from .ieee import AsWritten, as_written, ieee_not
from .laws import LAWS
from .limits import combined, node_problem, power_problem
from .vocabulary import COMPARISONS, CONNECTIVES, FUNCTIONS

# one-argument functions whose sympy value is their own node unless sympy folded it
_NATURAL = {f: f for f in (sp.exp, sp.log, sp.Abs, sp.tanh, sp.sin, sp.cos, sp.erf, sp.floor,
                           sp.ceiling, sp.sign)}


def fail(node: ast.AST, message: str):
    """Raise ``SpecError`` at the node's line and column."""
    raise SpecError.at(node, message)


@dataclass
class Value:
    """A lifted expression and what the lifter knows of it."""

    expr: sp.Expr
    shape: Shape
    reduces: bool = False  # contains a reduction (hoisted) result
    boolean: bool = False  # a condition (comparison, and/or/not): never a number


class ExpressionLifter:
    """Lifts expressions, one ``e_<ast class>`` method per syntax node.  The host class
    provides ``name``, ``reduction``, ``_hidden_name`` and ``_declare_vector``, and the state
    they read: ``cost``/``let_cost`` (sizes), ``in_body``, ``target`` and ``kind``."""

    def expr(self, node: ast.AST) -> Value:
        method = getattr(self, "e_" + type(node).__name__, None)
        if method is None:
            fail(node, f"unsupported syntax: {ast.unparse(node)!r}")
        val = method(node)
        self._charge(node, val)
        return val

    def _charge(self, node: ast.AST, val: Value):
        """Bound what the node built, its lets substituted: (size, depth) from its children's
        (``limits.combined``), its constants and powers (``limits.node_problem``)."""
        if isinstance(node, ast.Name):
            cost = self.let_cost.get(node.id, (1, 0))
        elif isinstance(node, ast.Call) and call_name(node) in LAWS:
            cost = (1, 0)  # the body is the reduction's; here stands its result
        else:
            cost = combined(self.cost[c] for c in ast.iter_child_nodes(node) if c in self.cost)
        self.cost[node] = cost
        problem = node_problem(cost, val.expr)
        if problem:
            fail(node, problem)

    def e_Constant(self, node):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            fail(node, f"unsupported constant {node.value!r}")
        return Value(sp.nsimplify(node.value) if isinstance(node.value, float) else
                     sp.Integer(node.value), Shape())

    def number(self, node: ast.AST, role: str = "") -> Value:
        """An expression used as a number: a condition here is an error."""
        v = self.expr(node)
        if v.boolean:
            where = f" in {role}" if role else ""
            fail(node, f"'{ast.unparse(node)}' is a condition (true or false), used as a "
                       f"number{where}: write where({ast.unparse(node)}, 1, 0)")
        return v

    def condition(self, node: ast.AST, role: str) -> Value:
        v = self.expr(node)
        if not v.boolean:
            fail(node, f"{role} needs a condition (a comparison such as i <= pos, joined with "
                       f"and/or/not), not the number '{ast.unparse(node)}'")
        return v

    def e_UnaryOp(self, node):
        if isinstance(node.op, (ast.Not, ast.Invert)):  # numpy spells not as ~
            word = "'not'" if isinstance(node.op, ast.Not) else "'~' (numpy's not)"
            v = self.condition(node.operand, word)
            return Value(ieee_not(v.expr), v.shape, v.reduces, True)
        v = self.number(node.operand)
        if isinstance(node.op, ast.USub):
            return Value(-v.expr, v.shape, v.reduces)
        if isinstance(node.op, ast.UAdd):
            return v
        fail(node, f"unsupported operator in {ast.unparse(node)!r}")

    def e_Compare(self, node):
        """``a < b``, ``a <= b < c`` (chained: each adjacent pair, joined with and)."""
        sides = [self.number(node.left), *(self.number(c) for c in node.comparators)]
        parts, shape = [], sides[0].shape
        for op, a, b in zip(node.ops, sides, sides[1:], strict=False):
            shape = shape.join(b.shape, node)
            try:
                parts.append(as_written(COMPARISONS[type(op).__name__], a.expr, b.expr))
            except (KeyError, TypeError):  # 'is', 'in'; or a comparison sympy finds undefined
                fail(node, f"cannot compare in {ast.unparse(node)!r}: use < <= > >= == != "
                           "between real numbers")
        return Value(sp.And(*parts), shape, any(v.reduces for v in sides), True)

    def e_BoolOp(self, node):
        vals = [self.condition(v, f"'{type(node.op).__name__.lower()}'") for v in node.values]
        shape = vals[0].shape
        for v in vals[1:]:
            shape = shape.join(v.shape, node)
        return Value(CONNECTIVES[type(node.op).__name__](*(v.expr for v in vals)), shape,
                     any(v.reduces for v in vals), True)

    def e_BinOp(self, node):
        if isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
            return self._connective(node)
        a, b = self.number(node.left), self.number(node.right)
        ops = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y,
               ast.Mult: lambda x, y: x * y, ast.Div: lambda x, y: x / y,
               ast.Pow: lambda x, y: x ** y}
        fn = ops.get(type(node.op))
        if fn is None:
            fail(node, f"unsupported operator in {ast.unparse(node)!r}")
        if isinstance(node.op, ast.Pow):
            self._check_power(node, a.expr, b.expr)
        if isinstance(node.op, ast.Div) and b.expr.is_zero:  # a typo, surely: say so
            fail(node, f"'{ast.unparse(node)}' is undefined (division by the constant 0)")
        value = as_written(fn, a.expr, b.expr)
        if _undefined(value):
            fail(node, f"'{ast.unparse(node)}' is undefined (a complex value)")
        return Value(value, a.shape.join(b.shape, node), a.reduces or b.reduces)

    def _connective(self, node):
        """numpy's spelling of the connectives on conditions: ``&`` and, ``|`` or, ``^`` xor
        (numpy's ``(a < b) & (c > d)``); on numbers they are bitwise operators, which a spec
        of float values has no use for."""
        symbol = {ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^"}[type(node.op)]
        sides = []
        for side in (node.left, node.right):
            v = self.expr(side)
            if not v.boolean:
                fail(side, f"'{symbol}' joins conditions (numpy's elementwise and/or/xor), "
                           f"but '{ast.unparse(side)}' is a number; compare it first, and "
                           f"mind that '{symbol}' binds tighter than a comparison: write "
                           f"(a < b) {symbol} (c < d)")
            sides.append(v)
        a, b = sides
        join = {ast.BitAnd: sp.And, ast.BitOr: sp.Or,
                ast.BitXor: lambda p, q: sp.Or(sp.And(p, ieee_not(q)), sp.And(ieee_not(p), q))}
        return Value(join[type(node.op)](a.expr, b.expr), a.shape.join(b.shape, node),
                     a.reduces or b.reduces, True)

    def e_Name(self, node):
        return self.name(node.id, node, subscripted=False)

    def e_Subscript(self, node):
        if not isinstance(node.value, ast.Name):
            fail(node, f"only a name can be indexed, not {ast.unparse(node.value)!r}")
        vector = index_of(node)
        if vector is None:  # g[:] : a per-row parameter with a feature axis
            val = self.name(node.value.id, node, subscripted=False)
            self._declare_vector(node.value.id, node)
            return Value(val.expr, Shape(True), val.reduces)
        val = self.name(node.value.id, node, subscripted=True)
        if vector:
            self._declare_vector(node.value.id, node)
            val = Value(val.expr, Shape(True), val.reduces)
        return val

    def e_Call(self, node):
        fname = call_name(node)
        if fname in LAWS:
            if self.in_body is None and not self.target:
                fail(node, "a reduction must be assigned to a name")
            return self.reduction(self._hidden_name(fname), node, hidden=True)
        fn = FUNCTIONS.get(fname)
        if fn is None:
            near = difflib.get_close_matches(fname or "", [*FUNCTIONS, *LAWS], n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            fail(node, f"unknown function '{fname or ast.unparse(node.func)}'{hint}")
        if len(node.args) != fn.arity or node.keywords:
            fail(node, f"{fname}() takes {fn.arity} argument(s), got {len(node.args)}")
        if fname == "where":
            args = [self.condition(node.args[0], "where()"),
                    *(self.number(a, "where()") for a in node.args[1:])]
        else:
            args = [self.number(a, f"{fname}()") for a in node.args]
        if fname == "dot":
            return self._dot(node, args)
        if fname == "pow":
            self._check_power(node, args[0].expr, args[1].expr)
        shape = args[0].shape
        for a in args[1:]:
            shape = shape.join(a.shape, node)
        value = fn.build(*(a.expr for a in args))
        if _folded_call(fn, value, args):  # exp(log(x)) is x over the reals, not in floats
            value = fn.build(*(AsWritten(a.expr) if a.expr.free_symbols else a.expr
                               for a in args))
        if not fn.condition and _undefined(value):
            fail(node, f"'{ast.unparse(node)}' is undefined (a complex or infinite value)")
        return Value(value, shape, any(a.reduces for a in args), fn.condition)

    def _dot(self, node, args: list[Value]) -> Value:
        for arg_node, a in zip(node.args, args, strict=True):
            if a.shape.vec is False or a.shape.k:
                fail(arg_node, f"shape mismatch: dot() needs feature-axis vectors, but "
                               f"'{ast.unparse(arg_node)}' is a scalar")
            if a.expr.is_Symbol and a.expr.name in self.kind:
                self._declare_vector(a.expr.name, arg_node)
        return Value(Dot(args[0].expr, args[1].expr), Shape(False), any(a.reduces for a in args))

    @staticmethod
    def _check_power(node: ast.AST, base: sp.Expr, exponent: sp.Expr):
        """Before sympy evaluates a constant power exactly (10**10**10 would never end)."""
        problem = power_problem(base, exponent)
        if problem:
            fail(node, problem)


def _folded_call(fn, value: sp.Basic, args: list) -> bool:
    """Whether sympy folded the call into something else (exp(log(x)) -> x,
    log(exp(x)) -> x, abs(x**2) -> x**2, exp(x + log(y)) -> y*exp(x)): valid over the reals,
    not in floats (exp overflows, log of a negative is NaN)."""
    natural = _NATURAL.get(fn.build)
    if natural is None or not any(a.expr.free_symbols for a in args):
        return False
    return not isinstance(value.as_coeff_Mul()[1], natural)  # sin(m - x) = -sin(x - m)


def _undefined(value: sp.Expr) -> bool:
    """Division by zero, or a constant that is not real (pow(-1, 1/3), log(-1), and
    pow(-1, pi), whose realness sympy's assumptions leave open: its value decides)."""
    if value.has(sp.zoo, sp.nan, sp.I):
        return True
    return any(n.is_number and _not_real(n) for n in sp.preorder_traversal(value))


def _not_real(n: sp.Expr) -> bool:
    real = n.is_extended_real
    if real is not None:
        return not real
    try:
        return complex(n).imag != 0
    except (TypeError, ValueError, OverflowError):  # no numeric value: left to the proofs
        return False


def index_of(node: ast.Subscript) -> bool | None:
    """``x[i]`` -> False, ``x[i, :]`` -> True (feature axis), ``g[:]`` -> None."""
    s = node.slice
    if isinstance(s, ast.Name) and s.id == INDEX:
        return False
    if isinstance(s, ast.Slice) and s.lower is s.upper is s.step is None:
        return None
    if (isinstance(s, ast.Tuple) and len(s.elts) == 2 and isinstance(s.elts[0], ast.Name)
            and s.elts[0].id == INDEX and isinstance(s.elts[1], ast.Slice)):
        return True
    fail(node, f"streams are indexed by '{INDEX}' only (x[i] or x[i, :]), "
               f"not {ast.unparse(node)!r}")


def call_name(call: ast.Call) -> str | None:
    """The called function's name, None for a call of anything but a plain name."""
    return call.func.id if isinstance(call.func, ast.Name) else None
