"""sympy expression -> numpy closure that keeps the inputs' dtype.

``lambdify`` prints constants as Python floats and ``Max`` as ``amax`` over a
tuple; we want every constant cast to the working dtype (float32 in, float32
arithmetic) and our own elementwise kernels, so expressions are compiled here
into nested closures once and then called per element.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import reduce

import numpy as np
import sympy as sp

from .functions import NUMPY_KERNELS

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
    if expr.is_Add or expr.is_Mul:
        parts = [compile_expr(a) for a in expr.args]
        op = np.add if expr.is_Add else np.multiply
        return lambda env, dt: reduce(op, (p(env, dt) for p in parts))
    if expr.is_Pow:
        return _compile_pow(expr)
    kernel = NUMPY_KERNELS.get(type(expr).__name__)
    if kernel is None:
        raise NotImplementedError(f"no numpy kernel for {type(expr).__name__} in `{expr}`")
    args = [compile_expr(a) for a in expr.args]
    return lambda env, dt: kernel(*(a(env, dt) for a in args))


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
