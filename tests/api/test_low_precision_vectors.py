"""Feature-vector results in bfloat16 and float16 (``signature.stored_results``).

A per-row result that carries the feature axis (attention's ``o``, ``rmsnorm_gemm``'s ``y``)
is stored as the per-element outputs are: in ``geo.out_dtype`` (the streams' dtype by
torch's promotion, or ``out_dtype``), rounded once to nearest even.  It is held to the
per-element outputs' target (``tests.support.precision.assert_one_ulp``: within one unit in the
last place of the float64 oracle rounded to its dtype on at least 99.9% of its elements,
within two everywhere), through every CPU nest that writes one (rolling, row blocks, split,
unfused, the GEMM and score-product micro-kernels, row-resident stages, dynamic shapes).
Per-row statistics (m, d, r, a feature vector another statement reads) stay float32, held
to the float32 tolerance.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import torch

import redfuser
import redfuser.torch as rt
from algebra.dtypes import STORAGE
from redfuser.lowering import shape_geometry
from redfuser.lowering.cpu.plan import LANES
from redfuser.lowering.cpu.vector import host_narrowing
from redfuser.lowering.signature import stored_results
from redfuser.tune.db import entry_key
from redfuser.tvm.cuda import nvcc_compile
from tests.support import KERNEL_TOL, needs_nvcc
from tests.support.precision import IDS, LOW, assert_one_ulp
from tests.support.precision import oracle as _oracle


def attention_inputs(dtype, heads: int, queries: int, n: int, d: int, seed: int,
                     causal: bool = False) -> dict:
    """q (heads, queries, d), K and V (heads, 1, n, d) shared by the queries; causal: each
    query at the last positions (the first query sees n - queries + 1 keys)."""
    rng = np.random.default_rng(seed)
    out = {"q": rng.normal(size=(heads, queries, d)).astype(dtype),
           "k": rng.normal(size=(heads, 1, n, d)).astype(dtype),
           "v": rng.normal(size=(heads, 1, n, d)).astype(dtype), "scale": d ** -0.5}
    if causal:
        out["pos"] = np.arange(n - queries, n, dtype=np.float32).reshape(1, queries)
    return out


def gemm_inputs(dtype, rows: int, n: int, d: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": (rng.normal(size=(rows, n)) * 2).astype(dtype),
            "w": (rng.normal(size=(n, d)) / np.sqrt(n)).astype(dtype), "eps": 1e-5}


# name -> (spec, inputs(dtype), compile options, the plan it must run: its reason or variant)
CASES = {
    "attention-row-blocks": ("attention", lambda t: attention_inputs(t, 2, 24, 300, 64, 1),
                             {"threads": 2}, "blocks of"),
    "attention-unfused": ("attention", lambda t: attention_inputs(t, 2, 5, 77, 64, 2),
                          {"variant": "unfused"}, "unfused"),
    "attention-split-odd-d": ("attention", lambda t: attention_inputs(t, 1, 2, 500, 24, 2),
                              {"variant": "split", "splits": 3}, "split"),
    "softmin-average": ("softmin_average",
                        lambda t: {"x": np.random.default_rng(19).normal(size=(6, 150)).astype(t),
                                   "v": np.random.default_rng(20).normal(size=(6, 150, 32))
                                   .astype(t)}, {}, "rolling"),
    "attention-dynamic": ("attention", lambda t: attention_inputs(t, 3, 5, 130, 32, 3),
                          {"dynamic": True}, "any rows and N"),
    "causal-attention": ("causal_attention",
                         lambda t: attention_inputs(t, 2, 9, 200, 64, 4, causal=True), {},
                         "rolling"),
    "decode-attention": ("attention", lambda t: attention_inputs(t, 1, 1, 9000, 128, 5), {},
                         "split"),
    "decode-attention-heads": ("attention", lambda t: attention_inputs(t, 8, 1, 4100, 64, 6),
                               {"threads": 2}, "rolling"),
    "empty-stream": ("attention", lambda t: attention_inputs(t, 2, 3, 0, 16, 7), {},
                     "rolling"),
    # the float32 micro-kernel, or AMX-BF16 tiles for bfloat16 where the host has them
    # (tests/lowering/test_tile_gemm.py checks which)
    "rmsnorm-gemm": ("rmsnorm_gemm", lambda t: gemm_inputs(t, 13, 300, 4 * LANES + 5, 8), {},
                     ", KC "),
    "rmsnorm-gemm-unfused": ("rmsnorm_gemm", lambda t: gemm_inputs(t, 7, 100, 40, 9),
                             {"variant": "unfused"}, "unfused"),
    # positive terms: a sum that cancels is ill-conditioned, its float32 error no longer
    # below the output's unit (the float32 property tests bound those by their sensitivity)
    "score-product": ("s = dot(h, w[i, :])\ny = sum(exp(s) * w[i, :])",
                      lambda t: {"h": np.random.default_rng(10).normal(size=(70, 600)).astype(t),
                                 "w": (np.random.default_rng(11).uniform(0.5, 1.5, (700, 600)) /
                                       25).astype(t)}, {}, "f(S)"),
}


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_feature_vectors_are_the_oracle_rounded_to_their_dtype(case, dtype):
    spec, make, options, plan = CASES[case]
    inputs = make(dtype)
    kernel = redfuser.compile(spec, tune=False, **options)
    out = kernel(**inputs)
    assert plan in str(kernel.plan), kernel.plan
    ref = _oracle(spec, inputs)
    vectors = stored_results(kernel.rule)
    assert vectors and vectors <= set(out), vectors
    for name, value in out.items():
        if name in vectors:
            assert value.dtype == np.dtype(dtype), f"{case}: {name} is {value.dtype}"
            assert_one_ulp(value, ref[name], dtype, f"{case} {name} ({kernel.plan})")
        else:  # statistics stay float32
            assert value.dtype == np.float32, f"{case}: {name} is {value.dtype}"
            np.testing.assert_allclose(value, ref[name], rtol=KERNEL_TOL, atol=KERNEL_TOL,
                                       err_msg=f"{case} {name}")


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
def test_a_row_resident_kernel_rounds_its_last_stage_only(dtype):
    """A staged rule: the per-feature mean a later pass reads stays float32 (rounding it
    would change what that pass computes); the mean absolute deviation takes the dtype."""
    spec = "mu = sum(x[i, :]) / N\nmad = sum(abs(x[i, :] - mu)) / N"
    x = np.random.default_rng(12).normal(size=(5, 300, 2 * LANES + 3)).astype(dtype)
    kernel = redfuser.compile(redfuser.derive(spec, passes="auto"), tune=False)
    out = kernel(x=x)
    assert kernel.plan.variant == "resident", kernel.plan
    assert out["mu"].dtype == np.float32 and out["mad"].dtype == np.dtype(dtype)
    ref = _oracle(spec, {"x": x})
    np.testing.assert_allclose(out["mu"], ref["mu"], rtol=KERNEL_TOL, atol=KERNEL_TOL)
    assert_one_ulp(out["mad"], ref["mad"], dtype, "mad")


def test_a_feature_vector_another_statement_reads_stays_float32():
    """What a per-element output, a reduction or an epilogue is computed from is a
    statistic of the cascade: stored float32, as the kernel reads it."""
    spec = "mu = sum(x[i, :]) / N\ny[i, :] = x[i, :] - mu"
    x = np.random.default_rng(13).normal(size=(4, 50, 24)).astype(ml_dtypes.bfloat16)
    out = redfuser.compile(spec, tune=False)(x=x)
    assert out["mu"].dtype == np.float32 and out["y"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert stored_results(redfuser.derive(spec)) == frozenset()
    assert stored_results(redfuser.derive("moe_routing")) == frozenset()  # top-k: width k


@pytest.mark.parametrize("name", ["attention", "rmsnorm_gemm"])
def test_out_dtype_float32_keeps_float32_vectors(name):
    inputs = attention_inputs(ml_dtypes.bfloat16, 2, 3, 64, 16, 14) if name == "attention" \
        else gemm_inputs(ml_dtypes.bfloat16, 5, 64, 24, 14)
    out = redfuser.compile(name, tune=False, out_dtype="float32")(**inputs)
    ref = _oracle(name, inputs)
    vector = "o" if name == "attention" else "y"
    assert out[vector].dtype == np.float32
    np.testing.assert_allclose(out[vector], ref[vector], rtol=KERNEL_TOL, atol=KERNEL_TOL)
    half = redfuser.compile(name, tune=False, out_dtype=np.float16)(**inputs)[vector]
    assert half.dtype == np.float16
    assert_one_ulp(half, ref[vector], np.float16, f"{name} into float16")


def test_mixed_dtypes_promote_as_torch_does():
    """bfloat16 q with float32 K and V gives a float32 o; bfloat16 x with a float32 w a
    float32 y; bfloat16 with float16 float32 (``algebra.dtypes.widest``)."""
    bf = ml_dtypes.bfloat16
    inputs = attention_inputs(np.float32, 2, 3, 40, 16, 15)
    inputs["q"] = inputs["q"].astype(bf)
    out = redfuser.compile("attention", tune=False)(**inputs)
    assert out["o"].dtype == np.float32
    np.testing.assert_allclose(out["o"], _oracle("attention", inputs)["o"], rtol=KERNEL_TOL,
                               atol=KERNEL_TOL)
    gemm = gemm_inputs(bf, 5, 64, 24, 15)
    k = redfuser.compile("rmsnorm_gemm", tune=False)
    assert k(**{**gemm, "w": gemm["w"].astype(np.float32)})["y"].dtype == np.float32
    assert k(**{**gemm, "w": gemm["w"].astype(np.float16)})["y"].dtype == np.float32


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
def test_out_arrays_take_the_vectors_dtype(dtype):
    inputs = attention_inputs(dtype, 2, 3, 40, 16, 16)
    k = redfuser.compile("attention", tune=False)
    name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=rf"out\['o'\] has dtype float32; expected {name}"):
        k(**inputs, out={"o": np.empty((2, 3, 16), np.float32)})
    with pytest.raises(TypeError, match=rf"out\['o'\] has dtype torch.float32; expected {name}"):
        k(**inputs, out={"o": torch.empty(2, 3, 16)})
    with pytest.raises(TypeError, match=r"out\['m'\] has dtype .*; expected float32"):
        k(**inputs, out={"m": np.empty((2, 3), dtype)})
    given = np.empty((2, 3, 16), dtype)
    out = k(**inputs, out={"o": given})
    assert out["o"] is given
    assert_one_ulp(given, _oracle("attention", inputs)["o"], dtype, "out= o")


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
def test_the_hot_loops_call_no_conversion(dtype):
    """The stores of o and y round in registers (no ``__truncsfbf2``); y's vector chunks use
    the CPU's own bfloat16 conversion where it has one (``cpu.vector.NARROWINGS``)."""
    for name, inputs in (("attention", attention_inputs(dtype, 2, 8, 300, 64, 17)),
                         ("rmsnorm_gemm", gemm_inputs(dtype, 12, 256, 64, 17))):
        k = redfuser.compile(name, tune=False)
        k(**inputs)
        asm = k.assembly()
        called = set(re.findall(r"\bcall[a-z]*\s+([\w.@]+)", asm))
        # memset: the tiles' zero padding, once per row (not a conversion per element)
        assert all(c.startswith(("redfuser_kernel", "__tvm", "TVM", "memset")) for c in called), \
            f"{name} calls {sorted(called)}"
        if name == "rmsnorm_gemm" and dtype is ml_dtypes.bfloat16:
            assert ("vcvtneps2bf16" in asm) == (host_narrowing("bfloat16", LANES) is not None)


def test_the_tuning_key_holds_the_vectors_dtype():
    """The database key has the geometry's out dtype, which now also stores o: a plan tuned
    for a float32 o is not taken for a bfloat16 one."""
    rule = redfuser.derive("attention")
    base = shape_geometry(rule, {"q": (2, 4, 64), "k": (2, 1, 256, 64), "v": (2, 1, 256, 64)})
    keys = {entry_key(rule, type(base)(base.rows, base.n, base.d, base.inputs, base.vec, name),
                      "cpu", "machine") for name in STORAGE}
    assert len(keys) == len(STORAGE)


def _attention_reference(q, k, v, scale, causal: bool):
    s = q @ k[:, 0].transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
    return torch.softmax(s, -1) @ v[:, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=IDS)
@pytest.mark.parametrize("name,compiled", [("attention", False), ("attention", True),
                                           ("causal_attention", False)])
def test_torch_attention_trains_in_low_precision(name, compiled, dtype):
    """The torch op returns o in the inputs' dtype (m and d float32), as SDPA does; its
    backward reads that o for FlashAttention's delta = rowsum(dO * O), and dq, dk, dv (in the
    dtype) are within two units in the last place of their scale of torch's float64
    autograd."""
    g = torch.Generator().manual_seed(18)
    heads, length, d, scale = 2, 33, 64, 0.125
    leaves = {n: torch.randn(*shape, generator=g).to(dtype).requires_grad_() for n, shape in
              (("q", (heads, length, d)), ("k", (heads, 1, length, d)),
               ("v", (heads, 1, length, d)))}
    args = {**leaves, "scale": scale}
    if name == "causal_attention":
        args["pos"] = torch.arange(length, dtype=torch.float32).reshape(1, length)
    op = rt.op(name, scalars=("scale",), tune=False)

    def model(*a):
        return op(*a)

    run = torch.compile(model, fullgraph=True) if compiled else model
    outs = dict(zip(op.outputs, run(*(args[n] for n in op.inputs)), strict=True))
    assert outs["o"].dtype == dtype and outs["m"].dtype == outs["d"].dtype == torch.float32
    up = torch.randn(outs["o"].shape, generator=g).to(dtype)
    outs["o"].backward(up)
    wide = {n: v.detach().double().requires_grad_() for n, v in leaves.items()}
    ref = _attention_reference(wide["q"], wide["k"], wide["v"], scale,
                               name == "causal_attention")
    ref.backward(up.double())
    ulp = 2.0 ** -STORAGE[str(dtype).removeprefix("torch.")].fraction
    assert (outs["o"].double() - ref).abs().max() <= 2 * ulp * ref.abs().max()
    for n, v in leaves.items():
        want = wide[n].grad
        assert v.grad.dtype == dtype, n
        assert (v.grad.double() - want).abs().max() <= 2 * ulp * want.abs().max(), n


@needs_nvcc
@pytest.mark.parametrize("dtype", LOW, ids=IDS)
@pytest.mark.parametrize("name,variant", [("attention", "split"), ("attention", "unfused"),
                                          ("rmsnorm_gemm", None), ("mad_vector", None)])
def test_cuda_kernels_store_vectors_in_each_dtype(name, variant, dtype):
    """The CUDA nests that write a feature-vector result (thread 0's finalize, the unfused
    pass, the GEMM's results launch, a row-resident stage) round it to the dtype; ptxas
    accepts them (``make gpu-check`` runs them on a GPU)."""
    if name == "mad_vector":
        rule = redfuser.derive("mu = sum(x[i, :]) / N\nmad = sum(abs(x[i, :] - mu)) / N",
                               passes="auto")
        k = redfuser.compile(rule, target="cuda").prepare(x=np.zeros((5, 300, 16), dtype))
    elif name == "attention":
        k = redfuser.compile(name, target="cuda", variant=variant)
        k.prepare(**attention_inputs(dtype, 2, 1, 5000, 64, 0))
    else:
        k = redfuser.compile(name, target="cuda").prepare(**gemm_inputs(dtype, 100, 300, 200, 0))
    vector = "o" if name == "attention" else "y" if name == "rmsnorm_gemm" else "mad"
    assert list(k.rule.outputs)[-1] == vector
    # the arguments in order: inputs, then outputs, the feature vector last
    head = next(line for line in k.primfunc.script().splitlines() if "def redfuser_kernel" in line)
    declared = re.findall(r'T\.Buffer\(\([^)]*\), "(\w+)"', head)
    assert declared[-1] == STORAGE[np.dtype(dtype).name].argument, (vector, declared)
    assert nvcc_compile(k.cuda_source(), arch="sm_90", fmt="cubin")[:4] == b"\x7fELF"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=IDS)
def test_torch_rmsnorm_gemm_trains_in_low_precision(dtype):
    """A bfloat16 GEMM cascade returns y in bfloat16 (r float32), as torch's bfloat16 GEMM
    does; dx and dw within two units in the last place of their scale of float64."""
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(6, 64, generator=g) * 2).to(dtype).requires_grad_()
    w = (torch.randn(64, 48, generator=g) / 8).to(dtype).requires_grad_()
    op = rt.op("rmsnorm_gemm", scalars=("eps",), tune=False)
    outs = dict(zip(op.outputs, op(*({"x": x, "w": w, "eps": 1e-5}[n] for n in op.inputs)),
                    strict=True))
    assert outs["y"].dtype == dtype and outs["r"].dtype == torch.float32
    up = torch.randn(6, 48, generator=g).to(dtype)
    outs["y"].backward(up)
    wide = {n: t.detach().double().requires_grad_() for n, t in (("x", x), ("w", w))}
    ref = torch.nn.functional.rms_norm(wide["x"], (64,), None, 1e-5) @ wide["w"]
    ref.backward(up.double())
    ulp = 2.0 ** -STORAGE[str(dtype).removeprefix("torch.")].fraction
    assert (outs["y"].double() - ref).abs().max() <= 2 * ulp * ref.abs().max()
    for n, t in (("x", x), ("w", w)):
        want = wide[n].grad
        assert t.grad.dtype == dtype
        assert (t.grad.double() - want).abs().max() <= 2 * ulp * want.abs().max(), n
