"""FuseCascadedReductions on Relax modules imported from PyTorch, and on three real models.

Every fused module is compiled for this CPU and compared with PyTorch.  Tolerance: the
fused kernels run each cascade in one float32 pass (sums reassociated, rescaled by the
derived rule, a polynomial exp with relative error 8.5e-8), so outputs of magnitude
O(1-10) after sums of up to 256 terms differ from PyTorch's float32 by a few ulp times the
accumulation length: atol = rtol = 2e-5 holds with room (measured errors are ~5e-7).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from torch import nn

from redfuser.examples.models import examples
from redfuser.relax import FuseCascadedReductions, build, fuse_module, run
from redfuser.tvm.cuda import cuda_source, nvcc_compile
from redfuser.tvm.graph import import_torch, relax
from redfuser.tvm.ir import structural_equal
from redfuser.tvm.target import cuda_target
from tests.support import KERNEL_TOL, needs_nvcc, softmax_module

TOL = dict(atol=KERNEL_TOL, rtol=KERNEL_TOL)


def _torch_outputs(model, args) -> list[np.ndarray]:
    with torch.no_grad():
        out = model(*args)
    return [o.numpy() for o in (out if isinstance(out, tuple) else (out,))]


def _fused(model, args):
    """(report, fused outputs, PyTorch outputs) of a model built with the pass."""
    mod = import_torch(model.eval(), args)
    executable, report = build(mod, fuse=True)
    got = run(executable, *[a.numpy() for a in args])
    return report, got, _torch_outputs(model, args)


class Attention(nn.Module):
    """Scaled scores, an optional additive mask or causal masked_fill, softmax, values."""

    def __init__(self, mask: str = "none"):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v, m):
        s = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
        if self.mask == "additive":
            s = s + m
        elif self.mask == "causal":
            s = s.masked_fill(torch.ones_like(m).tril() == 0, float("-inf"))
        return torch.softmax(s, dim=-1) @ v


class NormLinear(nn.Module):
    def __init__(self, norm: str, linear: bool, d: int = 48):
        super().__init__()
        self.norm, self.weight = norm, nn.Parameter(1 + 0.1 * torch.randn(d))
        self.ln, self.rms = nn.LayerNorm(d), nn.RMSNorm(d, eps=1e-6)
        self.lin = nn.Linear(d, 24) if linear else nn.Identity()

    def forward(self, x):
        if self.norm in ("layernorm", "nn.RMSNorm"):
            y = (self.ln if self.norm == "layernorm" else self.rms)(x)
        else:  # RMSNorm as Llama writes it
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.lin(y)


class Epilogue(nn.Module):
    """RMSNorm, a linear layer with bias, GELU and a residual add: the three ops after the
    matmul are folded into the kernel's finalize (per output feature)."""

    def __init__(self, d: int = 48, p: int = 24):
        super().__init__()
        self.weight, self.lin = nn.Parameter(1 + 0.1 * torch.randn(d)), nn.Linear(d, p)

    def forward(self, x, residual):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return F.gelu(self.lin(y)) + residual


class GatedMLP(nn.Module):
    """Llama's MLP input: RMSNorm, then silu(gate(y)) * up(y): both matmuls and the gating
    in one kernel (its output is the product, not the two projections)."""

    def __init__(self, d: int = 48, p: int = 40):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.gate, self.up = nn.Linear(d, p, bias=False), nn.Linear(d, p, bias=False)

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return F.silu(self.gate(y)) * self.up(y)


class PostLN(nn.Module):
    """BERT's post-LN block: ``h = LayerNorm(x + a)``, then ``LayerNorm(h + MLP(h))``.  The
    second LayerNorm's input ``MLP(h)`` is computed from the first kernel's output, so it
    reads ``h`` back rather than recomputing the first LayerNorm inside (a kernel that would
    need its own output)."""

    def __init__(self, d: int = 48, f: int = 64):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x, a):
        h = self.ln1(x + a)
        return self.ln2(h + self.down(F.gelu(self.up(h))))


class GroupedQueryAttention(nn.Module):
    """K/V repeated for the query heads as transformers' ``repeat_kv`` writes it."""

    def forward(self, q, k, v):
        b, hk, n, d = k.shape
        g = q.shape[1] // hk
        k, v = (t[:, :, None].expand(b, hk, g, n, d).reshape(b, hk * g, n, d) for t in (k, v))
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), dim=-1) @ v


class LogSoftmax(nn.Module):
    def forward(self, x, t):
        return F.log_softmax(x, dim=-1), F.cross_entropy(x, t)


class Router(nn.Module):
    def forward(self, logits):
        w, idx = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1)
        return w / w.sum(-1, keepdim=True), idx


def _attention_args(mask: str):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(3))
    m = torch.randn(16, 16, generator=g)
    if mask == "additive":  # padding-style -inf: leading keys (the running max starts at
        m[:, :3] = float("-inf")  # -inf), a block, a row with one visible key; never a
        m[2:4, 9:12] = float("-inf")  # whole row (that is NaN in PyTorch too)
        m[5, :15] = float("-inf")
    return q, k, v, m


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(2))


PATTERNS = {  # name -> (model, inputs, cascades fused, ops every fused kernel must contain)
    "attention": (Attention("none"), _attention_args("none"), 1, {"matmul", "softmax"}),
    "attention_additive_mask": (Attention("additive"), _attention_args("additive"), 1,
                                {"matmul", "add", "softmax"}),
    "attention_causal": (Attention("causal"), _attention_args("causal"), 1,
                         {"matmul", "where", "softmax"}),
    "layernorm": (NormLinear("layernorm", False), (_x(2, 6, 48),), 1, {"layer_norm"}),
    "rmsnorm": (NormLinear("rmsnorm", False), (_x(2, 6, 48),), 1, {"mean", "rsqrt"}),
    "nn_rmsnorm": (NormLinear("nn.RMSNorm", False), (_x(2, 6, 48),), 1, {"mean", "rsqrt"}),
    "layernorm_linear": (NormLinear("layernorm", True), (_x(2, 6, 48),), 1,
                         {"layer_norm", "matmul"}),
    "rmsnorm_linear": (NormLinear("rmsnorm", True), (_x(2, 6, 48),), 1, {"mean", "matmul"}),
    "rmsnorm_linear_gelu_residual": (Epilogue(), (_x(2, 6, 48), _x(2, 6, 24)), 1,
                                     {"mean", "matmul", "add", "gelu"}),
    "gated_mlp": (GatedMLP(), (_x(2, 6, 48),), 1, {"mean", "matmul", "sigmoid", "multiply"}),
    "post_ln": (PostLN(), (_x(2, 6, 48), _x(2, 6, 48)), 2, {"layer_norm", "add"}),
    "log_softmax_cross_entropy": (LogSoftmax(), (_x(8, 40), torch.arange(8) * 3), 2,
                                  {"log_softmax"}),
    "softmax_topk": (Router(), (_x(10, 8),), 2, set()),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_fused_and_matches_pytorch(name):
    model, args, count, ops = PATTERNS[name]
    report, got, expected = _fused(model, args)
    # every other reduction is in the report too, skipped with its reason (the loss's mean
    # over the batch), never silently left out
    skipped = [g for g in report.groups if not g.fused]
    assert report.fused == count and report.found == count + len(skipped), str(report)
    assert all(g.reason for g in skipped), str(report)
    for group in report.groups:
        if group.fused:
            assert ops <= {o.split()[0] for o in group.ops}, str(group)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, **TOL)


def test_epilogue_after_the_matmul_leaves_nothing_in_relax():
    """Bias, GELU and residual are computed by the kernel: the fused module's main calls no
    Relax op on the kernel's result but the reshape back."""
    mod = import_torch(Epilogue().eval(), (_x(2, 6, 48), _x(2, 6, 24)))
    fused, report = fuse_module(mod)
    assert report.fused == 1, str(report)
    text = fused["main"].script()
    assert "R.nn.gelu" not in text and "R.add" not in text, text


def test_grouped_query_attention_reads_k_and_v_without_the_repeat():
    """One kernel for scores, softmax and P.V; K and V are read as they are before the
    repeat (each row shared by the query heads of its group), so no broadcast is left."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 16, 8, generator=g)
    k, v = (torch.randn(2, 2, 24, 8, generator=g) for _ in range(2))
    fused, report = fuse_module(import_torch(GroupedQueryAttention(), (q, k, v)))
    assert report.fused == 1 and {"matmul", "softmax"} <= {
        o.split()[0] for o in report.groups[0].ops}, str(report)
    assert "R.broadcast_to" not in fused["main"].script()
    report, got, expected = _fused(GroupedQueryAttention(), (q, k, v))
    np.testing.assert_allclose(got[0], expected[0], **TOL)


def test_router_fuses_topk_and_renormalisation():
    report, got, expected = _fused(Router(), (_x(10, 8),))
    kinds = [{o.split()[0] for o in g.ops} for g in report.groups]
    assert {"softmax", "topk"} <= kinds[0] and {"sum", "divide"} <= kinds[1]
    np.testing.assert_array_equal(got[1], expected[1])  # expert ids exactly


def test_fused_matches_unfused_build():
    model, args = Attention("causal"), _attention_args("causal")
    mod = import_torch(model, args)
    arrays = [a.numpy() for a in args]
    fused = run(build(mod, fuse=True)[0], *arrays)
    unfused = run(build(mod, fuse=False)[0], *arrays)
    np.testing.assert_allclose(fused[0], unfused[0], **TOL)


class Unfusable(nn.Module):
    """sum(relu(x - max(x))): the kink moves with the running max (no one-pass form);
    a plain softmax next to it is fused."""

    def forward(self, x):
        return torch.relu(x - x.max(-1, keepdim=True).values).sum(-1), torch.softmax(x, -1)


def test_unfusable_group_left_untouched_with_reason():
    report, got, expected = _fused(Unfusable(), (_x(4, 32),))
    skipped = [g for g in report.groups if g.status == "skipped"]
    assert report.fused == 1 and len(skipped) == 1
    assert "NotFusable" in skipped[0].reason and "relu" in skipped[0].reason
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, **TOL)


def test_failed_kernel_build_keeps_the_module_whole(monkeypatch):
    from redfuser.relax import driver

    def refuse(kernel):
        raise RuntimeError("simulated codegen failure")

    monkeypatch.setattr(driver, "check_kernel", refuse)
    mod = import_torch(Attention("none"), _attention_args("none"))
    fused, report = fuse_module(mod)
    assert (report.found, report.fused) == (1, 0)
    assert "simulated codegen failure" in report.groups[0].reason
    assert structural_equal(fused, mod)


def test_symbolic_sequence_length_is_fused_and_runs_at_two_lengths():
    """A torch.export Dim on the sequence: the group is fused with a kernel for every length
    (tests/lowering/test_symbolic.py covers the rest), never skipped."""
    from torch.export import Dim, export
    from tvm.relax.frontend.torch import from_exported_program

    model = NormLinear("rmsnorm", False)
    with torch.no_grad():
        program = export(model, (_x(2, 6, 48),), dynamic_shapes={"x": {1: Dim("seq", max=64)}})
    mod = from_exported_program(program)
    fuse = FuseCascadedReductions(check_build=False)  # built once, by the pipeline
    ex, _ = build(fuse(mod), fuse=False)
    assert fuse.report.found >= 1 and fuse.report.fused == fuse.report.found, str(fuse.report)
    for length in (3, 50):
        x = _x(2, length, 48)
        with torch.no_grad():
            ref = model(x).numpy()
        (out,) = run(ex, x.numpy())
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_pass_in_a_pipeline_exposes_its_report():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((6, 40), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.softmax(x))
            z = bb.emit_output(relax.op.nn.layer_norm(y, relax.const(np.ones(40, "float32")),
                                                      relax.const(np.zeros(40, "float32")),
                                                      axes=[-1]))
        bb.emit_func_output(z)
    fuse = FuseCascadedReductions()
    from redfuser.tvm.graph import Sequential

    out = Sequential([fuse, relax.transform.LegalizeOps()])(bb.get())
    # softmax feeds layer_norm over the same axis: one cascade of four reductions
    assert (fuse.report.found, fuse.report.fused) == (1, 1)
    assert {"softmax", "layer_norm"} <= {o.split()[0] for o in fuse.report.groups[0].ops}
    assert out.script().count("R.call_tir(cls.redfuser_main_") == 1


def test_relax_native_rms_norm_and_variance():
    """Ops PyTorch's importer does not emit (R.nn.rms_norm, R.variance) lift as well."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((5, 64), "float32"))
    w = np.linspace(0.5, 1.5, 64, dtype="float32")
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.rms_norm(x, relax.const(w), axes=[-1], epsilon=1e-5))
            v = bb.emit(relax.op.variance(x, axis=[-1], keepdims=True))
            out = bb.emit_output(relax.Tuple([y, v]))
        bb.emit_func_output(out)
    executable, report = build(bb.get())
    assert (report.found, report.fused) == (2, 2), str(report)
    a = np.random.default_rng(3).normal(size=(5, 64)).astype("float32")
    got = run(executable, a)
    rms = np.sqrt((a.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got[0], a / rms * w, **TOL)
    np.testing.assert_allclose(got[1], a.astype(np.float64).var(-1, keepdims=True), **TOL)


def test_kernel_outputs_only_what_the_module_reads():
    """Softmax's max and sum feed its per-element output alone: they stay in the kernel's
    own buffers, and the call returns the softmax (one tensor, not a tuple with the
    statistics)."""
    mod = softmax_module((6, 40))
    fused, report = fuse_module(mod)
    kernel = fused[report.groups[0].kernel]
    assert len(kernel.params) == 2, kernel.script()  # x and the softmax
    executable, _ = build(mod)
    a = np.random.default_rng(4).normal(size=(6, 40)).astype("float32") * 10
    ref = np.exp(a.astype(np.float64) - a.max(1, keepdims=True))  # the float64 reference
    np.testing.assert_allclose(run(executable, a), ref / ref.sum(1, keepdims=True), **TOL)


@needs_nvcc
def test_cuda_target_in_scope_emits_cuda_kernels_that_compile_for_sm90():
    """With a CUDA target in scope the pass builds the kernel with the CUDA backend; the
    whole module then compiles for sm_90 and its CUDA source passes nvcc (no GPU here:
    the numbers are checked by ``make gpu-check``)."""
    mod = import_torch(Attention("additive"), _attention_args("additive"))
    with tvm.target.Target(cuda_target()):
        fused, report = fuse_module(mod)
    assert (report.found, report.fused) == (1, 1), str(report)
    assert "threadIdx.x" in fused[report.groups[0].kernel].script()
    source = cuda_source(tvm.compile(fused, target=tvm.target.Target(cuda_target())))
    assert report.groups[0].kernel in source
    assert b".target sm_90" in nvcc_compile(source, arch="sm_90")


def test_target_without_a_backend_reports_and_keeps_the_module():
    mod = import_torch(Attention("none"), _attention_args("none"))
    with tvm.target.Target("rocm"):
        fused, report = fuse_module(mod)
    assert (report.found, report.fused) == (1, 0) and "rocm" in report.groups[0].reason
    assert structural_equal(fused, mod)


def test_function_without_dataflow_is_unchanged():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    with bb.function("main", [x]):
        y = bb.emit(relax.op.nn.softmax(x))
        bb.emit_func_output(y)
    mod = bb.get()
    fused, report = fuse_module(mod)
    assert report.found == 0 and structural_equal(fused, mod)


@pytest.mark.parametrize("example", examples(), ids=lambda e: e.name)
def test_real_model_matches_pytorch(example):
    """Export, import, compile with the pass on CPU; every cascade the model contains
    (stated in models.py) is found and fused."""
    report, got, expected = _fused(example.model, example.inputs)
    assert report.found == report.fused == example.cascades, str(report)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, **TOL)


class _PostProjection(nn.Module):
    """GPT-2's MLP exit in small: a projection whose bias add follows it, a residual, then a
    LayerNorm; the projection stays in Relax (the LayerNorm's output per element would
    recompute it)."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(32, 16), nn.LayerNorm(16)

    def forward(self, x, r):
        h = (x.reshape(-1, 32) @ self.proj.weight.T + self.proj.bias).reshape(r.shape)
        return self.norm(h + r)


def test_arithmetic_on_a_matmul_left_in_relax_stays_with_that_matmul():
    """Lifted into the LayerNorm's kernel, the bias add left TVM a plain matmul, which it
    schedules twice as slowly as the matmul with its add (GPT-2's block: 0.80 ms fused
    against 0.75 unfused, 0.53 fused now); the add stays in Relax, the kernel reads its
    result, and the outputs are unchanged."""
    args = (_x(2, 5, 32), _x(2, 5, 16))
    model = _PostProjection().eval()
    fused, report = fuse_module(import_torch(model, args))
    assert report.fused == 1, str(report)
    bindings = [b for blk in fused["main"].body.blocks for b in blk.bindings]
    [matmul] = [b.var for b in bindings if getattr(b.value, "op", None) is not None and
                getattr(b.value.op, "name", "") == "relax.matmul"]
    assert any(getattr(b.value.op, "name", "") == "relax.add" and b.value.args[0].same_as(matmul)
               for b in bindings if hasattr(b.value, "op")), fused["main"].script()
    executable, _ = build(fused, fuse=False)
    (got,) = run(executable, *[a.numpy() for a in args])  # torch.export returns a tuple
    np.testing.assert_allclose(got, _torch_outputs(model, args)[0], **TOL)
