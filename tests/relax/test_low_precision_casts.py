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


def test_an_output_read_in_float32_too_keeps_its_cast():
    """The float32 probabilities are also summed: the kernel stores float32 and the cast
    stays a Relax op (storing bfloat16 would round what the sum reads)."""
    x = torch.randn(2, 4, 24, generator=torch.Generator().manual_seed(2))
    mod, fused, report, out = _fused(SoftmaxInDtype(torch.bfloat16, also=True).eval(), (x,))
    assert report.fused >= 1, str(report)
    assert _casts(fused).count("bfloat16") == 2, _casts(fused)  # the input's and the output's
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
