"""Vectorizable float64 ``exp`` for the kernels that compute in float64 (``texpr.to_tir``).

TVM's ``exp`` of a float64 vector is one libm call per lane (LLVM has no vector exp to
lower it to): a float64 softmax ran 24x slower than a float32 one.  This one is the float32
``fastmath.fast_exp``'s scheme in float64: Cody-Waite reduction ``x = n*ln2 + r`` (|r| <=
ln2/2, ln 2 split in fdlibm's two parts, so ``n * _LN2_HI`` is exact), then ``exp(r)`` by
its Taylor polynomial to degree 13, whose first omitted term, r**14/14!, is below 4e-18 of
the result (under half an ulp): the coefficients are 1/k!, no fitted constants.  ``2**n``
comes from exponent bits in two factors, so a subnormal result is rounded once (as libm's)
and the top of the range overflows to inf by itself.

Accuracy (against numpy's exp, ``tests/lowering/test_fastmath64.py``): within 2 ulp on
[-745, 709.78], 0 below -745.2 and inf above 709.79, ``exp(-inf) = 0``, ``exp(inf) = inf``,
``exp(nan) = nan``.

Examples
--------
>>> from ..tvm.ir import tirx
>>> str(fast_exp64(tirx.Var("x", "float64")).ty.dtype)
'float64'
"""

from __future__ import annotations

from math import factorial, log

from ..tvm.ir import tirx
from .fastmath import let

F64 = "float64"
_LOG2E = 1 / log(2)
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10  # fdlibm's split
_LO = -745.2  # below ln(2**-1075): exp rounds to 0
_TOP = 710.0  # above ln(DBL_MAX) = 709.78: 2**512 * 2**512 * p overflows to inf by itself
_DEGREE = 13  # r**14 / 14! < 4e-18 for |r| <= ln2/2
_TAYLOR = tuple(1.0 / factorial(k) for k in range(_DEGREE, -1, -1))  # highest power first


def _f(value: float):
    return tirx.const(value, F64)


def _pow2(n):
    """2**n as float64 for int64 ``n`` in [-1022, 1023], from exponent bits."""
    return tirx.reinterpret(F64, tirx.shift_left(n + tirx.const(1023, "int64"),
                                                 tirx.const(52, "int64")))


def fast_exp64(x):
    """Vectorizable float64 ``exp(x)`` (module docstring)."""
    def reduced(xc, n):
        def poly(r):
            acc = _f(_TAYLOR[0])
            for c in _TAYLOR[1:]:
                acc = acc * r + _f(c)
            ni = tirx.Cast("int64", n)
            half = tirx.shift_right(ni, tirx.const(1, "int64"))  # both factors normal
            return acc * _pow2(half) * _pow2(ni - half)

        return let(xc - n * _f(_LN2_HI) - n * _f(_LN2_LO), poly, "exp_r")

    def select(xc):  # the Let outermost: TVM's vectorizer mishandles Lets under a Select
        y = let(tirx.floor(xc * _f(_LOG2E) + _f(0.5)), lambda n: reduced(xc, n), "exp_n")
        return tirx.Select(x < _f(_LO), _f(0.0), y)

    # a NaN passes both clamps (each compares false) and the polynomial keeps it
    low = tirx.Select(x < _f(_LO), _f(_LO), x)
    return let(low, lambda xl: let(tirx.Select(xl > _f(_TOP), _f(_TOP), xl), select,
                                   "exp_c"), "exp_l")
