"""Quantization in the spec language and the int8 path: ``round`` (half to even, as numpy
and torch), ``clip(x, lo, hi)`` (numpy's ``np.clip``), the int8 GEMM micro-kernels (AMX tiles, VNNI,
AVX2: each one this CPU can run) and the per-token quantization + GEMM kernel, against numpy.

Exactness is the point here, so most comparisons are ``array_equal``: rounding and clipping
are exact in float32, an int8 x int8 product accumulated in int32 is exact for any K below
2**31 / 127**2 (133 000), and the quantized values are compared with numpy's float32
evaluation of the same expression.  The only rounding left is the final float32 scaling
``acc * a / 127 * ws``, done in the same order as the numpy reference: bit-identical.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import sympy as sp

import redfuser
from algebra.errors import SpecError
from algebra.functions import Clip, Round, bounds
from redfuser.lowering.cpu.int8 import int8_gemm
from redfuser.lowering.cpu.int8 import quant_gemm as quant_gemm_func
from redfuser.lowering.cpu.int8_pack import scratch_shapes
from redfuser.lowering.cpu.vector import INT8_ISAS, isa_for
from redfuser.lowering.cuda.fp8 import fp8_quant_gemm
from redfuser.quant import QUANT_GEMM_SPEC, QuantGemm, integer_product_range, quant_gemm
from redfuser.tvm.cuda import cuda_source, nvcc_compile
from redfuser.tvm.runtime import build, from_numpy, host_source
from redfuser.tvm.target import cpu_has, cuda_target, host_target
from tests.support import needs_nvcc

TIES = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 4.5, 1e7 + 0.5, -0.49999997,
                 0.49999997, 8388607.5, np.inf, -np.inf, np.nan, -0.0], np.float32)


def _row(values: np.ndarray, n: int = 48) -> np.ndarray:
    """``values`` tiled to a row of ``n`` (past a vector width, so vector and tail code run)."""
    return np.resize(values, n).reshape(1, n).astype(np.float32)


# -- round and clip: the language and the kernels ------------------------------------------------

def test_round_half_to_even_in_the_kernel():
    x = _row(TIES)
    out = redfuser.compile("s = sum(x[i])\ny[i] = round(x[i])")(x=x)["y"]
    ref, nan = np.round(x), np.isnan(x)
    assert np.array_equal(np.isnan(out), nan)  # bit for bit elsewhere: -0.0 stays -0.0
    np.testing.assert_array_equal(out.view(np.int32)[~nan], ref.view(np.int32)[~nan])
    assert out[0, 0] == -2.0 and out[0, 4] == 2.0 and out[0, 7] == 4.0


def test_clip_matches_np_clip_in_the_kernel():
    x = _row(np.concatenate([TIES, [-300.0, 300.0, 126.6, -127.4]]))
    k = redfuser.compile("s = sum(clip(x[i], -1, 1))\ny[i] = clip(round(x[i] * 2), -127, 127)")
    out = k(x=np.nan_to_num(x, nan=0.0))
    with np.errstate(over="ignore"):  # 2 * 3.4e38 is inf, in the kernel too
        ref = np.clip(np.round(np.nan_to_num(x, nan=0.0) * np.float32(2)), -127, 127)
    np.testing.assert_array_equal(out["y"], ref)
    np.testing.assert_allclose(out["s"], np.clip(np.nan_to_num(x, nan=0.0), -1, 1).sum(),
                               rtol=1e-6)
    assert np.isnan(k(x=x)["y"][0, 14]), "clip(NaN) is NaN, as np.clip"


def test_clip_facts_and_errors():
    x, a = sp.Symbol("x", real=True), sp.Symbol("a", positive=True)
    q = Clip(Round(x * 127 / a), -127, 127)
    assert q.is_integer and bounds(q) == (-127, 127)
    assert Clip(x, -1, 1).is_integer is not True and bounds(Clip(x, a, 1)) is None
    assert Clip(sp.Float(3.5), -1, 1) == 1
    with pytest.raises(SpecError, match="clip"):
        redfuser.derive("s = sum(clip(x[i], 1))")
    with pytest.raises(redfuser.NotFusable, match="clip"):
        redfuser.derive("m = max(x[i])\ns = sum(clip(x[i] - m, -1, 1))")


# -- the integer GEMM ----------------------------------------------------------------------------

HOST = host_target()
HOST_ISAS = [isa for isa in INT8_ISAS if cpu_has(HOST, isa.feature)]  # every one this CPU runs
ANY_INT8 = [isa for isa in HOST_ISAS if isa.lowest == -128]  # those exact for -128 too
VNNI_CPU = {"kind": "llvm", "mcpu": "icelake-server"}  # any AVX-512 VNNI CPU LLVM knows
AMX_CPU = {"kind": "llvm", "mcpu": "sapphirerapids"}  # any AMX CPU LLVM knows


def _run(func, name: str, arrays: list[np.ndarray], target=None):
    ex = build(func, target or HOST)
    ex[name](*(from_numpy(a) for a in arrays))


@pytest.mark.parametrize("isa", ANY_INT8, ids=lambda isa: isa.name)
@pytest.mark.parametrize(("m", "k", "n"), [(7, 37, 70), (12, 130, 128), (5, 1100, 40), (1, 1, 1),
                                           (40, 200, 100)])
def test_int8_gemm_is_exact(isa, m, k, n):
    """Every int8 pair, the extremes included (-128 * -128 summed K times), equals numpy's
    int32 product; m, k, n off the block sizes exercise the row, K and column tails (AMX:
    a second row block, padding rows and a zero panel past N)."""
    rng = np.random.default_rng(m * k * n)
    q = rng.integers(-128, 128, (m, k), dtype=np.int8)
    w = rng.integers(-128, 128, (k, n), dtype=np.int8)
    q[0, :], w[:, 0] = -128, -128
    y = np.zeros((m, n), np.int32)
    # scratch full of garbage: the kernel must write every word it reads
    scratch = [np.full(s, 0x5A, d) for s, d in scratch_shapes(isa, m, k, n).values()]
    _run(int8_gemm(isa, m, k, n), "int8_gemm", [q, w, y, *scratch])
    np.testing.assert_array_equal(y, q.astype(np.int32) @ w.astype(np.int32))


def test_amx_kernel_uses_tiles():
    """The AMX micro-kernel, built for an AMX CPU (compiled, not run: this one may lack it):
    2 x 2 tile products per 64 k values, the tiles configured and released per task."""
    assert isa_for(AMX_CPU).name == "amx-int8"
    asm = host_source(build(quant_gemm_func(isa_for(AMX_CPU), 40, 130, 70), AMX_CPU), "asm")
    assert asm.count("tdpbssd") >= 4 and "tileloadd" in asm and "tilestored" in asm
    assert "ldtilecfg" in asm and "tilerelease" in asm and "vpdpbusd" not in asm


def test_vnni_kernel_uses_vpdpbusd():
    """The VNNI micro-kernel, built for an AVX-512 VNNI CPU (this one may lack it: the code is
    compiled, not run), is vpdpbusd on zmm registers with the A word broadcast."""
    assert isa_for(VNNI_CPU).name == "avx512-vnni"
    asm = host_source(build(quant_gemm_func(isa_for(VNNI_CPU), 12, 64, 128), VNNI_CPU), "asm")
    assert asm.count("vpdpbusd") >= 24 and "zmm" in asm and "vpbroadcastd" in asm


def test_an_isa_exact_above_minus_128_is_refused_for_any_int8():
    """The AVX2 signed-byte dot moves the weight's sign onto the activation, and -(-128) is
    not a byte: it is refused for int8_gemm's activations, chosen for the quantized ones."""
    signed = next(isa for isa in INT8_ISAS if isa.signs)
    with pytest.raises(ValueError, match=r"exact for activations in \[-127, 127\]"):
        int8_gemm(signed, 4, 16, 16)
    assert isa_for({"kind": "llvm", "mcpu": "znver3"}) is signed
    assert isa_for({"kind": "llvm", "mcpu": "znver3"}, lowest=-128).lowest == -128


@pytest.mark.parametrize("isa", HOST_ISAS, ids=lambda isa: isa.name)
def test_quant_gemm_extreme_products_are_exact(isa):
    """Quantized values +-127 against weights -128 and 127, in every sign pattern of a pair:
    rows of +1 or -1 against a column of -128 make the signed-byte dot's u8 x s8 pair sums
    -+2 * 128 * 127, the most int16 holds without saturating."""
    k, n = 256, 32
    signs = np.float32([[1, 1, 1, 1], [-1, -1, -1, -1], [1, -1, 1, -1], [1, -1, -1, 1]])
    x = np.tile(signs, (2, k // 4))
    weights = np.int8([[-128] * 4, [127] * 4, [-128, 127] * 2, [127, -128, -128, 127]])
    wq = np.tile(weights.T, (k // 4, n // 4))
    ws = np.ones(n, np.float32)
    y = QuantGemm(HOST, isa)(x, wq, ws)
    np.testing.assert_array_equal(y, numpy_quant_gemm(x, wq, ws))


def test_int32_overflow_is_refused():
    with pytest.raises(ValueError, match="exceeds"):
        int8_gemm(ANY_INT8[0], 1, ANY_INT8[0].max_k + 1, 16)
    assert all(isa.max_k >= 65536 for isa in INT8_ISAS)  # every K a model uses


# -- quant_gemm: bit-identical to numpy quantize-then-GEMM ---------------------------------------

def numpy_quant_gemm(x: np.ndarray, wq: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """The spec in numpy float32, the GEMM in float64 on the quantized integers (exact below
    2**53, and a NaN row stays NaN, where ``astype(int32)`` of NaN would be garbage)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        a = np.abs(x).max(axis=-1, keepdims=True)
        q = np.clip(np.round(x * np.float32(127) / a), -127, 127)
        acc = (q.astype(np.float64) @ wq.astype(np.float64)).astype(np.float32)
        return acc * a / np.float32(127) * ws


@pytest.mark.parametrize("isa", HOST_ISAS, ids=lambda isa: isa.name)
@pytest.mark.parametrize(("rows", "k", "n"), [((13,), 100, 70), ((2, 3), 1030, 128)])
def test_quant_gemm_is_bit_identical_to_numpy(isa, rows, k, n):
    rng = np.random.default_rng(k + n)
    x = (rng.standard_normal(rows + (k,)) * 3).astype(np.float32)
    flat = x.reshape(-1, k)
    flat[0] = 0.0  # a = 0: 0/0 is NaN in numpy, so the row is NaN
    flat[1, 5] = np.inf  # inf / inf: NaN
    flat[2, :16] = TIES[:16]  # NaN in the row
    flat[3, :] = np.linspace(-127, 127, k) / 127 * 2.5  # many exact .5 quantization ties
    flat[4, :] *= 1e30  # huge magnitudes: a scale of 1e30
    wq = rng.integers(-127, 128, (k, n), dtype=np.int8)
    ws = (rng.random(n) / 50).astype(np.float32)
    y = QuantGemm(HOST, isa)(x, wq, ws)
    ref = numpy_quant_gemm(x, wq, ws)
    assert y.shape == rows + (n,) and y.dtype == np.float32
    np.testing.assert_array_equal(y, ref)  # NaN where numpy has NaN, bit for bit elsewhere
    assert np.isnan(y.reshape(-1, n)[:3]).all() and np.isfinite(y.reshape(-1, n)[3:]).all()


@pytest.mark.parametrize("isa", HOST_ISAS, ids=lambda isa: isa.name)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "fp16"])
def test_low_precision_activations_are_their_float32_values(isa, dtype):
    """bfloat16 and float16 activations are read in their own dtype and converted as they
    are loaded (exact): the result is numpy's quantize-then-GEMM of their float32 values, bit
    for bit, NaN rows and quantization ties included; one build per activation dtype."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((9, 200)) * 3).astype(dtype)
    x[1, 5], x[2, :16] = np.inf, TIES[:16].astype(dtype)  # inf / inf and NaN: NaN rows
    x[3] = (np.arange(200) % 5 - 2).astype(dtype) * 0.5  # exact .5 ties after the scaling
    wq = rng.integers(-127, 128, (200, 70), dtype=np.int8)
    ws = (rng.random(70) / 50).astype(np.float32)
    kernel = QuantGemm(HOST, isa)
    y = kernel(x, wq, ws)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, numpy_quant_gemm(x.astype(np.float32), wq, ws))
    np.testing.assert_array_equal(kernel(x.astype(np.float32), wq, ws), y)


@pytest.mark.parametrize("isa", HOST_ISAS, ids=lambda isa: isa.name)
def test_packed_weights_give_the_same_bits(isa):
    """Weights packed once (``pack``) and reused over calls and row counts give what
    packing per call gives, bit for bit, and numpy's quantize-then-GEMM."""
    rng = np.random.default_rng(7)
    kernel = QuantGemm(HOST, isa)
    wq = rng.integers(-128, 128, (300, 90), dtype=np.int8)
    ws = (rng.random(90) / 50).astype(np.float32)
    packed = kernel.pack(wq)
    for rows in ((5,), (2, 33)):
        x = (rng.standard_normal(rows + (300,)) * 3).astype(np.float32)
        y = kernel(x, packed, ws)
        np.testing.assert_array_equal(y, kernel(x, wq, ws))
        np.testing.assert_array_equal(y, numpy_quant_gemm(x, wq, ws))


def test_packed_weights_errors():
    kernel, wq = QuantGemm(HOST, HOST_ISAS[-1]), np.ones((8, 4), np.int8)
    x, ws = np.ones((2, 8), np.float32), np.ones(4, np.float32)
    packed = kernel.pack(wq)
    with pytest.raises(ValueError, match=r"matching K and N"):
        kernel(np.ones((2, 9), np.float32), packed, ws)
    with pytest.raises(ValueError, match=r"'wq' has shape \(8,\); expected \(K, N\)"):
        kernel.pack(wq[:, 0])
    with pytest.raises(TypeError, match="'wq' has dtype int32"):
        kernel.pack(wq.astype(np.int32))
    if len(HOST_ISAS) > 1:  # packed for another ISA's panels
        with pytest.raises(ValueError, match=f"'wq' was packed for {HOST_ISAS[-1].name}"):
            QuantGemm(HOST, HOST_ISAS[0])(x, packed, ws)
    assert kernel(np.ones((0, 8), np.float32), packed, ws).shape == (0, 4)


def test_quant_gemm_empty_and_errors():
    wq, ws = np.ones((4, 3), np.int8), np.ones(3, np.float32)
    assert QuantGemm()(np.ones((0, 4), np.float32), wq, ws).shape == (0, 3)
    assert np.isnan(quant_gemm(np.ones((2, 0), np.float32), wq[:0], ws)).all()  # 0 * -inf
    with pytest.raises(TypeError, match="'wq' has dtype float32; expected int8"):
        quant_gemm(np.ones((2, 4), np.float32), wq.astype(np.float32), ws)
    with pytest.raises(TypeError, match="'x' has dtype float64; expected float32 or bfloat16 "
                                        "or float16"):
        quant_gemm(np.ones((2, 4)), wq, ws)
    with pytest.raises(ValueError, match=r"wq \(K, N\), ws \(N,\) with matching K and N"):
        quant_gemm(np.ones((2, 5), np.float32), wq, ws)
    with pytest.raises(ValueError, match="expected x"):
        quant_gemm(np.ones((2, 4), np.float32), wq[0], ws)


def test_quant_gemm_is_the_staged_cascade():
    """The kernel computes the spec the engine derives in two stages: against the float64
    oracle, the quantized values are the same (no x * 127 / a of this data sits within an
    ulp of a .5 tie, where float32 and float64 could round apart: asserted first), and y
    differs by the float32 rounding of the final scaling only (a few ulps of |y|)."""
    rule = redfuser.derive(QUANT_GEMM_SPEC, passes="auto")
    assert len(rule.stages) == 2 and "round" in str(rule)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 300)).astype(np.float32)
    wq = rng.integers(-127, 128, (300, 40), dtype=np.int8)
    ws = (rng.random(40) / 50).astype(np.float32)
    a32 = np.abs(x).max(-1, keepdims=True)
    q64 = np.clip(np.round(x.astype(np.float64) * 127 / a32), -127, 127)
    assert np.array_equal(np.clip(np.round(x * np.float32(127) / a32), -127, 127), q64)
    ref = redfuser.reference(QUANT_GEMM_SPEC, {"x": x, "wq": wq, "ws": ws})["y"]
    np.testing.assert_allclose(quant_gemm(x, wq, ws), ref, rtol=1e-6,
                               atol=4 * np.finfo(np.float32).eps * np.abs(ref).max())


def test_fp8_cuda_variant_source():
    """The e4m3 (scale 448) CUDA twin: e4m3 stores, the max on the bits of |x|."""
    src = cuda_source(build(fp8_quant_gemm(4, 64, 32), cuda_target("sm_90")))
    assert "__nv_fp8_e4m3" in src and "2147483647" in src


@needs_nvcc
def test_fp8_cuda_variant_compiles_for_sm90():
    """nvcc compiles it for sm_90; the quantization is the saturating round-to-nearest-even
    conversion to e4m3."""
    src = cuda_source(build(fp8_quant_gemm(4, 64, 32), cuda_target("sm_90")))
    assert "cvt.rn.satfinite.e4m3x2.f32" in bytes(nvcc_compile(src, "sm_90")).decode()


@pytest.mark.parametrize("factor", ["round(x[i] * 127 / a)",
                                    "clip(round(x[i] * 127 / a), -200, 200)",
                                    "clip(x[i] * 127 / a, -127, 127)"])
def test_int32_sums_need_a_proven_int8_factor(factor):
    """Unbounded, out of int8, or not an integer: no exact int32 sum, a NotFusable says why."""
    assert integer_product_range() == (-127, 127)
    spec = QUANT_GEMM_SPEC.replace("clip(round(x[i] * 127 / a), -127, 127)", factor)
    with pytest.raises(redfuser.NotFusable, match="proven an integer"):
        integer_product_range(spec)


def test_fp8_gpu_check_reference_rounds_as_torch_does():
    """``make gpu-check`` holds the FP8 CUDA kernel to ``fp8_reference`` (its quantized values
    bit for bit): that reference's e4m3 rounding (ml_dtypes) agrees with torch's own
    float8_e4m3fn conversion, ties and the +-448 ends included."""
    import torch

    from redfuser.tools.gpucheck import fp8_reference

    rng = np.random.default_rng(4)
    x = rng.normal(size=(6, 96)).astype(np.float32)
    x[0, :4] = [1.0, -1.0, 0.5, 0.25]  # the row's max 1: x * 448 lands on exact values
    x[1, :3] = [3.0, 3.0 * 17 / 448, -3.0 * 19 / 448]  # 17 and 19: halfway between e4m3s
    wq = (rng.normal(size=(96, 5)) * 16).astype(np.float32)
    wq = torch.from_numpy(wq).to(torch.float8_e4m3fn)
    ws = rng.uniform(0.5, 2.0, 5).astype(np.float32)
    q, a, y, bound = fp8_reference(x, wq.float().numpy().astype(ml_dtypes.float8_e4m3fn), ws)
    scaled = torch.from_numpy(x) * 448.0 / torch.from_numpy(a)[:, None]
    expected = scaled.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert np.array_equal(q.view(np.uint8), expected.view(torch.uint8).numpy())
    want = (expected.double() @ wq.double()) * (torch.from_numpy(a).double()[:, None] / 448
                                                * torch.from_numpy(ws).double())
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-12)
    assert np.all(bound > 0)
