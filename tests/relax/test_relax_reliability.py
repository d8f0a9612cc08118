"""FuseCascadedReductions never changes what a model computes, and never raises on a valid
module: masked softmax rows that are NaN in PyTorch stay NaN (repro
r2_relax_fully_masked_softmax.py, and torch.export's safe softmax on rows with a NaN or
+inf score), low-precision cascades are left as they are with the reason, and an
unexpected failure while lifting one candidate is reported, not raised; numpy arrays at any
16-byte alignment run, and masked slots holding inf or NaN never reach the result.

References are PyTorch's own outputs (eager), never the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from redfuser.relax import build, driver, fuse_module, ops, run
from redfuser.tvm.graph import import_torch, relax
from tests.support import softmax_module


def _outputs(mod, args, fuse: bool):
    executable, report = build(mod, fuse=fuse)
    out = run(executable, *[a.numpy() for a in args])
    return np.asarray(out[0] if isinstance(out, list) else out), report


def _torch(model, args) -> np.ndarray:
    with torch.no_grad():
        out = model(*args)
    return (out[0] if isinstance(out, tuple) else out).float().numpy()


class MaskedSoftmax(nn.Module):
    def forward(self, x, mask):
        return F.softmax(x.masked_fill(~mask, float("-inf")), -1)


class MaskedAttention(nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_masked_softmax_keeps_pytorch_nan_rows():
    """A fully masked row is NaN in PyTorch (softmax of all -inf), and so is a row of +inf
    scores; the fused build gave 0 there (the engine reads exp(-inf - m) as 0 even where
    m = -inf).  Whether the pass fuses it or not, the output is PyTorch's."""
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[0] = False
    x[2, :], mask[2, 0] = float("inf"), False
    expected = _torch(MaskedSoftmax(), (x, mask))
    got, _ = _outputs(import_torch(MaskedSoftmax().eval(), (x, mask)), (x, mask), True)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_allclose(got[1], expected[1], rtol=2e-5, atol=2e-5)


def test_safe_softmax_rows_with_nan_or_inf_scores_stay_nan():
    """torch.export's safe softmax gives 0 only where every score is -inf; a row with a
    NaN or +inf score is NaN.  The pass lifted the flag as "sum of exponentials > 0",
    which is false for those rows too, and wrote 0."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g) for n in (4, 6, 6))
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[0, 0, 0] = False  # row 0: no visible key (0 in PyTorch)
    q[0, 0, 1, 0] = float("nan")  # row 1: NaN scores
    q[0, 0, 2], k[0, 0] = float("inf"), 1.0  # row 2: +inf scores
    args = (q, k, v, mask)
    expected = _torch(MaskedAttention(), args)
    got, report = _outputs(import_torch(MaskedAttention().eval(), args), args, True)
    assert report.fused == 1, str(report)
    assert np.isnan(expected[0, 0, 1:3]).all() and (expected[0, 0, 0] == 0).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(expected), atol=2e-5)


class LowPrecision(nn.Module):
    """An RMS norm and a Linear in ``dtype`` (float32 at the boundary, so it runs on numpy
    arrays), then a softmax."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.fc = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = x.to(self.dtype)
        h = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-5)
        return torch.softmax(self.fc(h), -1).float()


class LowPrecisionScores(nn.Module):
    """Attention scores of ``dtype`` queries and keys (TVM's import makes the products
    float32), softmax, values."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, q, k, v):
        q, k, v = (t.to(self.dtype) for t in (q, k, v))
        return (torch.softmax(q @ k.transpose(-2, -1) / 4.0, -1) @ v).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_scores_stay_in_relax_and_values_are_read_in_their_dtype(dtype):
    """The kernel once read the queries and keys as float32: its call failed TVM's type
    check ("Argument 0 type mismatch") after derivation and build.  They stay in Relax; the
    float32 softmax and value product after them are one kernel, which reads the values
    in their own dtype (the cast to float32 folded into its loads).  Its output is the
    float64 oracle of the rounded inputs to float32 precision.  (TVM's own unfused build of
    the bfloat16 model was measured 5.6e-3 away from that oracle.)"""
    g = torch.Generator().manual_seed(4)
    args = tuple(torch.randn(1, 2, 6, 16, generator=g) for _ in range(3))
    model = LowPrecisionScores(dtype).eval()
    mod = import_torch(model, args)
    fused, report = _outputs(mod, args, True)
    assert report.fused == 1 and not any("mismatch" in why for why in report.reasons())
    q, k, v = (a.to(dtype).double().numpy() for a in args)
    s = (q @ np.swapaxes(k, -1, -2)).astype(np.float32).astype(np.float64) / 4.0
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(fused, p / p.sum(-1, keepdims=True) @ v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused, _torch(model, args), atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_arithmetic_is_fused_and_computed_in_float32(dtype):
    """A norm and a Linear computed in ``dtype`` by the model, then a softmax: once refused
    ("redfuser kernels compute in float32"), now fused and computed in float32, with only
    what a kernel stores rounded (``frag.computed``, torch.compile's convention; here
    nothing: TVM's import makes the product float32, and the softmax's cast to float32 at
    the end is folded away), where the unfused graph rounds the norm at every step.  The
    output is the float64 oracle of the chain on the rounded input to float32 precision."""
    torch.manual_seed(2)
    model = LowPrecision(dtype).eval().to(dtype)
    args = (torch.randn(2, 4, 16),)
    mod = import_torch(model, args)
    fused, report = _outputs(mod, args, True)
    assert report.fused == 2 and not report.reasons(), str(report)
    # both kernels run: the softmax once read the GEMM cascade's result from the matmul
    # behind its reshape (``Lifter.peel``), which then stayed in Relax, the kernel dead
    assert str(fuse_module(mod)[0]["main"]).count("R.call_tir(redfuser_main") == 2
    h = args[0].to(dtype).double().numpy()
    h = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)
    logits = h @ model.fc.weight.detach().double().numpy().T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(fused, p / p.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


class NormThenSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)

    def forward(self, x, y):
        return self.ln(x), torch.softmax(y * 2.0, -1)


def test_an_unexpected_error_lifting_one_candidate_is_reported_not_raised(monkeypatch):
    """The multiply's handler fails (an error no handler expects; it used to vanish when
    the op was not a reduction): the multiply stays in Relax with the error's type and
    message in the report, and both cascades are still fused."""
    def broken(lf, call, ty):
        raise RuntimeError("a handler bug")

    monkeypatch.setitem(ops.OPS, "relax.multiply", broken)
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g))
    model = NormThenSoftmax().eval()
    mod = import_torch(model, args)
    executable, report = build(mod, fuse=True)
    assert report.fused == 2, str(report)
    assert any("RuntimeError: a handler bug" in why for why in report.reasons()), str(report)
    with torch.no_grad():
        expected = [o.numpy() for o in model(*args)]
    for got, want in zip(run(executable, *[a.numpy() for a in args]), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("symbolic", [False, True])
def test_an_unexpected_error_in_a_block_leaves_it_unchanged(monkeypatch, symbolic):
    """A failure outside any one binding (here the grouping of a block) leaves that block
    as it was and names the error; the pass returns (with symbolic shapes it raised)."""
    def broken(lifter):
        raise KeyError("grouping bug")

    monkeypatch.setattr(driver, "form_groups", broken)
    args = (torch.randn(4, 16), torch.randn(4, 16))
    rows = torch.export.Dim("rows", min=2, max=64)
    shapes = ({0: rows}, {0: rows}) if symbolic else None
    mod = import_torch(NormThenSoftmax().eval(), args, dynamic_shapes=shapes)
    fused, report = fuse_module(mod)
    assert report.fused == 0 and "block 0 not analysed: KeyError" in report.reasons()[0]
    assert fused.script() == mod.script()


@pytest.mark.parametrize("fused", [False, True])
def test_run_takes_numpy_arrays_at_any_16_byte_alignment(fused):
    """Regression (shared repro relax_run_segfault.py): TVM's own kernels in a Relax
    executable assume 64-byte aligned tensors; ``run`` used to hand over numpy's memory as
    it was and crashed the interpreter at addresses 16, 32 or 48 mod 64."""
    executable, _ = build(softmax_module((64, 1024)), fuse=fused)
    raw = np.random.default_rng(0).normal(size=64 * 1024 + 16).astype(np.float32)
    for offset in range(4):  # 0, 16, 32 and 48 bytes past wherever raw starts
        a = raw[4 * offset:4 * offset + 64 * 1024].reshape(64, 1024)
        out = run(executable, a)
        ref = np.exp(a - a.max(1, keepdims=True))
        np.testing.assert_allclose(out, ref / ref.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("keep,fill", [(False, -np.inf), (False, -1e30), (True, -np.inf),
                                       (True, -1e30)])
def test_masks_keep_select_semantics_with_garbage_in_masked_slots(keep, fill):
    """Regression (relax_mask_garbage.py): where(mask, -inf, s) used to become
    s + where(mask, -inf, 0), so +inf or NaN in a masked slot poisoned the row."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 8), "float32"))
    m = relax.Var("m", relax.TensorType((2, 8), "bool"))
    with bb.function("main", [x, m]):
        with bb.dataflow():
            k = relax.const(fill, "float32")
            s = bb.emit(relax.op.where(m, x, k) if keep else relax.op.where(m, k, x))
            y = bb.emit_output(relax.op.nn.softmax(s))
        bb.emit_func_output(y)
    executable, report = build(bb.get())
    assert (report.found, report.fused) == (1, 1), str(report)
    xa = np.arange(16, dtype=np.float32).reshape(2, 8) / 4
    xa[:, 6], xa[:, 7] = np.inf, np.nan
    masked = np.zeros((2, 8), bool)
    masked[:, 5:] = True
    mask = ~masked if keep else masked
    s = np.where(masked, -np.inf, xa).astype(np.float64)
    ref = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(run(executable, xa, mask), ref / ref.sum(1, keepdims=True),
                               rtol=1e-6, atol=1e-7)


def test_padding_mask_with_nan_keys_matches_pytorch():
    """Regression (relax_attention_nan_padding.py): NaN in padded (masked) key rows."""

    class Attn(nn.Module):
        def forward(self, q, k, v, pad):
            s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(
                pad[:, None, None, :], float("-inf"))
            return F.softmax(s, -1) @ v

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[1, 10:] = True
    k[1, :, 10:] = float("nan")
    ref = Attn()(q, k, v, pad).numpy()
    executable, report = build(import_torch(Attn(), (q, k, v, pad)))
    assert report.fused >= 1, str(report)
    (out,) = run(executable, *[t.numpy() for t in (q, k, v, pad)])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
