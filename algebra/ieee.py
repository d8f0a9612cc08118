"""IEEE semantics in sympy: float-class tests, operations kept as written, exact negation.

sympy reasons as over the real numbers; the kernels compute in floats, where inf and NaN
exist.  This module holds what bridges the two: the ``isinf``/``isfinite``/``isnan``
conditions, ``AsWritten`` and ``as_written`` (an operation sympy would fold, kept as the
spec wrote it) and ``ieee_not`` (the negation of a condition when NaN makes every ordered
comparison false).
"""

from __future__ import annotations

import sympy as sp
from sympy.logic.boolalg import Boolean, BooleanAtom, BooleanFunction

from .functions import Named


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
    >>> from algebra.functions import Where
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


class AsWritten(Named):
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

    def _redfuser_spec(self, printer):  # the operand as written; parsing wraps it again
        return f"({printer._print(self.args[0])})"

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
