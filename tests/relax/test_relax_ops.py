"""The Relax pass on reductions over any axes and on the high-level norm ops, from PyTorch.

Each small module is exported with torch.export, imported with TVM's
``from_exported_program``, fused, built for this CPU, run and compared with PyTorch.
Tolerance: as in ``test_relax.py`` (one float32 pass per cascade, sums of at most a few
hundred terms of magnitude O(1)): atol = rtol = 2e-5.  Every reduction the pass meets is
in its report, fused or skipped with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from redfuser.relax import build, fuse_module, run
from redfuser.tvm.graph import import_torch, relax
from tests.support import KERNEL_TOL

TOL = dict(atol=KERNEL_TOL, rtol=KERNEL_TOL)


class Fn(nn.Module):
    """A module computing ``f(self, *inputs)``, holding ``mods`` (norm layers)."""

    def __init__(self, f, *mods):
        super().__init__()
        self.f, self.mods = f, nn.ModuleList(mods)

    def forward(self, *args):
        return self.f(self, *args)


def _x(*shape, seed: int = 2):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _affine(layer: nn.Module) -> nn.Module:
    """A norm layer with weights that are not 1 and 0 (so a misplaced weight shows)."""
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.linspace(0.5, 1.5, p.numel()).reshape(p.shape) + 0.1 * _x(*p.shape))
    return layer


CASES = {  # name -> (module, inputs, ops the fused kernel holds)
    "softmax_axis1_rank4": (Fn(lambda s, x: torch.softmax(x, 1)), (_x(2, 5, 3, 4),),
                            {"softmax"}),
    "log_softmax_axis1_rank4": (Fn(lambda s, x: F.log_softmax(x, 1)), (_x(2, 5, 3, 4),),
                                {"log_softmax"}),
    "layernorm_two_axes": (Fn(lambda s, x: s.mods[0](x), _affine(nn.LayerNorm([6, 8]))),
                           (_x(3, 6, 8),), {"layer_norm"}),
    "var_all_axes": (Fn(lambda s, x: x.var()), (_x(2, 6, 8),), {"variance", "multiply"}),
    "std_all_axes": (Fn(lambda s, x: x.std(unbiased=False)), (_x(2, 6, 8),),
                     {"variance", "sqrt"}),
    "softmax_middle_axis_rank3": (Fn(lambda s, x: torch.softmax(x, 1)), (_x(3, 7, 5),),
                                  {"softmax"}),
    "group_norm": (Fn(lambda s, x: s.mods[0](x), _affine(nn.GroupNorm(2, 6))),
                   (_x(2, 6, 4, 3),), {"group_norm"}),
    "instance_norm": (Fn(lambda s, x: s.mods[0](x), _affine(nn.InstanceNorm2d(6, affine=True))),
                      (_x(2, 6, 4, 3),), {"instance_norm"}),
    "batch_norm_training": (Fn(lambda s, x, w, b: F.batch_norm(x, None, None, w, b,
                                                               training=True)),
                            (_x(8, 6, 3, 2), _x(6, seed=3), _x(6, seed=4)),
                            {"instance_norm"}),
}


def _torch(model, args) -> list[np.ndarray]:
    with torch.no_grad():
        out = model(*args)
    return [o.numpy() for o in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("name", sorted(CASES))
def test_reduction_over_any_axes_fused_and_matches_pytorch(name):
    model, args, ops = CASES[name]
    executable, report = build(import_torch(model.eval(), args))
    assert (report.found, report.fused) == (1, 1), str(report)
    assert ops <= {o.split()[0] for o in report.groups[0].ops}, str(report)
    got = run(executable, *[a.numpy() for a in args])
    for g, e in zip(got, _torch(model, args), strict=True):
        np.testing.assert_allclose(g, e, **TOL)


def test_max_over_a_middle_axis_is_reported_and_correct():
    """A lone max over axis 1 is already one pass: reported skipped as such, never left
    out; the softmax over the same middle axis beside it is fused."""
    model = Fn(lambda s, x: (x.max(1).values, torch.softmax(x, 1)))
    args = (_x(2, 6, 8),)
    executable, report = build(import_torch(model.eval(), args))
    assert (report.found, report.fused) == (2, 1), str(report)
    [single] = [g for g in report.groups if not g.fused]
    assert "single reduction" in single.reason and single.ops[0].startswith("topk")
    for g, e in zip(run(executable, args[0].numpy()), _torch(model, args), strict=True):
        np.testing.assert_allclose(g, e, **TOL)


def _module(make, shape=(2, 4, 6, 8)):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(make(x))
        bb.emit_func_output(y)
    return bb.get()


UNSUPPORTED = {  # op -> (Relax value of x: (2, 4, 6, 8), words of its reason)
    "cumsum": (lambda x: relax.op.cumsum(x, axis=3), "scan"),
    "sort": (lambda x: relax.op.sort(x, axis=3), "sort"),
    "avg_pool2d": (lambda x: relax.op.nn.avg_pool2d(x, (2, 2)), "pooling"),
    "adaptive_avg_pool2d": (lambda x: relax.op.nn.adaptive_avg_pool2d(x, (1, 1)), "pooling"),
    "attention_window": (lambda x: relax.op.nn.attention(x, x, x, window_size=2), "window"),
    "sum_int": (lambda x: relax.op.sum(relax.op.astype(x, "int32"), axis=[3]), "dtype int32"),
    "prod_single": (lambda x: relax.op.prod(x, axis=[1, 2]), "single reduction"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_every_reduction_op_is_in_the_report(name):
    make, words = UNSUPPORTED[name]
    _, report = fuse_module(_module(make))
    assert report.found == 1 and report.fused == 0, str(report)
    assert words in report.groups[0].reason, str(report)


def _sdpa_args(heads: int = 2, kv_heads: int = 2, q_len: int = 8, kv_len: int = 12, d: int = 4):
    g = torch.Generator().manual_seed(5)
    return (torch.randn(1, heads, q_len, d, generator=g),
            torch.randn(1, kv_heads, kv_len, d, generator=g),
            torch.randn(1, kv_heads, kv_len, d, generator=g))


def _bool_mask(q_len: int = 8, kv_len: int = 12):
    """Random visibility, one row with no visible key (safe softmax: 0) and one with one."""
    keep = torch.rand(q_len, kv_len, generator=torch.Generator().manual_seed(6)) > 0.4
    keep[2], keep[5] = False, False
    keep[5, 7] = True
    return keep


SDPA = {  # name -> (module, inputs)
    "plain": (Fn(lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v)), _sdpa_args()),
    "bool_mask_fully_masked_row": (
        Fn(lambda s, q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
        (*_sdpa_args(), _bool_mask())),
    "additive_mask": (
        Fn(lambda s, q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
        (*_sdpa_args(), _x(8, 12, seed=7))),
    "causal": (Fn(lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
               _sdpa_args(kv_len=8)),
}


@pytest.mark.parametrize("name", sorted(SDPA))
def test_decomposed_sdpa_is_one_attention_kernel(name):
    """torch.export's SDPA (QK matmul, mask, safe softmax with its where, PV matmul) is one
    fused kernel: both matmuls and the softmax in it, no int8 reduction left over."""
    model, args = SDPA[name]
    mod = import_torch(model.eval(), args)
    fused, report = fuse_module(mod)
    assert (report.found, report.fused) == (1, 1), str(report)
    assert {"matmul", "softmax"} <= {o.split()[0] for o in report.groups[0].ops}
    text = fused.script()
    assert "R.nn.softmax" not in text and "R.matmul" not in text, text
    assert "R.max" not in text and "int8" not in text, text
    executable, _ = build(mod)
    (got,) = run(executable, *[a.numpy() for a in args])
    (expected,) = _torch(model, args)
    np.testing.assert_allclose(got, expected, **TOL)


def _attention_reference(q, k, v, bias=None, scale=None, causal=None):
    """float64 attention in TVM's BSNH layout; K/V heads repeated for GQA; causal masks
    as R.nn.attention documents them (TopLeft: tril(k=0), BottomRight: tril(k=|S - S_kv|))."""
    q, k, v = (a.astype(np.float64).transpose(0, 2, 1, 3) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * (scale or 1 / np.sqrt(q.shape[-1]))
    if bias is not None:
        s = s + bias
    if causal is not None:
        offset = 0 if causal == "TopLeft" else abs(s.shape[2] - s.shape[3])
        s = np.where(np.tril(np.ones(s.shape[2:], bool), k=offset), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3)


ATTENTION = {  # name -> (q heads, kv heads, S, S_kv, bias shape or None, scale, causal mask)
    "plain": (2, 2, 6, 9, None, None, None),
    "gqa_4_heads_on_2": (4, 2, 6, 9, None, 0.3, None),
    "bias_per_head": (2, 2, 6, 9, (1, 2, 6, 9), None, None),
    "bias_broadcast_heads": (4, 1, 6, 9, (2, 1, 6, 9), None, None),
    "causal_top_left": (2, 2, 7, 7, None, None, "TopLeft"),
    "causal_bottom_right_gqa": (4, 2, 5, 8, None, None, "BottomRight"),
}


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_relax_attention_op_lifted(name):
    """R.nn.attention / attention_bias: one fused kernel, against the float64 reference;
    with grouped heads, K and V are read as they are (no repeated copy in the module)."""
    heads, kv_heads, s, n, bias_shape, scale, causal = ATTENTION[name]
    rng = np.random.default_rng(8)
    arrays = [rng.normal(size=(2, length, h, 8)).astype("float32")
              for length, h in ((s, heads), (n, kv_heads), (n, kv_heads))]
    if bias_shape:
        arrays.append(rng.normal(size=bias_shape).astype("float32"))
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"a{k}", relax.TensorType(a.shape, "float32")) for k, a in enumerate(arrays)]
    with bb.function("main", xs):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.attention(*xs[:3], xs[3] if bias_shape else None,
                                                     scale, causal))
        bb.emit_func_output(y)
    fused, report = fuse_module(bb.get())
    assert (report.found, report.fused) == (1, 1), str(report)
    assert "R.nn.attention" not in fused.script() and "repeat" not in fused.script()
    executable, _ = build(bb.get())
    expected = _attention_reference(*arrays[:3], arrays[3] if bias_shape else None, scale,
                                    causal)
    np.testing.assert_allclose(run(executable, *arrays), expected, **TOL)


def _batch_norm_module(shape: tuple, axis: int, training: bool = True):
    c = shape[axis]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    params = [relax.Var(n, relax.TensorType((c,), "float32")) for n in ("g", "b", "mm", "mv")]
    with bb.function("main", [x, *params]):
        with bb.dataflow():
            t = bb.emit(relax.op.nn.batch_norm(x, *params, axis=axis, epsilon=1e-5,
                                               momentum=0.25, training=training))
            out = bb.emit_output(relax.Tuple([relax.TupleGetItem(t, k) for k in range(3)]))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("shape,axis", [((4, 3, 5, 6), 1), ((4, 5, 6, 3), -1), ((16, 7), 1)])
def test_batch_norm_in_training_is_one_kernel_with_its_running_statistics(shape, axis):
    """R.nn.batch_norm(training=True): the batch's mean and (biased) variance over every axis
    but the channel's, the normalised value with its weight and bias, and the running
    statistics (1 - momentum) * old + momentum * batch (TOPI's semantics), all from one
    kernel; against float64 numpy."""
    mod = _batch_norm_module(shape, axis)
    executable, report = build(mod)
    assert (report.found, report.fused) == (1, 1), str(report)
    rng = np.random.default_rng(11)
    c = shape[axis]
    x = (rng.normal(size=shape) * 3 + 1).astype(np.float32)
    g, b, mm = (rng.normal(size=c).astype(np.float32) for _ in range(3))
    mv = rng.uniform(0.5, 2.0, c).astype(np.float32)
    got = run(executable, x, g, b, mm, mv)
    reduced = tuple(a for a in range(len(shape)) if a != axis % len(shape))
    x64 = x.astype(np.float64)
    mean, var = x64.mean(reduced, keepdims=True), x64.var(reduced, keepdims=True)
    bshape = [1] * len(shape)
    bshape[axis] = c
    want = [(x64 - mean) / np.sqrt(var + 1e-5) * g.reshape(bshape) + b.reshape(bshape),
            0.75 * mm + 0.25 * mean.ravel(), 0.75 * mv + 0.25 * var.ravel()]
    for gv, w in zip(got, want, strict=True):
        np.testing.assert_allclose(gv, w, **TOL)


def test_batch_norm_in_inference_is_no_reduction_and_not_reported():
    _, report = fuse_module(_batch_norm_module((4, 3, 5, 6), 1, training=False))
    assert report.found == 0, str(report)
