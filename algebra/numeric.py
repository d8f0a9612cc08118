"""sympy expression -> numpy closure that keeps the inputs' dtype.

``lambdify`` prints constants as Python floats and ``Max`` as ``amax`` over a
tuple; we want every constant cast to the working dtype (float32 in, float32
arithmetic) and our own elementwise kernels, so expressions are compiled here
into nested closures once and then called per element.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from functools import reduce

import numpy as np
import sympy as sp

from .vocabulary import NUMPY_KERNELS

Env = Mapping[str, np.ndarray]
Compiled = Callable[[Env, np.dtype], np.ndarray]


def compile_expr(expr: sp.Expr) -> Compiled:
    """Compile ``expr`` to ``f(env, dtype)``; symbols are looked up by name in ``env``.

    Examples
    --------
    >>> x = sp.Symbol("x")
    >>> f = compile_expr(sp.exp(x) / 3)
    >>> f({"x": np.zeros(2, np.float32)}, np.dtype(np.float32)).dtype
    dtype('float32')
    """
    if expr.is_Symbol:
        name = expr.name
        return lambda env, dt: env[name]
    if expr.is_number:
        value = _constant(expr)
        return lambda env, dt: dt.type(value)
    if expr.is_Add:
        return _compile_add(expr)
    if expr.is_Mul:
        return _compile_mul(expr)
    if expr.is_Pow:
        return _compile_pow(expr)
    kernel = NUMPY_KERNELS.get(type(expr).__name__)
    if kernel is None:
        raise NotImplementedError(f"no numpy kernel for {type(expr).__name__} in `{expr}`")
    args = [compile_expr(a) for a in expr.args]
    return lambda env, dt: kernel(*(a(env, dt) for a in args))


# names of the per-row inputs (parameters, N) of the rule being run: a sum adds them last
PER_ROW: ContextVar[frozenset[str]] = ContextVar("per_row_inputs", default=frozenset())


def summands(terms, per_row: frozenset[str]) -> list:
    """The terms of a sum in the order the kernels and ``evaluate`` add them: those that
    vary along the row or are earlier results first, then those of per-row inputs only
    (``per_row``: parameters, N), then numbers.  sympy's order is alphabetical (``x - m + t``
    is ``-m + t + x``); adding ``t - m`` first loses a small t next to a huge m, where the
    spec's ``(x - m) + t`` is exact.

    Examples
    --------
    >>> x, m, t = sp.symbols("x m t", real=True)
    >>> summands((x - m + t + 1).args, frozenset({"t"}))
    [x, -m, t, 1]
    """
    def rank(a):
        if a.is_number:
            return 2
        return 1 if {str(s) for s in a.free_symbols} <= per_row else 0
    return sorted(terms, key=rank)  # stable: sympy's order within a rank


def _compile_add(expr: sp.Add) -> Compiled:
    """A sum in ``summands`` order, for the per-row inputs the caller set (``PER_ROW``)."""
    parts = dict(zip(expr.args, (compile_expr(a) for a in expr.args), strict=True))
    orders: dict[frozenset[str], list] = {}  # one order per rule run: sorted once

    def run(env, dt):
        per_row = PER_ROW.get()
        order = orders.get(per_row)
        if order is None:
            order = orders[per_row] = [parts[a] for a in summands(expr.args, per_row)]
        return reduce(np.add, (p(env, dt) for p in order))

    return run


def _compile_mul(expr: sp.Mul) -> Compiled:
    factors, ratios, divisors = mul_terms(expr)
    parts = [compile_expr(a) for a in factors]
    if not ratios and not divisors:
        return lambda env, dt: reduce(np.multiply, (p(env, dt) for p in parts))
    groups = [([(div, compile_expr(b)) for div, b in r.steps()], r.power) for r in ratios]
    below = [compile_expr(b) for b in divisors]

    def run(env, dt):
        values = [_steps(steps, env, dt) for steps, _ in groups]
        values = [v if k == 1 else np.power(v, dt.type(k))
                  for v, (_, k) in zip(values, groups, strict=True)]
        values += [p(env, dt) for p in parts]
        out = reduce(np.multiply, values) if values else dt.type(1)
        for b in below:  # divide, never multiply by a reciprocal (1/d overflows)
            out = np.divide(out, b(env, dt))
        return out

    return run


def _steps(steps: list, env: Env, dt: np.dtype) -> np.ndarray:
    out = steps[0][1](env, dt)
    for div, b in steps[1:]:
        out = np.divide(out, b(env, dt)) if div else np.multiply(out, b(env, dt))
    return out


def _constant(expr: sp.Expr) -> float:
    if expr is sp.S.Infinity or expr is sp.S.NegativeInfinity:
        return float(expr)
    value = complex(expr)
    if value.imag:
        raise NotImplementedError(f"complex constant `{expr}`")
    return value.real


def _compile_pow(expr: sp.Pow) -> Compiled:
    base, e = compile_expr(expr.base), expr.exp
    if e == sp.Rational(1, 2):
        return lambda env, dt: np.sqrt(base(env, dt))
    if e == -sp.Rational(1, 2):
        return lambda env, dt: dt.type(1) / np.sqrt(base(env, dt))
    if e == -1:
        return lambda env, dt: dt.type(1) / base(env, dt)
    if e == 2:
        return lambda env, dt: np.square(base(env, dt))
    if e.is_Integer:
        k = int(e)
        return lambda env, dt: np.power(base(env, dt), dt.type(k))
    exponent = compile_expr(e)
    return lambda env, dt: np.power(base(env, dt), exponent(env, dt))


@dataclass(frozen=True)
class Ratio:
    """(prod(num) / prod(den)) ** power: a user's normalisation (x / m)**2, which sympy stores
    as x**2 * m**-2, evaluated in the order that keeps it in range (x**2 overflows float32 at
    2e19 where (x / m)**2 does not)."""

    num: tuple[sp.Expr, ...]
    den: tuple[sp.Expr, ...]
    power: int

    def steps(self) -> list[tuple[bool, sp.Expr]]:
        """(divide?, operand) from the first numerator on: numerators and denominators
        interleaved (x / m * y / d), so no partial product strays far from the result."""
        out = []
        for k in range(max(len(self.num), len(self.den))):
            out += [(False, self.num[k])] if k < len(self.num) else []
            out += [(True, self.den[k])] if k < len(self.den) else []
        return out


def mul_terms(expr: sp.Mul) -> tuple[list[sp.Expr], list[Ratio], list[sp.Expr]]:
    """A product as (factors, ratios, divisors), evaluated as ``prod(factors) *
    prod(ratios)``, then divided by each divisor in turn: divisions are done as divisions,
    never as multiplications by a reciprocal (1/d overflows float32 for a subnormal d).
    Integer powers of the same magnitude pair up: ``x**2 * y * m**-2 * d**-1`` is
    ``(x / m)**2 * (y / d)``; a negative power left unpaired is a divisor (``m**-2``: m, m).

    Examples
    --------
    >>> x, m, d = sp.symbols("x m d")
    >>> mul_terms(3 * x**2 / m**2 / d)
    ([3], [Ratio(num=(x,), den=(m,), power=2)], [d])
    >>> mul_terms(x * sp.exp(m))
    ([x, exp(m)], [], [])
    """
    powers: dict[int, tuple[list, list]] = {}
    factors = []
    for f in expr.args:
        base, e = (f.base, f.exp) if f.is_Pow else (f, sp.S.One)
        if e.is_Integer and not f.is_number:
            powers.setdefault(abs(int(e)), ([], []))[int(e) < 0].append(base)
        else:
            factors.append(f)
    if not any(den for _, den in powers.values()):  # no division: the plain product
        return list(expr.args), [], []
    ratios, divisors = [], []
    for p, (num, den) in sorted(powers.items()):
        if num and den:
            ratios.append(Ratio(tuple(num), tuple(den), p))
        elif num:
            factors.extend(b ** p for b in num)
        else:
            divisors.extend(b for b in den for _ in range(p))
    return factors, ratios, divisors
