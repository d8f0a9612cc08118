"""Elementwise functions of the spec language: sympy classes plus numpy kernels.

One table, ``FUNCTIONS``, maps each spec name to its arity, its sympy builder and
the numpy implementation used by the interpreter.  Functions sympy lacks are
``Function`` subclasses with ``eval`` (never monkey-patches), and carry the
derivative and sign facts the monotonicity prover needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce

import numpy as np
import sympy as sp
from sympy.codegen.cfunctions import expm1, log1p
from sympy.core.logic import fuzzy_and
from sympy.logic.boolalg import Boolean, BooleanAtom, BooleanFunction


class _Named(sp.Function):
    """Prints as the spec spells it (sigmoid(x), max(a, b)), so rules read like specs."""

    spec_name = ""
    is_commutative = True  # scalars (sympy leaves it open for a condition argument, and
    # simplify then takes the non-commutative path, which recurses without end on a select)

    def _sympystr(self, printer):
        return "{}({})".format(self.spec_name, ", ".join(printer._print(a) for a in self.args))


class Sigmoid(_Named):
    """Logistic function ``1 / (1 + exp(-x))``; strictly increasing, in (0, 1)."""

    spec_name = "sigmoid"

    @classmethod
    def eval(cls, x):
        if x.is_number:  # numbers, also symbolic ones such as pi: evaluate to standard sympy
            return 1 / (1 + sp.exp(-x))

    def fdiff(self, argindex=1):
        s = Sigmoid(self.args[0])
        return s * (1 - s)

    def _eval_is_positive(self):
        return self.args[0].is_extended_real

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real

    def _latex(self, printer):
        return rf"\sigma\left({printer._print(self.args[0])}\right)"


class Relu(_Named):
    """``max(x, 0)``; non-decreasing but not strictly (ties at 0)."""

    spec_name = "relu"

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return sp.Max(x, 0)

    def fdiff(self, argindex=1):
        return Step(self.args[0])

    def _eval_is_nonnegative(self):
        return self.args[0].is_extended_real

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real


class Step(_Named):
    """Heaviside step with step(0) = 1: relu's derivative, known to be non-negative."""

    spec_name = "step"

    @classmethod
    def eval(cls, x):
        if x.is_number and x.is_extended_real:
            return sp.S.One if x >= 0 else sp.S.Zero

    def _eval_is_nonnegative(self):
        return True


class Softplus(_Named):
    """``log(1 + exp(x))``; strictly increasing and positive."""

    spec_name = "softplus"

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return sp.log(1 + sp.exp(x))

    def fdiff(self, argindex=1):
        return Sigmoid(self.args[0])

    def _eval_is_positive(self):
        return self.args[0].is_extended_real

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real


class Round(_Named):
    """Round half to even (numpy's rule); piecewise constant, so never re-anchorable."""

    spec_name = "round"

    @classmethod
    def eval(cls, x):
        if x.is_Integer:
            return x

    def _eval_evalf(self, prec):
        value = self.args[0].evalf(prec)
        if value.is_Number:
            return sp.Float(round(float(value)), prec)  # Python's round: half to even

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real

    def _eval_is_integer(self):  # of a finite real (sympy's real symbols are finite)
        x = self.args[0]
        return True if x.is_extended_real and x.is_finite else None


class Clip(_Named):
    """``clip(x, lo, hi)``: ``min(max(x, lo), hi)``, numpy's ``np.clip`` (NaN stays NaN).

    Non-decreasing in ``x`` (its derivative is a product of steps, non-negative); an integer
    between integer bounds when ``x`` is an integer, which is what lets a quantized value
    ``clip(round(x * 127 / a), -127, 127)`` accumulate exactly in int32.

    Examples
    --------
    >>> x = sp.Symbol("x", real=True)
    >>> Clip(sp.Float(3.5), -1, 1), Clip(Round(x), -127, 127).is_integer
    (1, True)
    >>> bounds(Clip(Round(x), -127, 127))
    (-127, 127)
    """

    spec_name = "clip"

    @classmethod
    def eval(cls, x, lo, hi):
        if x.is_comparable and lo.is_comparable and hi.is_comparable:  # real numbers only
            return sp.Min(sp.Max(x, lo), hi)

    def fdiff(self, argindex=1):
        x, lo, hi = self.args
        if argindex == 1:
            return Step(x - lo) * Step(hi - x)
        return Step(lo - x) if argindex == 2 else Step(x - hi)

    def _eval_is_extended_real(self):
        return fuzzy_and(a.is_extended_real for a in self.args)

    def _eval_is_integer(self):
        return fuzzy_and(a.is_integer for a in self.args)

    def _eval_is_finite(self):
        return fuzzy_and(a.is_finite for a in self.args[1:])


def bounds(e: sp.Expr) -> tuple[sp.Expr, sp.Expr] | None:
    """Constant bounds ``(lo, hi)`` of ``e`` when it is a clip between two numbers, else None:
    the range an integer stream needs to be stored in 8 bits and accumulated in 32."""
    if isinstance(e, Clip) and e.args[1].is_number and e.args[2].is_number:
        return e.args[1], e.args[2]
    return None


class Maximum(_Named):
    """Elementwise binary maximum (kept apart from sympy ``Max`` to keep -inf handling ours)."""

    spec_name = "max"

    @classmethod
    def eval(cls, a, b):
        if a == b:
            return a
        if a is sp.S.NegativeInfinity:
            return b
        if b is sp.S.NegativeInfinity:
            return a
        if a.is_comparable and b.is_comparable:  # real numbers: (-1/2)**sqrt(pi) is not
            return sp.Max(a, b)

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real and self.args[1].is_extended_real

    def _latex(self, printer):
        return r"\max\left({}, {}\right)".format(*tuple(printer._print(a) for a in self.args))


class Minimum(_Named):
    """Elementwise binary minimum."""

    spec_name = "min"

    @classmethod
    def eval(cls, a, b):
        if a == b:
            return a
        if a is sp.S.Infinity:
            return b
        if b is sp.S.Infinity:
            return a
        if a.is_comparable and b.is_comparable:  # real numbers: (-1/2)**sqrt(pi) is not
            return sp.Min(a, b)

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real and self.args[1].is_extended_real

    def _latex(self, printer):
        return r"\min\left({}, {}\right)".format(*tuple(printer._print(a) for a in self.args))


class Dot(_Named):
    """Dot product over the feature axis; opaque to the algebra (a per-element scalar)."""

    spec_name = "dot"

    is_commutative = True

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real and self.args[1].is_extended_real

    def _eval_is_finite(self):  # a finite sum of products of finite numbers
        return fuzzy_and(a.is_finite for a in self.args)

    def _eval_is_real(self):
        return fuzzy_and(a.is_real for a in self.args)

    def _latex(self, printer):
        a, b = (printer._print(a) for a in self.args)
        return rf"\left\langle {a}, {b}\right\rangle"


class Where(_Named):
    """``where(cond, a, b)``: ``a`` where ``cond`` holds, else ``b`` (numpy's ``np.where``; the
    branch not selected never reaches the result, so an inf or NaN in it cannot leak).

    A Function of three plain arguments rather than sympy's ``Piecewise``: sympy never
    distributes arithmetic into it (no ``c*a + (1 - c)*b``, whose ``0*inf`` is NaN), its
    condition is a sympy ``Boolean`` (so it can never be used as a number), and it maps one to
    one onto ``np.where`` and ``tirx.Select``; ``Piecewise`` keeps (expr, cond) pairs that
    sympy rewrites on its own (``piecewise_fold``) and every translator would special-case.
    Moving it out of an expression is our own, proven law (``algebra.selects.lift``).

    Examples
    --------
    >>> x = sp.Symbol("x", real=True)
    >>> Where(x > 0, x, -sp.oo), Where(sp.true, x, 0), (Where(x > 0, 1, 0) * 2).is_nonnegative
    (where(x > 0, x, -oo), x, True)
    """

    spec_name = "where"

    @classmethod
    def eval(cls, cond, a, b):
        if not isinstance(cond, Boolean):
            raise TypeError(f"where() needs a condition, not `{cond}`")
        if cond is sp.true:
            return a
        if cond is sp.false:
            return b
        if a == b:
            return a

    def _eval_derivative(self, s):  # branch by branch: exact off the condition's boundary
        cond, a, b = self.args
        if s not in cond.free_symbols:
            return Where(cond, a.diff(s), b.diff(s))
        return None

    def _branches(self, fact: str):
        """A fact of the select: known only where both branches agree on it."""
        a, b = (getattr(x, fact) for x in self.args[1:])
        return a if a == b else None

    def _eval_is_extended_real(self):
        return self._branches("is_extended_real")

    def _eval_is_finite(self):
        return self._branches("is_finite")

    def _eval_is_positive(self):
        return self._branches("is_positive")

    def _eval_is_nonnegative(self):
        return self._branches("is_nonnegative")

    def _eval_is_negative(self):
        return self._branches("is_negative")

    def _eval_is_nonpositive(self):
        return self._branches("is_nonpositive")

    def _eval_is_integer(self):
        return self._branches("is_integer")

    def _latex(self, printer):
        c, a, b = (printer._print(x) for x in self.args)
        return rf"\begin{{cases}} {a} & {c} \\ {b} & \text{{otherwise}} \end{{cases}}"


class _FloatClass(BooleanFunction):
    """A test of a value's IEEE class (a condition, only ever read by ``where``).  sympy's real
    symbols are finite, so the test is decided for explicit numbers only and stays symbolic
    otherwise: proofs split on it case by case (``algebra.selects.cases``) like on a
    comparison, and the kernels test the float's bits."""

    spec_name = ""
    on: dict[str, bool] = {}  # the test's value on a finite number, an infinity, NaN

    @classmethod
    def eval(cls, x):
        if x.is_number:  # the spec parser passes numbers only (a condition is refused there)
            kind = "nan" if x is sp.nan else "inf" if x in (sp.oo, -sp.oo, sp.zoo) else "finite"
            return sp.true if cls.on[kind] else sp.false

    def _sympystr(self, printer):
        return f"{self.spec_name}({printer._print(self.args[0])})"

    def _latex(self, printer):
        return rf"\operatorname{{{self.spec_name}}}\left({printer._print(self.args[0])}\right)"


class IsInf(_FloatClass):
    """``isinf(x)``: x is +inf or -inf (NaN is not).

    Examples
    --------
    >>> m = sp.Symbol("m", real=True)
    >>> Where(IsInf(m), 0, m), Where(IsInf(m), 0, m).subs(m, -sp.oo)
    (where(isinf(m), 0, m), 0)
    """

    spec_name = "isinf"
    on = {"finite": False, "inf": True, "nan": False}


class IsFinite(_FloatClass):
    """``isfinite(x)``: x is neither infinite nor NaN."""

    spec_name = "isfinite"
    on = {"finite": True, "inf": False, "nan": False}


class IsNaN(_FloatClass):
    """``isnan(x)``: x is NaN.  Also what makes a negated comparison exact in IEEE
    arithmetic: ``not (a > b)`` is ``a <= b or isnan(a) or isnan(b)`` (``ieee_not``)."""

    spec_name = "isnan"
    on = {"finite": False, "inf": False, "nan": True}


FLOAT_CLASSES = (IsInf, IsFinite, IsNaN)


class AsWritten(_Named):
    """``e`` exactly as the spec wrote it: an identity that sympy cannot see through.

    sympy simplifies as over the real numbers: ``x/x`` is 1, ``x - x`` is 0, ``x*0`` is 0,
    ``x == x`` and ``exp(x) > 0`` are True.  In IEEE arithmetic none of these holds for
    every float (0/0, inf - inf and inf*0 are NaN; NaN == NaN is false; exp(-200) is 0 in
    float32), so where the spec parser sees sympy fold an operation it rebuilds it with an
    operand wrapped in ``AsWritten``: the algebra treats the operand as an opaque value (its
    derivative is 1), and every evaluator computes it as written (numpy: the identity; TIR:
    a value the TVM and LLVM simplifiers cannot fold against its twin, ``texpr``).

    Examples
    --------
    >>> x = sp.Symbol("x", real=True)
    >>> x / x, x / AsWritten(x), sp.Eq(x, AsWritten(x)), x * AsWritten(0)
    (1, x/as_written(x), Eq(x, as_written(x)), x*as_written(0))
    """

    spec_name = "as_written"
    is_number = False  # as_written(0) is computed, not a constant to fold (or to evalf)

    @classmethod
    def eval(cls, e):
        return None  # never folded, not even a number (x * 0 is not 0 in IEEE arithmetic)

    def fdiff(self, argindex=1):
        return sp.S.One

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real


def occurrences(e: sp.Basic) -> int:
    """How many times values occur in ``e``: its symbol leaves, an integer power counting
    its base that many times (x*x is x**2: two occurrences, nothing lost).  An operation
    that leaves fewer than its operands had was folded by sympy as over the reals.

    Examples
    --------
    >>> x = sp.Symbol("x", real=True)
    >>> occurrences(x**2), occurrences(x - x), occurrences(-sp.oo - x)
    (2, 0, 0)
    """
    if e.is_Symbol:
        return 1
    if e.is_Pow and e.exp.is_Integer:
        return abs(int(e.exp)) * occurrences(e.base)
    return sum(occurrences(a) for a in e.args)


def as_written(op, *args) -> sp.Basic:
    """``op(*args)`` as IEEE arithmetic computes it.  sympy simplifies while it builds, as
    over the real numbers; wherever that drops an occurrence of a value (``x - x`` is 0,
    ``x/x`` 1, ``x*0`` 0, ``-oo - m`` -oo), leaves an undefined value (``s/0`` is zoo) or
    decides a comparison (``x == x``, ``exp(x) > 0``), the operation is rebuilt with one
    operand ``AsWritten`` (a number if there is one: sympy folds ``0*f`` whatever ``f`` is),
    which sympy cannot cancel or decide, so the kernels and the oracle compute what was
    written (inf - inf is NaN; NaN == NaN is false; s/0 is +-inf).

    Examples
    --------
    >>> x = sp.Symbol("x", real=True)
    >>> as_written(lambda p, q: p - q, x, x), as_written(sp.Mul, x, 0), as_written(sp.Eq, x, x)
    (x - as_written(x), x*as_written(0), Eq(x, as_written(x)))
    >>> as_written(sp.Add, x, 1), as_written(sp.Mul, x, x), as_written(sp.Pow, 0, -1) * x
    (x + 1, x**2, x/as_written(0))
    """
    args = [sp.sympify(a) for a in args]
    value = op(*args)
    if not _folded(value, args):
        return value
    numbers = [k for k, a in enumerate(args) if a.is_number]
    for k in numbers or [len(args) - 1]:
        wrapped = op(*args[:k], _opaque(args[k]), *args[k + 1:])
        if not _folded(wrapped, args):
            return wrapped
    return value


def _opaque(a: sp.Basic) -> sp.Basic:
    """``a`` as written; a reciprocal keeps its power outside (s / as_written(s), not
    s * as_written(1/s)), so that the kernels still divide instead of multiplying by a
    rounded reciprocal."""
    if a.is_Pow and a.exp.is_negative:
        return sp.Pow(AsWritten(a.base), a.exp)
    return AsWritten(a)


def _folded(value: sp.Basic, args: list) -> bool:
    if isinstance(value, BooleanAtom):
        return any(a.free_symbols for a in args)
    return value.has(sp.zoo, sp.nan) or \
        occurrences(value) < sum(occurrences(a) for a in args)


def never_nan(e: sp.Basic) -> bool:
    """Whether ``e`` cannot be NaN in any float evaluation: a number other than NaN, or an
    integer (the stream index, the length N), which the kernels never compute in floats."""
    if e.is_number:
        return e is not sp.nan and e.is_extended_real is True
    return bool(e.is_integer)


def ieee_not(c: Boolean) -> Boolean:
    """The negation of a condition in IEEE arithmetic, where NaN makes every ordered
    comparison false: ``not (a > b)`` is ``a <= b or isnan(a) or isnan(b)`` (sympy's
    ``Not`` gives ``a <= b``, false at a NaN); ``not (a == b)`` is ``a != b`` (true at a
    NaN, as IEEE's !=).  De Morgan's laws hold for the connectives.

    Examples
    --------
    >>> x, t, j = sp.symbols("x t", real=True) + (sp.Symbol("j", integer=True),)
    >>> ieee_not(x > t), ieee_not(sp.Eq(x, 0)), ieee_not(j > 3)
    (isnan(t) | isnan(x) | (x <= t), Ne(x, 0), j <= 3)
    """
    if c is sp.true or c is sp.false:
        return ~c
    if isinstance(c, sp.Not):
        return c.args[0]
    if isinstance(c, sp.And):
        return sp.Or(*(ieee_not(a) for a in c.args))
    if isinstance(c, sp.Or):
        return sp.And(*(ieee_not(a) for a in c.args))
    if isinstance(c, (sp.Eq, sp.Ne)):
        return c.negated
    if isinstance(c, sp.core.relational.Relational):
        return sp.Or(c.negated, *(IsNaN(a) for a in c.args if not never_nan(a)))
    return sp.Not(c)  # a float-class test: its negation is exact


def _np_sigmoid(x):
    one = x.dtype.type(1)
    return one / (one + np.exp(-x))


def _np_erf(x):
    return np.vectorize(math.erf, otypes=[x.dtype])(x)  # numpy has no erf ufunc


def _np_dot(a, b):
    return np.sum(a * b, axis=-1, keepdims=True)


@dataclass(frozen=True)
class Elementwise:
    """One spec function: how many arguments, how sympy builds it, how numpy runs it."""

    arity: int
    build: Callable[..., sp.Expr]
    numpy: Callable[..., np.ndarray] | None  # None: sympy lowers it to other nodes
    condition: bool = False  # returns a condition (read by where), not a number


def _pow(a, b):
    return sp.Pow(a, b)


# spec name -> (arity, sympy builder, numpy kernel); keyed data, one line each.
FUNCTIONS: dict[str, Elementwise] = {
    "exp": Elementwise(1, sp.exp, np.exp),
    "log": Elementwise(1, sp.log, np.log),
    "sqrt": Elementwise(1, sp.sqrt, None),  # sqrt(x) -> x**(1/2)
    "rsqrt": Elementwise(1, lambda x: 1 / sp.sqrt(x), None),  # -> x**(-1/2)
    "abs": Elementwise(1, sp.Abs, np.abs),
    "tanh": Elementwise(1, sp.tanh, np.tanh),
    "sigmoid": Elementwise(1, Sigmoid, _np_sigmoid),
    "relu": Elementwise(1, Relu, lambda x: np.maximum(x, x.dtype.type(0))),
    "softplus": Elementwise(1, Softplus, lambda x: np.logaddexp(x, x.dtype.type(0))),
    "pow": Elementwise(2, _pow, None),  # -> Pow node
    "sin": Elementwise(1, sp.sin, np.sin),
    "cos": Elementwise(1, sp.cos, np.cos),
    "erf": Elementwise(1, sp.erf, _np_erf),
    "log1p": Elementwise(1, log1p, np.log1p),
    "expm1": Elementwise(1, expm1, np.expm1),
    "floor": Elementwise(1, sp.floor, np.floor),
    "ceil": Elementwise(1, sp.ceiling, np.ceil),
    "round": Elementwise(1, Round, np.round),
    "sign": Elementwise(1, sp.sign, np.sign),
    "clip": Elementwise(3, Clip, np.clip),  # np.clip: min(max(x, lo), hi), NaN stays NaN
    "maximum": Elementwise(2, Maximum, np.maximum),
    "minimum": Elementwise(2, Minimum, np.minimum),
    "dot": Elementwise(2, Dot, _np_dot),
    "where": Elementwise(3, Where, np.where),  # select: the other branch never leaks
    "isinf": Elementwise(1, IsInf, np.isinf, condition=True),  # +-inf (not NaN)
    "isfinite": Elementwise(1, IsFinite, np.isfinite, condition=True),  # not inf, not NaN
    "isnan": Elementwise(1, IsNaN, np.isnan, condition=True),
}

# Comparisons and connectives are sympy's own Relational/And/Or/Not (Booleans, never numbers):
# spec operator -> sympy class.  The spec uses Python's ``and``/``or``/``not`` for connectives.
COMPARISONS: dict[str, type] = {"Lt": sp.StrictLessThan, "LtE": sp.LessThan,
                                "Gt": sp.StrictGreaterThan, "GtE": sp.GreaterThan,
                                "Eq": sp.Equality, "NotEq": sp.Unequality}
CONNECTIVES: dict[str, type] = {"And": sp.And, "Or": sp.Or, "Not": sp.Not}


def _fold(op):
    return lambda *args: reduce(op, args)  # sympy's And/Or take any number of arguments


# sympy class name -> numpy kernel of the boolean nodes (IEEE: every comparison with NaN is
# false except !=, as in numpy).
BOOLEAN_KERNELS: dict[str, Callable[..., np.ndarray]] = {
    "StrictLessThan": np.less, "LessThan": np.less_equal, "StrictGreaterThan": np.greater,
    "GreaterThan": np.greater_equal, "Equality": np.equal, "Unequality": np.not_equal,
    "And": _fold(np.logical_and), "Or": _fold(np.logical_or), "Not": np.logical_not,
    "BooleanTrue": lambda: np.True_, "BooleanFalse": lambda: np.False_,
}

# sympy class name -> numpy kernel, for the interpreter's expression compiler.
NUMPY_KERNELS: dict[str, Callable[..., np.ndarray]] = {
    **{e.build.__name__: e.numpy for e in FUNCTIONS.values() if e.numpy is not None},
    **BOOLEAN_KERNELS,
    "AsWritten": lambda v: v,
}
