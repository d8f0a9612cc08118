"""Kernels generated from every rule, every variant, checked against the float64 oracle.

Tolerance: float32 kernels vs the float64 multi-pass reference, rtol 2e-5 / atol 1e-6
relative to unit-scale data (float32 rounding of sums over N <= a few hundred elements,
plus the polynomial exp's 1-ulp error); NaN must appear exactly where the reference has it.
"""

import numpy as np
import pytest

import redfuser
from redfuser.lowering import backend, shape_geometry
from redfuser.lowering.cpu.plan import PARALLEL_MIN_WORK
from redfuser.tools.bench import workloads
from redfuser.tvm.cuda import nvcc_compile
from redfuser.tvm.ir import structural_equal
from tests.support import VARIANTS, kernel_variants, needs_nvcc

rng = np.random.default_rng(0)


def library_inputs(name: str, n: int = 77, rows=(5,)) -> dict:
    """Inputs for each library cascade, with -inf heads, all -inf rows and ties in x."""
    x = rng.normal(size=(*rows, n)).astype(np.float32) * 3
    if name in ("softmax", "logsumexp", "log_softmax", "moe_routing", "greedy_token",
                "softmax_entropy", "cross_entropy"):
        x[0, :5] = -np.inf  # a stream starting with -inf
        x[1, :] = -np.inf  # a row of all -inf: the reference gives NaN
        x[2, ::7] = x[2, 0]  # ties
    extra = {
        "layernorm": dict(g=rng.normal(size=(*rows, n)).astype(np.float32),
                          b=rng.normal(size=(*rows, n)).astype(np.float32), eps=1e-5),
        "rmsnorm": dict(g=rng.normal(size=(n,)).astype(np.float32), eps=1e-5),
        "rmsnorm_gemm": dict(w=rng.normal(size=(n, 6)).astype(np.float32), eps=1e-5),
        "cross_entropy": dict(t=np.eye(n, dtype=np.float32)[rng.integers(0, n, rows)]),
        "softmax_entropy": dict(T=0.7),
        "softmin_average": dict(v=rng.normal(size=(*rows, n, 4)).astype(np.float32)),
        "relu_sum": dict(t=1.0),
        "threshold_mass": dict(t=0.5 / n),
    }
    if name == "linear_cross_entropy":  # a tie at the label's logit, a label no row has
        w = rng.normal(size=(n, 8)).astype(np.float32)
        w[3] = w[0]
        return dict(h=rng.normal(size=(*rows, 8)).astype(np.float32), w=w,
                    label=np.array([0, 3, n - 1, -1, 5][:rows[0]], np.float32))
    if name == "attention":
        return dict(q=rng.normal(size=(2, 3, 8)).astype(np.float32),
                    k=rng.normal(size=(2, 1, n, 8)).astype(np.float32),
                    v=rng.normal(size=(2, 1, n, 8)).astype(np.float32), scale=0.35)
    if name == "causal_attention":  # a fully masked query (pos -1); NaN/inf in masked keys
        out = library_inputs("attention", n, rows)
        out["k"][..., 6:, 0], out["v"][..., 6:, 1] = np.nan, np.inf
        return {**out, "pos": np.array([[-1, 1, 5]], np.float32)}
    return {"x": x, **extra.get(name, {})}


def assert_matches(out: dict, ref: dict):
    assert list(out) == list(ref)
    for k in ref:
        a, b = out[k].astype(np.float64), ref[k]
        assert a.shape == b.shape, k
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"{k}: NaN where the reference has none"
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-5, equal_nan=True, err_msg=k)


@pytest.mark.parametrize("name, variant", [(name, v) for name in redfuser.LIBRARY
                                           for v in kernel_variants(name)])
def test_library_kernels_match_the_oracle(name, variant):
    inputs = library_inputs(name)
    kernel = redfuser.compile(name, variant=variant)
    assert_matches(kernel(**inputs), redfuser.reference(name, inputs))
    assert kernel.plan.variant == variant


@pytest.mark.parametrize("n", [1, 2, 33, 300])
def test_stream_lengths_lanes_tiles_and_tails(n):
    """N = 1, a tail shorter than the lanes, and several full 16 x 8 tiles plus a tail."""
    x = rng.normal(size=(3, n)).astype(np.float32)
    for name in ("softmax", "variance", "greedy_token"):
        assert_matches(redfuser.compile(name)(x=x), redfuser.reference(name, {"x": x}))


def test_variance_with_offset_stays_accurate_in_float32():
    x = (1e4 + rng.normal(size=(4, 2000))).astype(np.float32)
    ref = redfuser.reference("variance", {"x": x})["var"]
    out = redfuser.compile("variance")(x=x)["var"]
    assert np.max(np.abs(out - ref) / ref) < 1e-3


def test_the_plan_picks_split_for_few_long_rows():
    kernel = redfuser.compile("softmax")
    x = rng.normal(size=(1, 2 * PARALLEL_MIN_WORK)).astype(np.float32)
    assert_matches(kernel(x=x), redfuser.reference("softmax", {"x": x}))
    assert kernel.plan.variant == "split" and kernel.plan.splits > 1
    kernel(x=rng.normal(size=(64, 1000)).astype(np.float32))
    assert kernel.plan.variant == "rolling"
    assert "rows in parallel" in kernel.plan.reason


@pytest.mark.parametrize("shape", [(1, 256), (1, 20000), (16, 1024)])
def test_work_too_small_to_share_runs_on_one_thread(shape):
    """A parallel launch costs more than such a kernel (PARALLEL_MIN_WORK): no split, no
    parallel loop, the same values."""
    kernel = redfuser.compile("softmax")
    x = rng.normal(size=shape).astype(np.float32)
    assert_matches(kernel(x=x), redfuser.reference("softmax", {"x": x}))
    assert kernel.plan.variant == "rolling" and "one thread" in kernel.plan.reason
    assert "T.parallel" not in kernel.source()


@pytest.mark.parametrize("name, inputs", [
    ("attention", dict(q=rng.normal(size=(2, 21, 128)).astype(np.float32),  # 42 rows: 6 blocks
                       k=rng.normal(size=(2, 1, 77, 128)).astype(np.float32),
                       v=rng.normal(size=(2, 1, 77, 128)).astype(np.float32), scale=0.1)),
])
@pytest.mark.parametrize("variant", [None, "unfused"])
def test_rows_sharing_a_stream_fold_in_blocks(name, inputs, variant):
    """Rows sharing K/V larger than L1 fold together; a last partial block repeats its last
    row; tiles of 16 plus a tail.  The unfused baseline gets the same blocks.  (Rows sharing
    a GEMM's weights run a GEMM micro-kernel instead: tests/lowering/test_gemm.py.)"""
    kernel = redfuser.compile(name, threads=2, variant=variant)
    assert_matches(kernel(**inputs), redfuser.reference(name, inputs))
    assert kernel.plan.row_block > 1 and "blocks of" in str(kernel.plan)


def test_unfused_has_one_loop_nest_per_reduction_and_fused_one():
    x = np.zeros((4, PARALLEL_MIN_WORK // 4), np.float32)  # enough work for parallel nests
    fused, unfused = (redfuser.compile("softmax", variant=v) for v in ("rolling", "unfused"))
    fused(x=x)
    unfused(x=x)
    def nests(kernel):
        return kernel.source().count("T.parallel(")

    assert nests(fused) == 1 and nests(unfused) == 3  # max, sum, then the epilogue/output nest


def test_lowering_is_deterministic_structurally():
    inputs = library_inputs("attention", n=64)
    a, b = (redfuser.compile("attention").prepare(**inputs) for _ in range(2))
    assert structural_equal(a.primfunc, b.primfunc)
    other = redfuser.compile("attention", variant="split").prepare(**inputs)
    assert not structural_equal(a.primfunc, other.primfunc)


def test_kv_shared_across_queries_is_not_copied():
    inputs = library_inputs("attention", n=40)
    kernel = redfuser.compile("attention")
    kernel(**inputs)
    src = kernel.source()
    # the arguments as the caller passes them, the body reading flattened views of them
    assert src.count('T.Buffer((2, 1, 40, 8), "float32"') == 2
    assert src.count(".view(2, 40, 8)") == 2  # k and v: H rows, not H * L
    assert ".view(6, 1, 8)" in src  # q: H * L rows


def test_torch_dlpack_inputs():
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 50)
    out = redfuser.compile("softmax")(x=x)
    np.testing.assert_allclose(out["y"], torch.softmax(x, -1).numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("inputs", "error", "words"), [
    ({"x": np.ones((2, 8), np.int32)}, TypeError, "input 'x' has dtype int32"),
    ({}, ValueError, "missing input(s) ['x']"),
    ({"x": np.ones((2, 8), np.float32), "y": 1.0}, ValueError, "unexpected input(s) ['y']"),
    ({"x": "text"}, TypeError, "input 'x' must be a number or an array"),
])
def test_bad_inputs_are_named(inputs, error, words):
    with pytest.raises(error) as err:
        redfuser.compile("softmax")(**inputs)
    assert words in str(err.value)


def test_bad_variant_is_named():
    with pytest.raises(ValueError, match="variant must be one of"):
        redfuser.compile("softmax", variant="fast")(x=np.ones((1, 4), np.float32))


def test_unproven_rules_never_reach_the_compiler():
    with pytest.raises(redfuser.NotFusable):
        redfuser.compile("m = max(x[i]); r = sum(relu(x[i] - m))")


CUDA_CASES = ["softmax", "attention", "variance", "moe_routing", "softmax_moments"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", CUDA_CASES)
def test_cuda_source_is_generated(name, variant):
    kernel = redfuser.compile(name, target="cuda", variant=variant)
    kernel.prepare(**library_inputs(name, n=300))
    src = kernel.cuda_source()
    assert "__global__" in src and "blockIdx.x" in src and "__syncthreads" in src


@needs_nvcc
@pytest.mark.parametrize("name", CUDA_CASES)
def test_cuda_source_compiles_with_nvcc_for_sm90(name):
    kernel = redfuser.compile(name, target="cuda")
    kernel.prepare(**library_inputs(name, n=300))
    source = kernel.cuda_source()
    assert b".target sm_90" in nvcc_compile(source, arch="sm_90")
    assert nvcc_compile(source, arch="sm_90", fmt="cubin")[:4] == b"\x7fELF"  # ptxas: fits


@needs_nvcc
@pytest.mark.parametrize("workload", range(len(workloads(None))))
def test_bench_shape_cuda_kernels_fit_the_gpu(workload):
    """Every kernel `make gpu-check` times, fused and unfused, at the bench's shapes, goes
    through ptxas (PTX alone is not checked against the GPU's limits): RMSNorm + GEMM's
    4096-wide state once asked for 512 KB of shared memory a block."""
    w = workloads(None)[workload]
    inputs = w.make(np.random.default_rng(0), 1.0)
    for variant in (None, "unfused"):
        kernel = redfuser.compile(w.spec, target="cuda", variant=variant)
        kernel.prepare(**inputs)
        cubin = nvcc_compile(kernel.cuda_source(), arch="sm_90", fmt="cubin")
        assert cubin[:4] == b"\x7fELF", (w.name, variant)


def test_cuda_matrix_product_runs_as_a_tiled_gemm_and_a_wide_state_is_refused():
    rule = redfuser.derive("rmsnorm_gemm")
    geo = shape_geometry(rule, {"x": (256, 4096), "w": (4096, 4096)})
    for variant in (None, "unfused"):
        plan = backend("cuda").choose(rule, geo, variant=variant)
        assert plan.mr and plan.variant == (variant or "rolling")
    with pytest.raises(ValueError, match="4096 words|widest: 'y'"):
        backend("cuda").choose(rule, geo, variant="split")  # the per-row tree of 4096 sums
    small = shape_geometry(rule, {"x": (8, 300), "w": (300, 64)})
    assert backend("cuda").choose(rule, small, variant="split").variant == "split"


@pytest.mark.parametrize("name", ["attention", "rmsnorm_gemm"])
def test_feature_axis_wide_enough_to_vectorize(name):
    d = 32
    if name == "attention":
        inputs = dict(q=rng.normal(size=(2, 2, d)).astype(np.float32),
                      k=rng.normal(size=(2, 1, 50, d)).astype(np.float32),
                      v=rng.normal(size=(2, 1, 50, d)).astype(np.float32), scale=0.2)
    else:
        inputs = dict(x=rng.normal(size=(3, 50)).astype(np.float32),
                      w=rng.normal(size=(50, d)).astype(np.float32), eps=1e-5)
    kernel = redfuser.compile(name)
    assert_matches(kernel(**inputs), redfuser.reference(name, inputs))
    assert "T.vectorized(16)" in kernel.source()
