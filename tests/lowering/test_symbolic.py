"""Symbolic shapes: one kernel for every row count and stream length (``dynamic=True``).

Each kernel is built once and called at N in {0, 1, 7, 64, 333} and several row counts;
every output is compared with the float64 oracle (``redfuser.reference``).  Tolerances:
RTOL 2e-5 / ATOL 1e-5 as in test_kernel_edges (float32 sums of up to 333 terms, fast exp
at 8.5e-8), attention's ATOL scaled by D (its output is a sum of D-wide products).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm

import redfuser
import redfuser.relax as rr
from algebra.library import example_inputs
from redfuser.lowering import shape_geometry
from redfuser.lowering.geometry import dynamic_key, fits
from redfuser.relax.bounds import tightened
from redfuser.relax.driver import fuse_module
from redfuser.tvm.cuda import cuda_source, nvcc_compile
from redfuser.tvm.graph import import_torch, relax
from redfuser.tvm.ir import tirx
from redfuser.tvm.target import cuda_target
from tests.support import KERNEL_TOL, assert_matches

RTOL, ATOL = KERNEL_TOL, 1e-5
LENGTHS = (0, 1, 7, 64, 333)
ROWS = ((3,), (1,), (5,), (2,), (4,))  # one per length: several row counts, one build
rng = np.random.default_rng(13)


def check(kernel, name: str, inputs: dict, atol: float = ATOL) -> None:
    out, ref = kernel(**inputs), redfuser.reference(name, inputs)
    assert list(out) == list(ref)
    shapes = {k: np.shape(v) for k, v in inputs.items()}
    for k, r in ref.items():
        assert_matches(out[k], r, RTOL, atol, f"{name} {k} at {shapes}")


def stream(rows: tuple, n: int) -> np.ndarray:
    return rng.normal(size=(*rows, n)).astype(np.float32) * 3


@pytest.mark.parametrize("name", ["softmax", "variance"])
def test_one_build_serves_every_row_count_and_length(name):
    kernel = redfuser.compile(name, dynamic=True)
    for rows, n in zip(ROWS, LENGTHS, strict=True):
        check(kernel, name, {"x": stream(rows, n)})
    assert kernel.builds == 1
    assert "dynamic shapes" in str(kernel.plan)


def test_layernorm_weights_broadcast_over_any_rows():
    """g and b are streams shared by every row (broadcast row axis) next to x (rows, N)."""
    kernel = redfuser.compile("layernorm", dynamic=True)
    for rows, n in zip(((2, 3), (1, 1), (4, 1), (1, 5)), (5, 1, 64, 333), strict=True):
        x = stream(rows, n)
        check(kernel, "layernorm", {"x": x, "g": stream((), n), "b": stream((), n), "eps": 1e-5})
    assert kernel.builds == 1


def test_attention_one_build_for_heads_queries_and_keys():
    """A stream with a feature axis: K/V (H, 1, N, D) broadcast over the L queries of a
    head; L = 1 (decode) runs on the kernel built for L > 1 (``geometry.fits``)."""
    kernel, d = redfuser.compile("attention", dynamic=True), 16
    for (h, queries), n in zip(((2, 4), (2, 1), (3, 5), (1, 1), (2, 3)), LENGTHS, strict=True):
        q = rng.normal(size=(h, queries, d)).astype(np.float32)
        k, v = (rng.normal(size=(h, 1, n, d)).astype(np.float32) for _ in "kv")
        check(kernel, "attention", {"q": q, "k": k, "v": v, "scale": 0.25}, ATOL * d)
    assert kernel.builds == 1


def test_special_values_and_the_unfused_baseline():
    """-inf rows, a NaN, huge magnitudes and ties, fused and unfused, both dynamic."""
    x = stream((4,), 77)
    x[0] = -np.inf
    x[1, 5] = np.nan
    x[2] *= 1e30
    x[3] = 2.0
    for variant in ("rolling", "unfused"):
        kernel = redfuser.compile("softmax", dynamic=True, variant=variant)
        check(kernel, "softmax", {"x": x})
        check(kernel, "softmax", {"x": x[:, :3]})
        assert kernel.builds == 1 and kernel.plan.variant == variant


def test_new_broadcast_pattern_is_a_second_build_and_old_ones_stay():
    rule = redfuser.derive("attention")

    def geo(queries):
        kv = (2, 1, 9, 8)
        return shape_geometry(rule, {"q": (2, queries, 8), "k": kv, "v": kv})

    assert fits(dynamic_key(rule, geo(3)), rule, geo(1))
    assert not fits(dynamic_key(rule, geo(1)), rule, geo(3))
    kernel = redfuser.compile("attention", dynamic=True)
    def args(queries):
        return {"q": np.ones((2, queries, 8), np.float32), "scale": 1.0,
                **{s: np.ones((2, 1, 9, 8), np.float32) for s in "kv"}}

    kernel(**args(1))
    kernel(**args(3))  # K/V now broadcast over the queries: another kernel
    kernel(**args(1))
    kernel(**args(6))
    assert kernel.builds == 2


@pytest.mark.parametrize(("options", "message"), [
    ({"splits": 2}, "splits"), ({"variant": "split"}, "split"), ({"tune": True}, "tune"),
    ({"target": "cuda", "variant": "split"}, "split"), ({"dynamic": "yes"}, "dynamic")])
def test_options_a_dynamic_kernel_cannot_honour_are_refused(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        redfuser.compile("softmax", **{"dynamic": True, **options})(x=stream((2,), 8))


# -- Relax: modules whose sequence length is a shape variable -----------------------------

def _attention_module(heads: int = 2, d: int = 16):
    """softmax(q k^T * scale) v over a symbolic sequence length L (queries and keys)."""
    length = tirx.Var("L", "int64")
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(n, relax.TensorType((1, heads, length, d), "float32")) for n in "qkv")
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            s = bb.emit(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2])))
            p = bb.emit(relax.op.nn.softmax(relax.op.multiply(s, relax.const(0.25))))
            o = bb.emit_output(relax.op.matmul(p, v))
        bb.emit_func_output(o)
    return bb.get()


def _softmax_rows(q, k, v):
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2) * 0.25
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True) @ v


def test_relax_symbolic_sequence_length_is_fused_and_runs_at_two_lengths():
    fuse = rr.FuseCascadedReductions(check_build=False)  # built once, by the pipeline
    fused = fuse(_attention_module())
    assert (fuse.report.found, fuse.report.fused) == (1, 1), str(fuse.report)
    assert "dynamic shapes" in fuse.report.groups[0].reason
    out_ty = fused["main"].ret_ty  # the output keeps the function's own shape variable
    assert str(out_ty.shape.values[2]) == "L"
    ex, _ = rr.build(fused, fuse=False)
    for length in (3, 70):
        q, k, v = (rng.normal(size=(1, 2, length, 16)).astype(np.float32) for _ in "qkv")
        np.testing.assert_allclose(rr.run(ex, q, k, v), _softmax_rows(q, k, v), rtol=1e-5,
                                   atol=1e-5)


def test_relax_size_that_is_not_a_product_of_variables_is_refused():
    """softmax over a concatenation of length L + 1: the probes read it back differently,
    so the group is skipped with the reason (never fused with a wrong shape)."""
    length = tirx.Var("L", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, length), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.concat([x, relax.op.zeros((4, 1), "float32")], axis=1))
            z = bb.emit_output(relax.op.nn.softmax(y))
        bb.emit_func_output(z)
    fuse = rr.FuseCascadedReductions()
    fuse(bb.get())
    assert fuse.report.fused == 0
    assert all(g.reason for g in fuse.report.groups)


def test_relax_symbolic_single_reduction_is_reported_as_one_pass():
    """A lone sum over a middle axis of a symbolic-length tensor (Mixtral's expert combine)
    is no cascade: the report still names it, skipped as already one pass."""
    length = tirx.Var("L", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((length, 2, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.sum(x, axis=[1]))
            z = bb.emit_output(relax.op.nn.softmax(relax.op.multiply(y, y)))
        bb.emit_func_output(z)
    fuse = rr.FuseCascadedReductions(check_build=False)
    fuse(bb.get())
    ops = {op: g for g in fuse.report.groups for op in g.ops}
    assert f"sum {y.name}" in ops, str(fuse.report)
    assert not ops[f"sum {y.name}"].fused and "single reduction" in ops[f"sum {y.name}"].reason
    assert ops[f"softmax {z.name}"].fused, str(fuse.report)


class _NormSoftmax(torch.nn.Module):
    """LayerNorm plus a softmax over the features, of a (1, seq, 32) input."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(x) + torch.softmax(x * 2.0, dim=-1)


def _export_seq(model: torch.nn.Module, longest: int):
    """``model`` of a (1, seq, 32) input exported with 2 <= seq <= ``longest``."""
    seq = torch.export.Dim("seq", min=2, max=longest)
    return import_torch(model, (torch.randn(1, 8, 32),), dynamic_shapes={"x": {1: seq}})


def _matches_torch(model, builds: list, lengths: tuple, atol: float) -> None:
    for length in lengths:
        x = torch.randn(1, length, 32)
        with torch.no_grad():
            expected = model(x).numpy()
        for ex in builds:
            (got,) = rr.run(ex, x.numpy())  # torch.export returns a tuple
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=atol)


def test_torch_export_with_a_dynamic_sequence_is_fused_at_two_lengths():
    torch.manual_seed(0)
    model = _NormSoftmax().eval()
    mod = _export_seq(model, 512)
    fuse = rr.FuseCascadedReductions(check_build=False)
    ex, _ = rr.build(fuse(mod), fuse=False)
    report = fuse.report
    assert report.found >= 1 and report.fused == report.found, str(report)
    _matches_torch(model, [ex], (5, 300), atol=1e-5)


class _PositionTable(torch.nn.Module):
    """BERT's embeddings in small: a (64, 32) position table sliced to the sequence length
    and added to the input, then LayerNorm and a softmax of it; exported with seq <= 64, the
    slice has min(seq, 64) rows in Relax, so every shape after it has only a rank."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(64, 32) * 0.1)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        h = x + self.table[: x.shape[1]]
        return self.norm(h) + torch.softmax(h * 2.0, dim=-1)


def test_bounded_slice_is_exact_and_the_cascades_after_it_fuse():
    torch.manual_seed(1)
    model = _PositionTable().eval()
    mod = _export_seq(model, 64)
    assert "T.min" in mod["main"].script()  # the slice as Relax infers it without bounds
    exact = tightened(mod["main"])
    assert "T.min" not in exact.script() and "ndim=3" not in exact.script()
    fuse = rr.FuseCascadedReductions(check_build=False)
    fused = fuse(mod)
    ops = {op.split()[0] for g in fuse.report.groups if g.fused for op in g.ops}
    assert fuse.report.fused == fuse.report.found and {"layer_norm", "softmax"} <= ops, \
        str(fuse.report)
    # the unfused build too (the pipeline tightens before TVM legalizes a rank-only tensor)
    _matches_torch(model, [rr.build(m, fuse=False)[0] for m in (fused, mod)], (5, 64),
                   atol=1e-6)


def test_slice_the_bounds_do_not_keep_in_range_is_left_as_it_is():
    """L <= 100 over a table of 64 rows: long inputs are clipped (the shape stays
    min(L, 64)), so the slice is not marked in range; L <= 64 marks it."""
    length = tirx.Var("L", "int64")
    table = relax.const(np.zeros((64, 8), np.float32))
    for upper, clipped in ((100, True), (64, False)):
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((length, 8), "float32"))
        with bb.function("main", [x]):
            with bb.dataflow():
                part = bb.emit(relax.op.strided_slice(table, [0], [0], [length]))
                y = bb.emit_output(relax.op.add(x, part))
            bb.emit_func_output(y)
        func = bb.get()["main"].with_attrs({"tir_var_lower_bound": {"L": 1},
                                            "tir_var_upper_bound": {"L": upper}})
        assert ("T.min" in tightened(func).script()) == clipped, upper


# -- CUDA: one build for every length (compile-checked here; run by ``make gpu-check``) ----

@pytest.mark.parametrize("name", ["softmax", "attention", "moe_routing", "threshold_mass"])
def test_cuda_dynamic_kernel_is_one_build_and_compiles_for_sm90(name):
    kernel = redfuser.compile(name, target="cuda", dynamic=True)
    for rows, n in (((3,), 50), ((7,), 300)):
        kernel.prepare(**example_inputs(name, n=n, rows=rows, d=16))
    assert kernel.builds == 1 and kernel.plan.dynamic and "any" in kernel.plan.reason
    src = kernel.cuda_source()
    assert "blockIdx.x" in src and "threadIdx.x" in src
    assert b".target sm_90" in nvcc_compile(src, arch="sm_90")
    assert nvcc_compile(src, arch="sm_90", fmt="cubin")[:4] == b"\x7fELF"  # ptxas: it fits


def test_relax_symbolic_length_with_a_cuda_target_in_scope_is_fused_for_the_gpu():
    """A module exported with a symbolic sequence length, with a CUDA target in scope: its
    cascades become CUDA kernels for every length and the module compiles for sm_90 (the
    CUDA backend used to skip symbolic functions)."""
    torch.manual_seed(0)
    mod = _export_seq(_NormSoftmax().eval(), 512)
    with tvm.target.Target(cuda_target()):
        fused, report = fuse_module(mod)
    assert report.found >= 1 and report.fused == report.found, str(report)
    for group in report.groups:
        assert "dynamic shapes" in group.reason and "one block per row" in group.reason
        assert "threadIdx.x" in fused[group.kernel].script()
    source = cuda_source(tvm.compile(fused, target=tvm.target.Target(cuda_target())))
    assert all(g.kernel in source for g in report.groups)
    assert b".target sm_90" in nvcc_compile(source, arch="sm_90")


class _NormMatmul(torch.nn.Module):
    """RMSNorm of a (1, seq, 32) input, then a product with 4096 output columns."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 4096))

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) @ self.w


def test_relax_symbolic_cuda_cascade_with_a_state_too_wide_is_skipped_with_its_reason():
    """A symbolic-length CUDA kernel keeps a row's state per thread (the tiled GEMM needs
    static shapes): 4096 output columns do not fit a block's shared memory, so the pass
    leaves the cascade in Relax and says why, instead of handing ptxas a kernel it refuses."""
    seq = torch.export.Dim("seq", min=2, max=512)
    mod = import_torch(_NormMatmul().eval(), (torch.randn(1, 8, 32),),
                       dynamic_shapes={"x": {1: seq}})
    with tvm.target.Target(cuda_target()):
        _, report = fuse_module(mod)
    assert report.found == 1 and report.fused == 0, str(report)
    assert "48 KB of shared memory" in str(report) and "4096 words" in str(report)


def test_an_empty_stream_gives_no_index_not_a_cast_of_minus_inf():
    """A call refuses argmax of N = 0; a Relax module with a symbolic N calls the kernel
    directly, which stored int64(-inf) (undefined in C, INT64_MIN here) and printed a
    "Casting in BufferStore may lose precision" warning at every build.  It now stores the
    "no index" sentinel; the values are the identities."""
    from algebra.state import INDEX_SENTINEL
    from redfuser.lowering import FUNC_NAME
    from redfuser.tvm.runtime import from_numpy

    kernel = redfuser.compile("m = max(x[i]); j = argmax(x[i])", dynamic=True)
    kernel(x=np.ones((2, 5), np.float32))
    m, j = np.full(2, 7.0, np.float32), np.zeros(2, np.int64)
    x = from_numpy(np.ones((2, 0), np.float32))
    kernel._last.executable[FUNC_NAME](x, from_numpy(m), from_numpy(j))
    assert np.all(m == -np.inf) and np.all(j == INDEX_SENTINEL)
