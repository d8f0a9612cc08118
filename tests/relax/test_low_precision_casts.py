"""Casts around a cascade in a bfloat16 or float16 model, folded into the kernel: the cast to
float32 before it into its loads, the cast back after it into its stores (rounded once to
nearest even, as the cast rounds), so neither is a pass of its own.  Outputs are compared
with the float64 oracle of the rounded inputs, rounded to the output's dtype: within one
unit in its last place (the float32 accumulation is far finer than that rounding)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

from redfuser.relax import FuseCascadedReductions, build, run
from redfuser.relax.pipeline import _schedule_each
from redfuser.tvm.graph import import_torch, relax

NUMPY = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16}


class SoftmaxInDtype(nn.Module):
    """transformers' attention probabilities: softmax in float32, cast back to the model's
    dtype; ``also``: the float32 probabilities are read once more (their row sums)."""

    def __init__(self, dtype: torch.dtype, also: bool = False):
        super().__init__()
        self.dtype, self.also = dtype, also

    def forward(self, x):
        p = torch.softmax(x.to(self.dtype).float() * 2.0, -1)
        return (p.to(self.dtype), p.sum(-1)) if self.also else p.to(self.dtype)


def _fused(model, args):
    mod = import_torch(model, args)
    fuse = FuseCascadedReductions()
    fused = fuse(mod)
    out = run(build(fused, fuse=False)[0], *(a.numpy() for a in args))
    return mod, fused, fuse.report, out


def _casts(mod) -> list[str]:
    """The dtypes ``main``'s astype bindings cast to."""
    return [str(b.value.attrs.dtype) for block in mod["main"].body.blocks
            for b in block.bindings if isinstance(b.value, relax.Call)
            and getattr(b.value.op, "name", "") == "relax.astype"]


def assert_one_ulp(got: np.ndarray, want: np.ndarray, dtype) -> None:
    """``got`` (of ``dtype``) within one unit in the last place of the float64 ``want``
    rounded to ``dtype``."""
    assert got.dtype == np.dtype(dtype)
    rounded = want.astype(dtype)
    ulp = np.abs(np.spacing(rounded).astype(np.float64))
    assert np.all(np.abs(got.astype(np.float64) - rounded.astype(np.float64)) <= ulp)


def _oracle(x: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    s = x.to(dtype).double().numpy() * 2.0
    p = np.exp(s - s.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_cast_back_is_folded_into_the_kernels_stores(dtype):
    x = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(1)) * 3
    x[0, 0, 7:] = -torch.inf  # a masked tail
    mod, fused, report, out = _fused(SoftmaxInDtype(dtype).eval(), (x,))
    assert report.fused == 1, str(report)
    name = str(dtype).removeprefix("torch.")
    # before: the model's input cast, the widening, the cast back; after: the input's alone
    assert _casts(mod) == [name, "float32", name] and _casts(fused) == [name], _casts(fused)
    got = np.asarray(out)
    want = _oracle(x, dtype)
    assert_one_ulp(got, want, NUMPY[dtype])


def test_an_output_also_summed_in_float32_is_summed_unrounded():
    """The float32 probabilities are also summed: the sum is a reduction of the same kernel,
    which reads them unrounded, and the cast back is folded into the probabilities' store
    (the sum of rounded probabilities would be off by about 1e-3)."""
    x = torch.randn(2, 4, 24, generator=torch.Generator().manual_seed(2))
    mod, fused, report, out = _fused(SoftmaxInDtype(torch.bfloat16, also=True).eval(), (x,))
    assert report.fused == 1, str(report)
    assert _casts(fused) == ["bfloat16"], _casts(fused)  # the input's alone
    probs, sums = (np.asarray(o) for o in out)
    assert probs.dtype == np.dtype(ml_dtypes.bfloat16) and sums.dtype == np.float32
    np.testing.assert_allclose(sums, 1.0, rtol=1e-5)


class LayerNormInDtype(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.ln = nn.LayerNorm(48).to(dtype)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)
        self.dtype = dtype

    def forward(self, x):
        return self.ln(x.to(self.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_norm_on_low_precision_tensors_computes_in_float32(dtype):
    """A LayerNorm on bfloat16 or float16 tensors, as torch computes it (float32 inside, the
    output rounded once): fused, its input, weight and bias read in their dtype and its
    output stored in it; TVM's own legalization of it fails for bfloat16 ("only support
    float32 and float16")."""
    x = torch.randn(3, 7, 48, generator=torch.Generator().manual_seed(3)) * 2 + 1
    model = LayerNormInDtype(dtype).eval()
    mod, fused, report, out = _fused(model, (x,))
    assert report.fused == 1, str(report)
    assert "R.nn.layer_norm" not in str(fused["main"])
    got = np.asarray(out)
    xs = x.to(dtype).double().numpy()
    g, b = (p.detach().double().numpy() for p in (model.ln.weight, model.ln.bias))
    mean, var = xs.mean(-1, keepdims=True), xs.var(-1, keepdims=True)
    want = (xs - mean) / np.sqrt(var + 1e-5) * g + b
    assert_one_ulp(got, want, NUMPY[dtype])


class MiddleAxisSoftmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x.to(torch.bfloat16) * 2.0, dim=1)


def test_a_softmax_over_a_middle_axis_of_low_precision_tensors():
    """The reduced axis moved last (a permuted read) keeps the tensor's storage dtype: the
    kernel was declared float32 and its call refused ("Argument 0 type mismatch")."""
    x = torch.randn(3, 20, 8, generator=torch.Generator().manual_seed(0))
    _, _, report, out = _fused(MiddleAxisSoftmax().eval(), (x,))
    assert report.fused == 1, str(report)
    s = x.to(torch.bfloat16).double().numpy()
    s = (s * 2.0).astype(ml_dtypes.bfloat16).astype(np.float64)  # the multiply in bfloat16
    p = np.exp(s - s.max(1, keepdims=True))
    want = p / p.sum(1, keepdims=True)
    assert_one_ulp(np.asarray(out), want, ml_dtypes.bfloat16)


class NormThenProjection(nn.Module):
    """transformers' LlamaRMSNorm and the projection after it, in bfloat16 or float16: the
    norm in float32, its output rounded to the model's dtype, scaled by the weight and
    projected in that dtype."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(64, generator=torch.Generator().manual_seed(4))
                                   .add(0.5).to(dtype))
        self.proj = nn.Linear(64, 48, bias=False).to(dtype)

    def forward(self, x):
        h = x.to(self.weight.dtype).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.proj(self.weight * h.to(self.weight.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_arithmetic_in_low_precision_between_a_norm_and_its_gemm_is_fused(dtype):
    """The cast, the weight's multiply and the product in the model's dtype sit between the
    norm and its GEMM: one norm + GEMM kernel computes them in float32 (torch.compile's
    convention, ``frag.computed``), so the only rounding is the output's.  Compared with the
    float64 oracle of the unrounded chain: within one rounding of the output's dtype at its
    scale, and nearer the oracle than torch's eager, which rounds at every step."""
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(5)) * 3
    model = NormThenProjection(dtype).eval()
    _, fused, report, out = _fused(model, (x,))
    assert report.fused == 1 and "matmul" in str(report), str(report)
    assert "R.matmul" not in str(fused["main"])
    xs = x.to(dtype).double().numpy()
    g, w = (p.detach().double().numpy() for p in (model.weight, model.proj.weight))
    want = xs / np.sqrt((xs ** 2).mean(-1, keepdims=True) + 1e-6) * g @ w.T
    got = np.asarray(out).astype(np.float64)
    unit = float(np.spacing(np.abs(want).max().astype(NUMPY[dtype])))
    assert np.max(np.abs(got - want)) <= unit
    with torch.no_grad():
        eager = model(x).double().numpy()
    assert np.max(np.abs(got - want)) < np.max(np.abs(eager - want))


class LowPrecisionLogsumexp(nn.Module):
    def forward(self, x):
        s = x.to(torch.bfloat16) * 0.5
        m = s.max(-1, keepdim=True).values
        return m.squeeze(-1) + torch.log(torch.exp(s - m).sum(-1))


def test_a_per_row_result_in_low_precision_is_rounded_once():
    """A per-row result computed in bfloat16 in the model: the kernel keeps it in float32 and
    the call's value is cast once (``rewrite._stored``): within one bfloat16 unit of the
    float64 oracle."""
    x = torch.randn(4, 6, 40, generator=torch.Generator().manual_seed(6)) * 4
    _, fused, report, out = _fused(LowPrecisionLogsumexp().eval(), (x,))
    assert report.fused == 1, str(report)
    s = x.to(torch.bfloat16).double().numpy() * 0.5
    m = s.max(-1)
    want = m + np.log(np.exp(s - m[..., None]).sum(-1))
    assert_one_ulp(np.asarray(out), want, ml_dtypes.bfloat16)


class BatchedProduct(nn.Module):
    """A batched product of bfloat16 operands into float32 (a Mixtral block holds one)."""

    def forward(self, a, b):
        return torch.matmul(a.to(torch.bfloat16), b.to(torch.bfloat16)).float()


def test_low_precision_products_outside_cascades_skip_dlights_gemv_rule():
    """dlight's CPU GEMV schedule gathers 128 strided bfloat16 lanes per vector, unrolled 64
    times, which took LLVM 112 s to compile for a (64, 256, 64) x (64, 64, 1) product of a
    tiny Mixtral; ``pipeline._schedule_each`` leaves low-precision functions to its
    Reduction rule.  The product still computes what torch does."""
    a, b = torch.randn(64, 256, 64), torch.randn(64, 64, 1)
    mod = import_torch(BatchedProduct(), (a, b))
    scheduled = relax.transform.LegalizeOps()(mod)
    text = "\n".join(f.script() for gv, f in _schedule_each(scheduled).functions_items()
                     if gv.name_hint != "main")
    assert "x128" not in text
    got = run(build(mod, fuse=False)[0], a.numpy(), b.numpy())
    got = got[0] if isinstance(got, list) else got
    want = BatchedProduct()(a, b).numpy()  # torch rounds the product to bfloat16: 1e-2
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
