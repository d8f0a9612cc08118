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

from math import factorial

from ..tvm.ir import tirx
from .fastmath import ExpScheme, exp_scheme

F64 = "float64"
_DEGREE = 13  # r**14 / 14! < 4e-18 for |r| <= ln2/2
_TAYLOR = tuple(1.0 / factorial(k) for k in range(_DEGREE, -1, -1))  # highest power first


def _taylor(r):
    acc = tirx.const(_TAYLOR[0], F64)
    for c in _TAYLOR[1:]:
        acc = acc * r + tirx.const(c, F64)
    return acc


EXP64 = ExpScheme(
    F64, "int64", 52, 1023,
    lo=-745.2,  # below ln(2**-1075): exp rounds to 0
    top=710.0,  # above ln(DBL_MAX) = 709.78: 2**512 * 2**512 * p overflows to inf by itself
    ln2_hi=6.93147180369123816490e-01, ln2_lo=1.90821492927058770002e-10,  # fdlibm's split
    poly=_taylor)


def fast_exp64(x):
    """Vectorizable float64 ``exp(x)`` (module docstring)."""
    return exp_scheme(x, EXP64)
