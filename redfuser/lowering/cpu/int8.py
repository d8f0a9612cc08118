"""Exact int8 GEMM on AMX tiles, AVX-512 VNNI or AVX2 (the best the CPU has:
``vector.isa_for``), and the per-token quantization + GEMM kernel on it: the PrimFuncs.
The dot-product instructions are ``int8_isa``, the packed weights and the kernels' buffers
``int8_pack``, the micro-kernels ``int8_kernel``.

Per-token quantization (``quant_gemm``) runs per row while the row is in cache: the
absolute max on the float bits (int max: exact, and NaN sorts above inf), then
``clip(round(x * 127 / a), -127, 127)`` evaluated as numpy does in float32 (the product,
then a true division, then round half to even), stored as bytes.  The epilogue is the
spec's ``((acc * a) / 127) * ws`` in float32, left to right, as numpy evaluates it.  A row
whose ``a`` is 0, inf or NaN is NaN in numpy (0/0, inf/inf, NaN), and NaN here.
"""

from __future__ import annotations

from algebra.dtypes import argument_dtype

from ...tvm.ir import IRBuilder, T, arg_buffer, tirx
from ..signature import F32, I32
from ..texpr import const, loaded, round_half_even
from .amx import zero_rows
from .int8_isa import I8, QMAX, DotIsa, check_k, check_range
from .int8_kernel import gemm, lanes_of, like
from .int8_pack import ROW_LANES, arguments, pack_into, scratch_shapes, weight_shapes

INF_BITS = 0x7F800000  # float32 bits of +inf; |x| bits above it are NaN


def _exact(isa: DotIsa, colsum, col, acc):
    """The integer product from the offset one: sum u w - offset * colsum."""
    if not isa.offset:
        return acc
    return acc - like(tirx.const(isa.offset, I32), acc) * colsum[col]


def int8_gemm(isa: DotIsa, m: int, k: int, n: int, name: str = "int8_gemm"):
    """PrimFunc ``(q int8 (m, k), w int8 (k, n), y int32 (m, n))``: ``y = q @ w`` exactly, for
    any int8 ``q`` (an ISA exact only above -128 is refused).

    Examples
    --------
    >>> from redfuser.lowering.cpu.int8_isa import AVX512_VNNI
    >>> "vpdpbusd" in int8_gemm(AVX512_VNNI, 8, 64, 64).script()
    True
    """
    check_range(isa, -128)
    check_k(isa, k)
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            q, w = arg_buffer("q", (m, k), I8), arg_buffer("w", (k, n), I8)
            y = arg_buffer("y", (m, n), I32)
            bufs = arguments(scratch_shapes(isa, m, k, n))
            u, colsum = bufs["u"], bufs.get("colsum")
            pack_into(isa, w, bufs["packed"], colsum, k, n)
            with T.parallel(0, m) as r:
                with T.serial(0, u.shape[1]) as kk:
                    inside = tirx.Cast(I32, q[r, tirx.min(kk, k - 1)]) + isa.offset
                    value = tirx.Select(kk < k, inside, tirx.const(0, I32))
                    T.buffer_store(u, tirx.Cast(isa.a_dtype, value), [r, kk])
            zero_rows(u, m)
            gemm(isa, bufs, (m, k, n), lambda r, col, acc: T.buffer_store(
                y, _exact(isa, colsum, col, acc), [r, col]))
    return ib.get()


def quant_gemm(isa: DotIsa, m: int, k: int, n: int, name: str = "quant_gemm",
               packed: bool = False, x_dtype: str = F32):
    """PrimFunc ``(x (m, k), wq int8 (k, n), ws f32 (n,), y f32 (m, n), *scratch)`` of the
    cascade ``a = max(abs(x[i])); y = sum(clip(round(x[i] * 127 / a), -127, 127) * wq[i, :])
    * a / 127 * ws[:]``: per-token quantization while the row is in cache, then the integer
    GEMM.  ``packed``: the weights come as ``pack_weights`` left them (``weight_shapes``'
    buffers in place of ``wq``, not in the scratch).  ``x_dtype``: the activations' storage
    dtype (``algebra.dtypes``); each is converted to float32 as it is loaded (exact), so the
    result is that of their float32 values.

    Examples
    --------
    >>> from redfuser.lowering.cpu.int8_isa import AVX2_BYTES
    >>> script = quant_gemm(AVX2_BYTES, 8, 64, 64).script()
    >>> "pmadd" in script and "T.parallel" in script
    True
    """
    check_range(isa, -QMAX)
    check_k(isa, k)
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            x = arg_buffer("x", (m, k), argument_dtype(x_dtype))
            given = arguments(weight_shapes(isa, k, n) if packed else {"wq": ((k, n), I8)})
            ws, y = arg_buffer("ws", (n,), F32), arg_buffer("y", (m, n), F32)
            bufs = {**arguments(scratch_shapes(isa, m, k, n, packed)), **given}
            if not packed:
                pack_into(isa, given["wq"], bufs["packed"], bufs.get("colsum"), k, n)
            with T.parallel(0, m) as r:
                _quantize_row(isa, x, bufs["u"], bufs["amax"], r, k)
            zero_rows(bufs["u"], m)
            gemm(isa, bufs, (m, k, n), _scaled(isa, y, bufs.get("colsum"), bufs["amax"], ws))
    return ib.get()


def _row_amax_bits(x, r, k: int):
    """The int32 bits of max |x[r, :]|: an int max of the bits is exact and keeps NaN (above
    inf), which a float max under LLVM's no-NaN flags may drop."""
    lanes = T.alloc_buffer((ROW_LANES,), I32, scope="local")
    with T.vectorized(0, ROW_LANES) as j:
        T.buffer_store(lanes, tirx.const(0, I32), [j])
    with T.serial(0, k // ROW_LANES) as c:
        with T.vectorized(0, ROW_LANES) as j:
            bits = _abs_bits(loaded(x, [r, c * ROW_LANES + j]))
            T.buffer_store(lanes, tirx.max(lanes[j], bits), [j])
    with T.serial(k // ROW_LANES * ROW_LANES, k) as kk:
        T.buffer_store(lanes, tirx.max(lanes[0], _abs_bits(loaded(x, [r, kk]))), [0])
    with T.serial(1, ROW_LANES) as j:
        T.buffer_store(lanes, tirx.max(lanes[0], lanes[j]), [0])
    return lanes[0]


def _abs_bits(v):
    return tirx.bitwise_and(tirx.reinterpret(I32, v), tirx.const(0x7FFFFFFF, I32))


def _quantize_row(isa: DotIsa, x, u, amax, r, k: int):
    """amax[r] = max |x[r, :]| (NaN when 0, inf or NaN: the row is NaN in numpy, 0/0 or
    inf/inf or NaN), u[r, :] = clip(round(x * 127 / a), -127, 127) + offset."""
    bits = T.bind(_row_amax_bits(x, r, k))
    good = T.bind(tirx.And(bits > 0, bits < INF_BITS))
    a = T.bind(tirx.Select(good, tirx.reinterpret(F32, bits), const(1)))
    T.buffer_store(amax, tirx.Select(good, a, const(float("nan"))), [r])

    def store(kk):
        v = loaded(x, [r, kk]) * const(QMAX) / a  # numpy's order: the product, then a division
        q = tirx.min(tirx.max(round_half_even(v), const(-QMAX)), const(QMAX))
        value = tirx.Cast(I32, tirx.Select(good, q, const(0))) + isa.offset
        T.buffer_store(u, tirx.Cast(isa.a_dtype, value), [r, kk])

    with T.serial(0, k // ROW_LANES) as c:
        with T.vectorized(0, ROW_LANES) as j:
            store(c * ROW_LANES + j)
    with T.serial(k // ROW_LANES * ROW_LANES, k) as kk:
        store(kk)
    with T.serial(k, u.shape[1]) as kk:  # the padding of the last group: its weights are 0
        T.buffer_store(u, tirx.Cast(isa.a_dtype, tirx.const(0, I32)), [r, kk])


def _scaled(isa: DotIsa, y, colsum, amax, ws):
    """y = ((acc * a) / 127) * ws in float32, left to right (numpy's order); the int32 ->
    float32 conversion rounds to nearest, as numpy's astype."""
    def store(r, col, acc):
        exact = tirx.Cast(_f32like(acc), _exact(isa, colsum, col, acc))
        scaled = exact * like(amax[r], acc) / like(const(QMAX), acc) * ws[col]
        T.buffer_store(y, scaled, [r, col])
    return store


def _f32like(e) -> str:
    lanes = lanes_of(e)
    return F32 if lanes == 1 else f"{F32}x{lanes}"
