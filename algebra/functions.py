"""The spec's elementwise functions that sympy lacks, as sympy ``Function`` classes.

Each is a ``Function`` subclass with ``eval`` (never a monkey-patch) that prints as the spec
spells it and carries the derivative and sign facts the monotonicity prover needs.  The
IEEE-semantics nodes (float-class tests, ``AsWritten``) are in ``algebra.ieee``; the table
of spec names, arities and numpy kernels is ``algebra.vocabulary``.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp
from sympy.core.logic import fuzzy_and
from sympy.logic.boolalg import Boolean


class Named(sp.Function):
    """Prints as the spec spells it (sigmoid(x), max(a, b)), so rules read like specs."""

    spec_name = ""
    is_commutative = True  # scalars (sympy leaves it open for a condition argument, and
    # simplify then takes the non-commutative path, which recurses without end on a select)

    def _sympystr(self, printer):
        return "{}({})".format(self.spec_name, ", ".join(printer._print(a) for a in self.args))


class _Activation(Named):
    """A function of one real argument with a closed form in standard sympy: numbers (also
    symbolic ones such as pi) evaluate to it; real where its argument is, and of the sign
    ``sign`` there.  A subclass is data: its closed form, its derivative and its sign."""

    sign = ""  # "positive" or "nonnegative": a fact wherever the argument is real
    closed: Callable[[sp.Expr], sp.Expr]
    slope: Callable[[sp.Expr], sp.Expr]  # the derivative, at the argument

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return cls.closed(x)

    def fdiff(self, argindex=1):
        return self.slope(self.args[0])

    def _eval_is_positive(self):
        return self.args[0].is_extended_real if self.sign == "positive" else None

    def _eval_is_nonnegative(self):
        return self.args[0].is_extended_real if self.sign == "nonnegative" else None

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real


class Sigmoid(_Activation):
    """Logistic function ``1 / (1 + exp(-x))``; strictly increasing, in (0, 1)."""

    spec_name, sign = "sigmoid", "positive"
    closed = staticmethod(lambda x: 1 / (1 + sp.exp(-x)))
    slope = staticmethod(lambda x: Sigmoid(x) * (1 - Sigmoid(x)))

    def _latex(self, printer):
        return rf"\sigma\left({printer._print(self.args[0])}\right)"


class Relu(_Activation):
    """``max(x, 0)``; non-decreasing but not strictly (ties at 0)."""

    spec_name, sign = "relu", "nonnegative"
    closed = staticmethod(lambda x: sp.Max(x, 0))
    slope = staticmethod(lambda x: Step(x))


class Softplus(_Activation):
    """``log(1 + exp(x))``; strictly increasing and positive."""

    spec_name, sign = "softplus", "positive"
    closed = staticmethod(lambda x: sp.log(1 + sp.exp(x)))
    slope = staticmethod(lambda x: Sigmoid(x))


class Step(Named):
    """Heaviside step with step(0) = 1: relu's derivative, known to be non-negative."""

    spec_name = "step"

    @classmethod
    def eval(cls, x):
        if x.is_number and x.is_extended_real:
            return sp.S.One if x >= 0 else sp.S.Zero

    def _eval_is_nonnegative(self):
        return True


class Round(Named):
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


class Clip(Named):
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


class _Extremum(Named):
    """Elementwise binary maximum or minimum (kept apart from sympy ``Max``/``Min`` to keep the
    infinite identity's handling ours): the subclass names its sympy fold and its identity."""

    fold: type  # sympy's Max or Min, for two real numbers
    identity: sp.Expr  # the infinity that leaves the other argument as it is

    @classmethod
    def eval(cls, a, b):
        if a == b:
            return a
        if a is cls.identity:
            return b
        if b is cls.identity:
            return a
        if a.is_comparable and b.is_comparable:  # real numbers: (-1/2)**sqrt(pi) is not
            return cls.combine(a, b)

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real and self.args[1].is_extended_real

    def _latex(self, printer):
        a, b = (printer._print(a) for a in self.args)
        return rf"\{self.spec_name}\left({a}, {b}\right)"


class Maximum(_Extremum):
    """Elementwise binary maximum."""

    spec_name = "max"
    combine = sp.Max
    identity = sp.S.NegativeInfinity


class Minimum(_Extremum):
    """Elementwise binary minimum."""

    spec_name = "min"
    combine = sp.Min
    identity = sp.S.Infinity


class Dot(Named):
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


def _agreed(fact: str) -> Callable[[Named], bool | None]:
    """A select's fact handler: the fact where both branches agree on it, else unknown."""
    def handler(select: Named) -> bool | None:
        a, b = (getattr(x, fact) for x in select.args[1:])
        return a if a == b else None
    return handler


class Where(Named):
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

    # a fact of the select is known only where both branches agree on it
    _eval_is_extended_real, _eval_is_finite, _eval_is_integer = (
        _agreed(f) for f in ("is_extended_real", "is_finite", "is_integer"))
    _eval_is_positive, _eval_is_nonnegative, _eval_is_negative, _eval_is_nonpositive = (
        _agreed(f) for f in ("is_positive", "is_nonnegative", "is_negative", "is_nonpositive"))

    def _latex(self, printer):
        c, a, b = (printer._print(x) for x in self.args)
        return rf"\begin{{cases}} {a} & {c} \\ {b} & \text{{otherwise}} \end{{cases}}"
