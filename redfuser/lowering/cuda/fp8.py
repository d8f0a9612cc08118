"""Per-token FP8 (e4m3) quantization + GEMM on CUDA (sm_90): the CUDA twin of
``lowering.cpu.int8.quant_gemm`` with the e4m3 range (scale 448) instead of int8's 127.

``a = max(abs(x[i])); y = sum(fp8(x[i] * 448 / a) * wq[i, :]) * a / 448 * ws[:]``, with
``wq`` already e4m3 (K, N) and ``ws`` its per-column float32 scale.  Two launches:

- one block per row: the absolute max on the float bits (an int max, so NaN is kept, as on
  the CPU) folded by each thread over a strided share and combined by a shared-memory
  tree, then the row quantized by the same threads (``x * 448 / a`` in float32, a true
  division, then the saturating round-to-nearest-even conversion to e4m3) while it is in
  L1/L2, the row's ``a`` kept for the epilogue;
- one thread per output: the e4m3 x e4m3 products (exact in float32: 4 + 4 significant
  bits) summed in float32 over K, scaled ``((acc * a) / 448) * ws`` left to right.

The accumulation rounds in float32 (an FP8 product has no exact integer sum): the tests
compile it with nvcc for sm_90, and ``make gpu-check`` runs it against numpy's
quantize-then-GEMM (``tools.gpucheck.fp8_reference``: the quantized values bit for bit,
``y`` within the float32 summation bound).  A tensor-core (wgmma) version is the next step.
"""

from __future__ import annotations

from ...tvm.ir import IRBuilder, T, arg_buffer, block_sync, tirx
from ..signature import F32, I32

FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # the largest finite e4m3 value: the quantization scale
THREADS = 256  # per block, both launches
ABS_MASK, INF_BITS = 0x7FFFFFFF, 0x7F800000



def _abs_bits(v):
    return tirx.bitwise_and(tirx.reinterpret(I32, v), tirx.const(ABS_MASK, I32))


def fp8_quant_gemm(m: int, k: int, n: int, name: str = "fp8_quant_gemm"):
    """PrimFunc ``(x f32 (m, k), wq e4m3 (k, n), ws f32 (n,), y f32 (m, n))`` for CUDA.

    Examples
    --------
    >>> "float8_e4m3fn" in fp8_quant_gemm(4, 64, 32).script()
    True
    """
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            x, w = arg_buffer("x", (m, k), F32), arg_buffer("wq", (k, n), FP8)
            ws, y = arg_buffer("ws", (n,), F32), arg_buffer("y", (m, n), F32)
            q, amax = arg_buffer("q", (m, k), FP8), arg_buffer("amax", (m,), F32)
            _quantize(x, q, amax, m, k)
            _gemm(q, w, ws, amax, y, m, k, n)
    return ib.get()


def _quantize(x, q, amax, m: int, k: int):
    with T.launch_thread("blockIdx.x", m) as r:
        with T.launch_thread("threadIdx.x", THREADS) as t:
            best = T.alloc_buffer((THREADS,), I32, scope="shared")
            own = T.alloc_buffer((1,), I32, scope="local")
            T.buffer_store(own, tirx.const(0, I32), [0])
            with T.serial(0, -(-k // THREADS)) as j:
                kk = j * THREADS + t
                with T.If(kk < k):
                    with T.Then():
                        T.buffer_store(own, tirx.max(own[0], _abs_bits(x[r, kk])), [0])
            T.buffer_store(best, own[0], [t])
            block_sync()
            stride = THREADS // 2
            while stride:  # a halving tree in shared memory
                with T.If(t < stride):
                    with T.Then():
                        T.buffer_store(best, tirx.max(best[t], best[t + stride]), [t])
                block_sync()
                stride //= 2
            bits = T.bind(best[0])
            good = T.bind(tirx.And(bits > 0, bits < INF_BITS))  # else the row is NaN
            a = T.bind(tirx.Select(good, tirx.reinterpret(F32, bits), tirx.const(1.0, F32)))
            with T.If(t == 0):
                with T.Then():
                    T.buffer_store(amax, tirx.Select(good, a, tirx.const(float("nan"), F32)),
                                   [r])
            with T.serial(0, -(-k // THREADS)) as j:
                kk = j * THREADS + t
                with T.If(kk < k):
                    with T.Then():
                        v = x[r, kk] * tirx.const(FP8_MAX, F32) / a
                        clipped = tirx.min(tirx.max(v, tirx.const(-FP8_MAX, F32)),
                                           tirx.const(FP8_MAX, F32))
                        T.buffer_store(q, tirx.Cast(FP8, clipped), [r, kk])


def _gemm(q, w, ws, amax, y, m: int, k: int, n: int):
    with T.launch_thread("blockIdx.x", -(-m * n // THREADS)) as b:
        with T.launch_thread("threadIdx.x", THREADS) as t:
            flat = b * THREADS + t
            with T.If(flat < m * n):
                with T.Then():
                    r, col = tirx.floordiv(flat, n), tirx.floormod(flat, n)
                    acc = T.alloc_buffer((1,), F32, scope="local")
                    T.buffer_store(acc, tirx.const(0.0, F32), [0])
                    with T.serial(0, k) as kk:
                        T.buffer_store(acc, acc[0] + tirx.Cast(F32, q[r, kk]) *
                                       tirx.Cast(F32, w[kk, col]), [0])
                    scaled = acc[0] * amax[r] / tirx.const(FP8_MAX, F32) * ws[col]
                    T.buffer_store(y, scaled, [r, col])
