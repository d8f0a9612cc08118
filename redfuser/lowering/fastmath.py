"""Vectorizable float32 ``exp``, ``log``, ``tanh``, ``sigmoid`` as TIR scalar expressions.

``tirx.exp`` in a ``T.vectorized`` loop becomes one scalar ``expf`` call per lane (docs/
TVM-NOTES.md).  These builders use only arithmetic, comparisons, ``Select``, ``floor`` and
bit reinterpretation, so LLVM emits plain vector code with no libm calls.  Each takes a
float32 ``PrimExpr`` (or a Python number) and returns one; intermediates are bound with
expression-level ``tirx.Let``.  Polynomials are Cephes' single-precision ones (S. Moshier);
the errors quoted were measured against float64 numpy on an FMA target (``cpu_target()``)
by tests/lowering/test_fastmath.py.  A float64 kernel uses TVM's own ``exp`` (libm, exact
to float64; ``texpr.to_tir``).  The tests on the bits (``isnan``, ``isfinite``, ...) take
either compute dtype (``FLOAT_BITS``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np

from ..tvm.ir import IRBuilder, T, arg_buffer, tirx

__all__ = ["fast_exp", "fast_log", "fast_tanh", "fast_sigmoid", "elementwise_kernel"]

F32 = "float32"
_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # Cody-Waite split: n * _LN2_HI is exact
_EXP_LO, _EXP_HI = -87.33654, 88.72283  # ln(FLT_MIN), ln(FLT_MAX), rounded inwards
_EXP_TOP = 89.0  # clamp above ln(FLT_MAX): exp overflows to inf there by itself
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
          1.6666665459e-1, 5.0000001201e-1)
_LOG_P = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
          1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
          3.3333331174e-1)
_TANH_P = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
           -3.33332819422e-1)
_FLT_MIN = float(np.finfo(np.float32).tiny)
_SQRT_HALF_BITS = 0x3F3504F3  # float32 bits of sqrt(0.5)
_INF = float("inf")


def _f(value: float):
    return tirx.const(value, F32)


def _i(value: int):
    return tirx.const(value, "int32")


def _as_f32(x):
    if isinstance(x, (int, float)):
        return _f(float(x))
    if str(x.ty.dtype) != F32:
        raise TypeError(f"fastmath builders take float32 expressions, got {x.ty.dtype}")
    return x


_BINDER: ContextVar = ContextVar("fastmath_binder", default=None)


@contextmanager
def statement_lets(bind):
    """Bind intermediates with ``bind`` (e.g. ``T.bind`` inside an IRBuilder frame) instead of
    expression-level Lets: TVM's vectorizer mishandles Lets nested under a Select."""
    token = _BINDER.set(bind)
    try:
        yield
    finally:
        _BINDER.reset(token)


def let(value, body, name: str):
    """``body(v)`` with ``v`` bound to ``value`` (an expression Let unless statement_lets)."""
    bind = _BINDER.get()
    if bind is not None:
        return body(bind(value))
    var = tirx.Var(name, value.ty.dtype)
    return tirx.Let(var, value, body(var))


@dataclass(frozen=True)
class FloatBits:
    """The bit layout of one IEEE float dtype, for tests on the bits (``isnan``)."""

    bits: str  # the integer dtype of its width
    inf: int  # the bits of +inf: exponent all ones, fraction zero
    magnitude: int  # every bit but the sign

    def of(self, value: int):
        return tirx.const(value, self.bits)


FLOAT_BITS = {
    "float32": FloatBits("int32", 0x7F800000, 0x7FFFFFFF),
    "float64": FloatBits("int64", 0x7FF0000000000000, 0x7FFFFFFFFFFFFFFF),
}


def float_bits(dtype: str) -> FloatBits:
    """The ``FloatBits`` of a float dtype's name (a clear error for any other).

    Examples
    --------
    >>> float_bits("float64").bits
    'int64'
    """
    if str(dtype) not in FLOAT_BITS:
        raise TypeError(f"bit tests take {' or '.join(FLOAT_BITS)} values, not {dtype}")
    return FLOAT_BITS[str(dtype)]


def _bits(x) -> tuple[FloatBits, object]:
    """(the layout of ``x``'s dtype, its bits as an integer)."""
    layout = float_bits(x.ty.dtype)
    return layout, tirx.reinterpret(layout.bits, x)


def isnan(x):
    """NaN test on the bits (exponent all ones, fraction non-zero).

    ``tirx.isnan`` of a let-bound value inside a vectorized loop makes TVM 0.27 scalarize
    the loop and lose its variable, and ``x != x`` is folded to false by the simplifier."""
    layout = float_bits(x.ty.dtype)
    return abs_bits(x) > layout.of(layout.inf)


def as_written(x):
    """``x``, in a form TVM's simplifier cannot match against ``x`` itself (it folds
    ``x - x`` to 0 and ``x == x`` to true for floats, where inf and NaN make both wrong): the
    value round-trips through its integer bits, which no rewrite rule undoes.  The spec
    parser wraps one operand of every operation that sympy would have folded
    (``algebra.ieee.AsWritten``)."""
    return tirx.reinterpret(x.ty.dtype, _bits(x)[1])


def abs_bits(x):
    """The integer bits of |x|: ordered like |x| for numbers, above those of inf for NaN."""
    layout, bits = _bits(x)
    return tirx.bitwise_and(bits, layout.of(layout.magnitude))


def isfinite(x):
    """Finiteness on the bits (exponent not all ones), for the same reasons as ``isnan``."""
    layout, bits = _bits(x)
    return tirx.bitwise_and(bits, layout.of(layout.inf)) != layout.of(layout.inf)


def isinf(x):
    """+-inf on the bits (exponent all ones, fraction zero), for the same reasons as ``isnan``."""
    layout = float_bits(x.ty.dtype)
    return abs_bits(x) == layout.of(layout.inf)


def copysign(magnitude, sign):
    """``magnitude`` (>= 0) with the sign bit of ``sign`` or'ed in, on the bits: TVM's
    vectorizer scalarizes the copysign intrinsic when its argument holds a Let (as
    fast_exp's result does)."""
    layout, bits = _bits(magnitude)
    top = layout.of(~layout.magnitude)  # the sign bit alone, as a signed integer
    return tirx.reinterpret(magnitude.ty.dtype, tirx.bitwise_or(
        bits, tirx.bitwise_and(tirx.reinterpret(layout.bits, sign), top)))


@dataclass(frozen=True)
class ExpScheme:
    """The facts of one dtype's polynomial exp; ``exp_scheme`` is the computation they share:
    Cody-Waite reduction ``x = n*ln2 + r`` (|r| <= ln2/2; ``ln2_hi`` has trailing zero bits,
    so ``n * ln2_hi`` is exact), ``poly(r)`` ~ exp(r), and ``2**n`` from exponent bits in
    two factors (so a result at the bottom of the range is rounded once and the top
    overflows to inf by itself)."""

    dtype: str
    bits: str  # the integer dtype of its width
    fraction: int  # explicit fraction bits: where the exponent field starts
    bias: int  # the exponent's bias
    lo: float  # below: 0
    top: float  # clamp: past it the result overflows to inf by itself
    ln2_hi: float
    ln2_lo: float
    poly: Callable  # exp(r) on [-ln2/2, ln2/2], from a PrimExpr r of ``dtype``

    def const(self, value: float):
        return tirx.const(value, self.dtype)

    def pow2(self, n):
        """2**n for an integer ``n`` (of ``bits``) in the normal range, from exponent bits."""
        return tirx.reinterpret(self.dtype, tirx.shift_left(
            n + tirx.const(self.bias, self.bits), tirx.const(self.fraction, self.bits)))


def exp_scheme(x, scheme: ExpScheme, ldexp: bool = False):
    """``exp(x)`` by ``scheme``; ``ldexp``: scale by LLVM's ldexp (one instruction where the
    CPU has one, AVX-512's vscalefps) instead of the exponent bits."""
    c = scheme.const
    # Clamp with two flat Selects written so that a NaN passes through (``lo if x < lo else
    # x``: x86 max/min return their second operand on NaN, so LLVM emits one vmax/vmin
    # each): the NaN then flows through the polynomial to the result with no test of its
    # own.
    def reduced(xc, n):  # exp(r) for r = xc - n*ln2 in [-ln2/2, ln2/2], then scale by 2**n
        def scaled(r):
            p, ni = scheme.poly(r), tirx.Cast(scheme.bits, n)
            if ldexp:
                return tirx.call_llvm_pure_intrin(scheme.dtype, "llvm.ldexp", p,
                                                  tirx.Cast("int32", n))
            half = tirx.shift_right(ni, tirx.const(1, scheme.bits))  # 2**half * 2**(n - half)
            return p * scheme.pow2(half) * scheme.pow2(ni - half)

        return let(xc - n * c(scheme.ln2_hi) - n * c(scheme.ln2_lo), scaled, "exp_r")

    def select(xc):  # the Let outermost: TVM's vectorizer mishandles Lets under a Select
        y = let(tirx.floor(xc * c(_LOG2E) + c(0.5)), lambda n: reduced(xc, n), "exp_n")
        return tirx.Select(x < c(scheme.lo), c(0.0), y)

    low = tirx.Select(x < c(scheme.lo), c(scheme.lo), x)
    return let(low, lambda xl: let(tirx.Select(xl > c(scheme.top), c(scheme.top), xl),
                                   select, "exp_c"), "exp_l")


def _horner(x, coeffs):
    acc = tirx.const(coeffs[0], x.ty.dtype)
    for k in coeffs[1:]:
        acc = acc * x + tirx.const(k, x.ty.dtype)
    return acc


EXP32 = ExpScheme(F32, "int32", 23, 127, _EXP_LO, _EXP_TOP, _LN2_HI, _LN2_LO,
                  lambda r: _horner(r, _EXP_P) * (r * r) + r + _f(1.0))


def fast_exp(x, ldexp: bool = False):
    """Vectorizable float32 ``exp(x)``.

    Cody-Waite reduction ``x = n*ln2 + r`` (``|r| <= ln2/2``), a degree-7 polynomial for
    ``exp(r)`` in Horner form, and ``2**n`` from exponent bits (two factors, so ``n = 128``
    does not overflow), or with ``ldexp`` by LLVM's ``ldexp`` (exact for every n; only where
    the target lowers a vector of it to an instruction, ``cpu.vector.VectorIsa.ldexp``:
    elsewhere it is a libm call per lane).

    Parameters
    ----------
    x : PrimExpr
        float32 expression (or a Python number).
    ldexp : bool
        scale by ``llvm.ldexp`` instead of the exponent bits.

    Returns
    -------
    PrimExpr

    Notes
    -----
    Accuracy: max relative error 8.5e-8 (1.0 ulp) on [-87, 88].
    Special values: 0 for ``x < -87.33654`` (= ln FLT_MIN: no denormal results), ``+inf``
    for ``x > 88.72283`` (= ln FLT_MAX), ``exp(-inf) = 0``, ``exp(inf) = inf``,
    ``exp(nan) = nan``.

    Examples
    --------
    >>> str(fast_exp(tirx.Var("x", "float32")).ty.dtype)
    'float32'
    """
    return let(_as_f32(x), lambda v: exp_scheme(v, EXP32, ldexp), "exp_x")


def _log_body(x):
    tiny = x < _f(_FLT_MIN)  # denormals: scale by 2**23 first
    ix = tirx.reinterpret("int32", tirx.Select(tiny, x * _f(2.0**23), x))
    ix = ix + _i(0x3F800000 - _SQRT_HALF_BITS)  # mantissa m lands in [sqrt(.5), sqrt(2))
    k = tirx.shift_right(ix, _i(23)) - tirx.Select(tiny, _i(127 + 23), _i(127))
    m = tirx.reinterpret(F32, tirx.bitwise_and(ix, _i(0x007FFFFF)) + _i(_SQRT_HALF_BITS))

    def poly(f):
        def tail(fk):
            z = f * f
            y = _horner(f, _LOG_P) * f * z + fk * _f(_LN2_LO) - _f(0.5) * z
            return f + y + fk * _f(_LN2_HI)

        return let(tirx.Cast(F32, k), tail, "log_k")

    y = let(m - _f(1.0), poly, "log_f")
    special = tirx.Select(x == _f(0.0), _f(-_INF), _f(float("nan")))
    return tirx.Select(x < _f(_INF), tirx.Select(x > _f(0.0), y, special), x)


def fast_log(x):
    """Vectorizable float32 natural logarithm.

    ``x = m * 2**k`` with ``m`` in ``[sqrt(0.5), sqrt(2))`` by integer operations on the
    bits, ``log(m) = f - f**2/2 + f**3 P(f)`` with ``f = m - 1`` and ``P`` of degree 8,
    plus ``k*ln2`` added in two parts.

    Parameters
    ----------
    x : PrimExpr
        float32 expression (or a Python number).

    Returns
    -------
    PrimExpr

    Notes
    -----
    Accuracy: max relative error 8.0e-8 (0.83 ulp) on normal positive floats.  Denormal
    inputs are rescaled by ``2**23`` first and are as accurate (4.4e-8) unless the CPU runs
    with denormals-are-zero.
    Special values: ``log(+-0) = -inf``, ``log(x < 0) = nan``, ``log(inf) = inf``,
    ``log(nan) = nan``.

    Examples
    --------
    >>> str(fast_log(tirx.Var("x", "float32")).ty.dtype)
    'float32'
    """
    return let(_as_f32(x), _log_body, "log_x")


def _tanh_body(x):
    def on_abs(z):  # tanh(|x|) >= 0; the sign (also of -0.0) is copied back at the end
        z2 = z * z
        small = _horner(z2, _TANH_P) * z2 * z + z  # |x| < 0.625: odd polynomial, no cancellation
        e = fast_exp(_f(2.0) * tirx.min(z, _f(10.0)))  # tanh(10) == 1 in f32
        return let(e, lambda e: tirx.Select(z < _f(0.625), small,
                                            _f(1.0) - _f(2.0) / (e + _f(1.0))), "tanh_e")

    y = copysign(let(tirx.abs(x), on_abs, "tanh_z"), x)
    return tirx.Select(isnan(x), x, y)


def fast_tanh(x):
    """Vectorizable float32 hyperbolic tangent.

    An odd polynomial of degree 11 for ``|x| < 0.625`` (no cancellation near 0), else
    ``sign(x) * (1 - 2/(exp(2|x|) + 1))`` with :func:`fast_exp`, ``|x|`` clamped to 10.

    Parameters
    ----------
    x : PrimExpr
        float32 expression (or a Python number).

    Returns
    -------
    PrimExpr

    Notes
    -----
    Accuracy: max absolute error 8.0e-8; max relative error 1.4e-7 (1.3 ulp), also near 0
    and for denormal ``x``.
    Special values: ``tanh(+-inf) = +-1``, ``tanh(+-0) = +-0``, ``tanh(nan) = nan``.

    Examples
    --------
    >>> str(fast_tanh(tirx.Var("x", "float32")).ty.dtype)
    'float32'
    """
    return let(_as_f32(x), _tanh_body, "tanh_x")


def fast_sigmoid(x):
    """Vectorizable float32 logistic sigmoid ``1 / (1 + exp(-x))`` via :func:`fast_exp`.

    Parameters
    ----------
    x : PrimExpr
        float32 expression (or a Python number).

    Returns
    -------
    PrimExpr

    Notes
    -----
    Accuracy: max absolute error 9.0e-8; max relative error 1.5e-7 (2.5 ulp) on [-87, 88].
    0 for ``x < -88.72`` (true value < 4e-39).
    Special values: ``sigmoid(-inf) = 0``, ``sigmoid(inf) = 1``, ``sigmoid(nan) = nan``.

    Examples
    --------
    >>> from redfuser.runtime import evaluate_elementwise
    >>> evaluate_elementwise(fast_sigmoid, np.array([0.0, np.inf, -np.inf], "float32"))
    array([0.5, 1. , 0. ], dtype=float32)
    """
    return _f(1.0) / (_f(1.0) + fast_exp(-_as_f32(x)))


def elementwise_kernel(builder, n: int, lanes: int = 16, parallel: bool = False,
                       name: str = "fastmath_kernel", dtype: str = F32):
    """A PrimFunc ``name(x, y)`` computing ``y[i] = builder(x[i])`` over ``dtype``[n].

    The inner loop is ``T.vectorized(0, lanes)``; ``n`` must be a multiple of ``lanes``.
    With ``parallel`` the outer loop runs on ``TVM_NUM_THREADS`` threads.

    Examples
    --------
    >>> "T.vectorized(16)" in elementwise_kernel(fast_exp, 64).script()
    True
    """
    if n % lanes:
        raise ValueError(f"n={n} is not a multiple of lanes={lanes}")
    outer = T.parallel if parallel else T.serial
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            x, y = arg_buffer("x", (n,), dtype), arg_buffer("y", (n,), dtype)
            with outer(0, n // lanes) as o:
                with T.vectorized(0, lanes) as lane:
                    T.buffer_store(y, builder(x[o * lanes + lane]), [o * lanes + lane])
    return ib.get()
