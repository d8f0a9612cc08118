"""sympy -> spec text: the parser's inverse, for specs the engine writes itself (a backward
cascade, a TensorIR reduction lifted to a spec).

sympy's own ``StrPrinter`` (precedence, ``x/d``, ``sqrt``) with the spec's spellings: a
function of ours prints as its ``spec_name``, sympy's own through ``SPEC_FUNCS``, a select
as ``where``, a connective as Python's ``and``/``or``/``not``; symbols print through a
caller's ``name`` (a stream as ``x[i]``).  An expression with no spelling raises the
caller's error class, naming the function.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp
from sympy.printing.str import StrPrinter

from .functions import Step

# class name -> spec function name, for sympy's functions and for ours whose ``spec_name``
# is a reduction's (binary Maximum is "max" there; the elementwise function is "maximum")
SPEC_FUNCS = {"Maximum": "maximum", "Minimum": "minimum", "Max": "maximum", "Min": "minimum",
              "exp": "exp", "log": "log", "Abs": "abs", "tanh": "tanh", "sin": "sin",
              "cos": "cos", "erf": "erf", "log1p": "log1p", "expm1": "expm1", "floor": "floor",
              "ceiling": "ceil", "sign": "sign", "IsInf": "isinf", "IsFinite": "isfinite",
              "IsNaN": "isnan"}


class _SpecPrinter(StrPrinter):
    printmethod = "_redfuser_spec"  # skip the ``_sympystr`` of Maximum ("max": a reduction)

    def __init__(self, name: Callable[[sp.Symbol], str], error: type[Exception]):
        super().__init__()
        self._name, self._error = name, error

    def _print_Symbol(self, expr):
        return self._name(expr)

    def _print_Function(self, expr):
        if isinstance(expr, Step):  # no spec spelling: step(u) = 1 where u >= 0 (Step's own)
            return f"where({self._print(expr.args[0])} >= 0, 1, 0)"
        fname = SPEC_FUNCS.get(type(expr).__name__) or getattr(expr, "spec_name", None)
        if fname is None or fname == "as_written":
            raise self._error(f"`{expr}` has no spelling in the spec language")
        args = [self._print(a) for a in expr.args]
        while len(args) > 2 and fname in ("maximum", "minimum"):  # sympy's n-ary Max/Min
            args = [f"{fname}({args[0]}, {args[1]})", *args[2:]]
        return f"{fname}({', '.join(args)})"

    _print_Max = _print_Min = _print_BooleanFunction = _print_Function  # isinf(m) too

    def _print_And(self, expr):
        return "(" + " and ".join(self._print(a) for a in expr.args) + ")"

    def _print_Or(self, expr):
        return "(" + " or ".join(self._print(a) for a in expr.args) + ")"

    def _print_Not(self, expr):
        return f"(not {self._print(expr.args[0])})"

    def _print_Equality(self, expr):  # sympy's own prints Eq(a, b)
        return f"{self._print(expr.args[0])} == {self._print(expr.args[1])}"

    def _print_Unequality(self, expr):
        return f"{self._print(expr.args[0])} != {self._print(expr.args[1])}"

    def _print_Piecewise(self, expr):  # sympy's own form of sign(x) after a rewrite
        text = self._print(expr.args[-1].expr)
        if expr.args[-1].cond is not sp.true:  # no branch left: torch's and ours are NaN
            text = f"where({self._print(expr.args[-1].cond)}, {text}, nan)"
        for branch in reversed(expr.args[:-1]):
            text = f"where({self._print(branch.cond)}, {self._print(branch.expr)}, {text})"
        return text

    def _print_Exp1(self, expr):
        return "exp(1)"

    def _print_Infinity(self, expr):
        return "inf"

    def _print_NegativeInfinity(self, expr):
        return "(-inf)"

    def _print_Derivative(self, expr):
        raise self._error(f"`{expr}` has no spelling in the spec language")


def spec_text(expr: sp.Expr, name: Callable[[sp.Symbol], str],
              error: type[Exception] = ValueError) -> str:
    """``expr`` in the spec language; symbols print through ``name``.

    Examples
    --------
    >>> from algebra.functions import Where
    >>> x, m, d = sp.symbols("x m d", real=True)
    >>> spec_text(sp.exp(x - m) / d, lambda s: {"x": "x[i]"}.get(s.name, s.name))
    'exp(-m + x[i])/d'
    >>> spec_text(Where(sp.And(x > 0, m < 1), x, 0), str)
    'where((x > 0 and m < 1), x, 0)'
    """
    return _SpecPrinter(name, error).doprint(expr)
