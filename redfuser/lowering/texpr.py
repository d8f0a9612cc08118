"""sympy expression -> TIR PrimExpr, one table of node translations.

Symbols are looked up through a callback (the lowering decides whether a name is a
stream element, a state register or a bound let); ``Dot`` nodes are looked up the
same way because the lowering computes each dot product once per element.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import sympy as sp

from algebra.dtypes import COMPUTE, argument_dtype
from algebra.functions import Dot
from algebra.numeric import mul_terms, summands

from ..tvm.ir import LEAVES, tirx
from . import fastmath  # vectorizable polynomial versions (TVM's exp is a scalar call)
from .fastmath import FLOAT_BITS, isnan
from .fastmath64 import fast_exp64

BF16_BITS = argument_dtype("bfloat16")  # how a kernel declares a bfloat16 buffer
FAST_EXPS = {"float32": fastmath.fast_exp, "float64": fast_exp64}  # per compute dtype
F32 = COMPUTE.name  # bfloat16 converts through float32 (its top half)
Lookup = Callable[[sp.Expr], object]  # sympy Symbol or Dot -> PrimExpr
# The compute dtype of the kernel being built (``Geometry.compute``; ``computing``): the
# dtype of every literal whose caller names none (the lowering's many const(0), const(1))
_COMPUTE: ContextVar[str] = ContextVar("compute_dtype", default=F32)


@contextmanager
def computing(dtype: str) -> Iterator[None]:
    """Build with ``dtype`` as the compute dtype of unnamed literals (``const``)."""
    token = _COMPUTE.set(dtype)
    try:
        yield
    finally:
        _COMPUTE.reset(token)


def compute_dtype() -> str:
    """The compute dtype of the kernel being built (float32 outside ``computing``)."""
    return _COMPUTE.get()


def const(value: float, dtype: str | None = None):
    """A literal of ``dtype`` (default: the compute dtype), rounded to it first: sympy
    carries torch's mask value ``finfo(float32).min`` as a float64 a hair below -FLT_MAX,
    which TVM refuses as out of range in float32, while float32 rounds it to -FLT_MAX (and
    a value past the range to an infinity)."""
    dtype = dtype or compute_dtype()
    with np.errstate(over="ignore"):
        value = np.dtype(dtype).type(float(value))
    return tirx.const(float(value), dtype)


def loaded(buf, index: list, dtype: str = F32):
    """``buf[index]`` in the compute ``dtype``, converted in registers: float16 by a cast
    (F16C's vcvtph2ps on x86), bfloat16 (declared as its int16 bits, ``algebra.dtypes``)
    by moving its bits to the top half of a float32: exact (float64 to float32 rounds)."""
    value = buf[tuple(index)]
    if buf.dtype == BF16_BITS:
        wide = tirx.Cast("uint32", tirx.Cast("uint16", value))
        value = tirx.reinterpret(F32, tirx.shift_left(wide, tirx.const(16, "uint32")))
    return value if str(value.ty.dtype) == dtype else tirx.Cast(dtype, value)


def stored(value, dtype: str, intrinsic: str | None = None):
    """A computed value as a buffer of ``dtype`` holds it, rounded to nearest even (a NaN
    stays a quiet NaN of its sign; bfloat16: bits + 0x7FFF + the kept lowest bit, the top
    half kept, as TVM's own legalization and torch round, from float32: a float64 value is
    rounded to float32 first).  ``intrinsic``: a CPU instruction that rounds a whole vector
    of float32 values (``cpu.vector.NARROWINGS``), for a store in a loop vectorized at its
    width."""
    if dtype == BF16_BITS:
        value = value if str(value.ty.dtype) == F32 else tirx.Cast(F32, value)
        if intrinsic:
            return tirx.call_llvm_pure_intrin(BF16_BITS, intrinsic, value)
        return share(tirx.reinterpret("uint32", value), _bf16_bits)
    return value if str(value.ty.dtype) == dtype else tirx.Cast(dtype, value)


def _bf16_bits(bits):
    u32 = functools.partial(tirx.const, dtype="uint32")
    top = tirx.shift_right(bits, u32(16))
    even = tirx.shift_right(bits + u32(0x7FFF) + tirx.bitwise_and(top, u32(1)), u32(16))
    nan = tirx.bitwise_and(bits, u32(0x7FFFFFFF)) > u32(0x7F800000)
    return tirx.Cast(BF16_BITS, tirx.Select(nan, tirx.bitwise_or(top, u32(0x40)), even))


def share(value, body):
    """``body(v)`` with ``v`` standing for ``value``; a compound value is bound once (a PrimExpr
    may not appear twice when it binds variables)."""
    if isinstance(value, LEAVES):
        return body(value)
    return fastmath.let(value, body, "t")  # statement-level in the lowering (statement_lets)


def _pow(base, e: sp.Expr, dtype: str, go: Callable):
    """base**e: roots and small integer powers as exact products, a constant exponent as a
    constant, any other exponent (the count n of a prod finalize) as the TIR expression."""
    if not e.is_number:
        return tirx.pow(base, go(e))
    if e == sp.Rational(1, 2):
        return tirx.sqrt(base)
    if e == -sp.Rational(1, 2):
        return const(1, dtype) / tirx.sqrt(base)
    if e.is_Integer and abs(int(e)) <= 8:
        def product(b):
            out = b
            for _ in range(abs(int(e)) - 1):
                out = out * b
            return const(1, dtype) / out if e < 0 else out
        return share(base, product)
    return tirx.pow(base, const(e, dtype))


def _sign(x, dtype):
    zero = const(0, dtype)
    return share(x, lambda v: tirx.Select(v > zero, const(1, dtype),
                                          tirx.Select(v < zero, const(-1, dtype), v)))


def _maximum(a, b, dtype, pick=tirx.max):
    """np.maximum (np.minimum with ``pick=tirx.min``): a NaN on either side is the result.
    TVM compiles with LLVM's NoNaNsFPMath, so a float max or compare may drop a NaN; the
    test is on the bits, which no float assumption touches (docs/TVM-NOTES.md)."""
    return share(a, lambda u: share(b, lambda v: tirx.Select(
        tirx.Or(isnan(u), isnan(v)), u + v, pick(u, v))))  # NaN + anything is NaN


def round_half_even(x, dtype: str = F32):
    """np.round (half to even, the sign of a zero kept) from floor: TVM 0.27 miscompiles
    ``nearbyint`` bound by a statement let inside a vectorized loop (every lane gets the last
    lane's value; docs/TVM-NOTES.md), and floor vectorizes.  ``v - floor(v)`` is exact, so is
    the parity test of floor(v) below 2**(fraction + 1) (above it every float is an even
    integer): float32's 2**24, float64's 2**53.

    Examples
    --------
    >>> all("floor" in str(round_half_even(tirx.Var("v", t), t)) for t in ("float32", "float64"))
    True
    """
    if dtype not in FLOAT_BITS:
        return tirx.nearbyint(x)
    half, one, two = const(0.5, dtype), const(1, dtype), const(2, dtype)

    def body(v):
        return share(tirx.floor(v), lambda f: share(v - f, lambda frac: _signed_like(
            f + tirx.Select(tirx.Or(frac > half, tirx.And(
                tirx.EQ(frac, half), tirx.EQ(f - two * tirx.floor(f * half), one))),
                one, const(0, dtype)), v)))
    return share(x, body)


def _signed_like(magnitude, sign):
    """``magnitude`` with the sign bit of ``sign`` or'ed in: round(-0.4) is -0.0, as numpy."""
    return fastmath.copysign(magnitude, sign)


def _relu(x, dtype):
    zero = const(0, dtype)  # relu(NaN) = NaN, as np.maximum(x, 0)
    return share(x, lambda v: tirx.Select(isnan(v), v, tirx.max(v, zero)))


def _softplus(x, dtype, exp):
    zero = const(0, dtype)  # stable log(1 + exp(x))
    return share(x, lambda v: tirx.max(v, zero) + tirx.log1p(exp(-tirx.abs(v))))


# sympy class name -> builder(args, dtype, exp) ; one line each.
FUNCS: dict[str, Callable] = {
    "exp": lambda a, dt, exp: exp(a[0]),
    "log": lambda a, dt, exp: tirx.log(a[0]),
    "Abs": lambda a, dt, exp: tirx.abs(a[0]),
    "tanh": lambda a, dt, exp: tirx.tanh(a[0]),
    "Sigmoid": lambda a, dt, exp: const(1, dt) / (const(1, dt) + exp(-a[0])),
    "Relu": lambda a, dt, exp: _relu(a[0], dt),
    "Step": lambda a, dt, exp: tirx.Select(a[0] >= const(0, dt), const(1, dt), const(0, dt)),
    "Softplus": lambda a, dt, exp: _softplus(a[0], dt, exp),
    "sin": lambda a, dt, exp: tirx.sin(a[0]),
    "cos": lambda a, dt, exp: tirx.cos(a[0]),
    "erf": lambda a, dt, exp: tirx.erf(a[0]),
    "log1p": lambda a, dt, exp: tirx.log1p(a[0]),
    "expm1": lambda a, dt, exp: exp(a[0]) - const(1, dt),
    "floor": lambda a, dt, exp: tirx.floor(a[0]),
    "ceiling": lambda a, dt, exp: tirx.ceil(a[0]),
    "Round": lambda a, dt, exp: round_half_even(a[0], dt),  # half to even, as numpy
    "sign": lambda a, dt, exp: _sign(a[0], dt),
    "Maximum": lambda a, dt, exp: _maximum(a[0], a[1], dt),
    "Minimum": lambda a, dt, exp: _maximum(a[0], a[1], dt, tirx.min),
    "Clip": lambda a, dt, exp: _maximum(_maximum(a[0], a[1], dt), a[2], dt, tirx.min),  # np.clip
    "Where": lambda a, dt, exp: tirx.Select(a[0], a[1], a[2]),  # np.where: no branch leaks
    "StrictLessThan": lambda a, dt, exp: _compare(tirx.LT, *a),
    "LessThan": lambda a, dt, exp: _compare(tirx.LE, *a),
    "StrictGreaterThan": lambda a, dt, exp: _compare(tirx.GT, *a),
    "GreaterThan": lambda a, dt, exp: _compare(tirx.GE, *a),
    "Equality": lambda a, dt, exp: _compare(tirx.EQ, *a),  # PrimExpr == is object identity
    "Unequality": lambda a, dt, exp: _compare(tirx.NE, *a),
    "And": lambda a, dt, exp: functools.reduce(tirx.And, a),  # sympy's And/Or are n-ary
    "Or": lambda a, dt, exp: functools.reduce(tirx.Or, a),
    "Not": lambda a, dt, exp: tirx.Not(a[0]),
    "IsInf": lambda a, dt, exp: fastmath.isinf(a[0]),  # on the bits: never folded away
    "IsFinite": lambda a, dt, exp: fastmath.isfinite(a[0]),
    "IsNaN": lambda a, dt, exp: isnan(a[0]),
    "AsWritten": lambda a, dt, exp: fastmath.as_written(a[0]),
}


def _compare(op, a, b):
    """An IEEE comparison: false when either float operand is NaN, except ``!=``, true then.
    TVM compiles with LLVM's NoNaNsFPMath, under which a compare's answer at a NaN is
    undefined (and TVM's simplifier rewrites ``not (a > b)`` to ``a <= b``), so the NaN
    tests are explicit, on the bits; an operand that cannot be NaN (an integer, a literal)
    needs none."""
    def test(u, v):
        nans = [isnan(w) for w in (u, v) if _may_be_nan(w)]
        if not nans:
            return op(u, v)
        if op is tirx.NE:
            return functools.reduce(tirx.Or, nans, op(u, v))
        return functools.reduce(tirx.And, [tirx.Not(n) for n in nans], op(u, v))
    a, b = _integers(a, b)
    return share(a, lambda u: share(b, lambda v: test(u, v)))


def _is_float(e) -> bool:
    return str(e.ty.dtype).startswith("float")


def _integers(a, b):
    """Two integers cast to float (the index ``i`` and an ``argmax`` result) compare as
    integers: exact past 2**24, where float32 would merge neighbours."""
    if all(isinstance(e, tirx.Cast) and not _is_float(e.value) for e in (a, b)):
        return tirx.Cast("int64", a.value), tirx.Cast("int64", b.value)
    return a, b


def _may_be_nan(e) -> bool:
    """Whether ``e`` may hold a NaN: not an integer, a literal number, or an integer cast
    to float (the stream index ``i``)."""
    if not _is_float(e):
        return False
    if isinstance(e, tirx.Cast):
        return _may_be_nan(e.value)
    return not (isinstance(e, tirx.FloatImm) and not np.isnan(e.value))


def to_tir(expr: sp.Expr, lookup: Lookup, dtype: str = F32, fast_math: bool = True,
           invariant: frozenset[str] = frozenset(), exp: Callable | None = None):
    """Translate ``expr``; symbols and dot products come from ``lookup``.  ``invariant``:
    names that hold one value for the whole kernel row (parameters, N); a division by an
    expression of them only is a multiplication by its reciprocal, which LLVM hoists out of
    the element loop (a division by anything else is a division: ``_mul``).  ``exp``: the
    float32 fast exp's builder (default ``fastmath.fast_exp``; a CPU's own, ``cpu.vector``;
    float64's is ``fastmath64.fast_exp64``).

    Examples
    --------
    >>> x = sp.Symbol("x")
    >>> v = tirx.Var("v", "float32")
    >>> to_tir(2 * x + 1, lambda s: v, fast_math=False)
    T.float32(2.0) * v + T.float32(1.0)
    """
    # each compute dtype's polynomial exp (TVM's is a libm call per lane)
    exps = FAST_EXPS | ({F32: exp} if exp else {})
    exp = exps[dtype] if fast_math and dtype in exps else tirx.exp

    def go(e: sp.Expr):
        if e.is_Symbol or isinstance(e, Dot):
            value = lookup(e)  # an index result (argmax) is an integer: a number here
            return value if _is_float(value) else tirx.Cast(dtype, value)
        if e.is_number:
            return const(e, dtype)
        if e.is_Add and (common := sp.factor_terms(e)).is_Mul:
            return go(common)  # (x - m) / T, not x/T - m/T: x - m is exact when x is near m
        if e.is_Mul:
            return _mul(e, go, dtype, invariant)
        if e.is_Add:
            terms = [go(a) for a in summands(e.args, invariant)]
            out = terms[0]
            for t in terms[1:]:
                out = out + t
            return out
        if e.is_Pow:
            return _pow(go(e.base), e.exp, dtype, go)
        build = FUNCS.get(type(e).__name__)
        if build is None:
            raise NotImplementedError(f"no TIR lowering for {type(e).__name__} in `{e}`")
        return build([go(a) for a in e.args], dtype, exp)

    if expr.is_Symbol:  # a value as it is: an index result stays an integer
        return lookup(expr)
    return go(expr)


def _mul(e: sp.Mul, go, dtype: str, invariant: frozenset[str]):
    """A product in the order ``algebra.numeric.mul_terms`` gives (the numpy run's): a
    normalisation such as (x / m)**2 as a ratio first, divisors divided last, so 1/m never
    overflows for a subnormal m.  A divisor of per-row values only (a temperature T) is a
    reciprocal instead: loop-invariant, so LLVM computes it once per row, and a division
    per element costs 20x a multiply."""
    def per_row(b):
        return {str(s) for s in b.free_symbols} <= invariant

    def divide(v, b):
        return v * (const(1, dtype) / go(b)) if per_row(b) else v / go(b)

    factors, ratios, divisors = mul_terms(e)
    values = []
    for r in ratios:
        steps = r.steps()
        v = go(steps[0][1])
        for div, b in steps[1:]:
            v = divide(v, b) if div else v * go(b)
        values.append(_pow(v, sp.Integer(r.power), dtype, go) if r.power != 1 else v)
    values += [go(a) for a in _numbers_first(factors)]
    out = values[0] if values else const(1, dtype)
    for v in values[1:]:
        out = out * v
    for b in divisors:
        out = divide(out, b)
    return out


def _numbers_first(args: list[sp.Expr]) -> list[sp.Expr]:
    return [a for a in args if a.is_number] + [a for a in args if not a.is_number]
