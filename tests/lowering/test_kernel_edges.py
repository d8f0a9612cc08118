"""Kernels that must never return a silently wrong result: NaN through elementwise max/min and
through every selection, selections and anchors per feature, a score computed once for its
max and its exp terms, arg-selections in NaN and inf rows, torch views with lazy bits.  Each
test names the reliability repro it turns into a regression test.

Tolerance: float32 kernels vs the float64 reference, rtol 2e-5 / atol 1e-5 on unit-scale data
(float32 sums of at most a few hundred terms, the polynomial exp's 1-ulp error); NaN, +inf
and -inf must sit exactly where the reference has them, and indices must be equal.
"""

import numpy as np
import pytest
import torch
from tvm import te, topi

import redfuser
from algebra.library import example_inputs
from redfuser.lowering.cpu.plan import LANES
from redfuser.lowering.cpu.tiles import FEATURE_CHUNKS
from redfuser.relax import fuse_module
from redfuser.tensorir.rewrite import run_cpu
from redfuser.tvm.graph import relax
from tests.support import KERNEL_TOL, VARIANTS, assert_indices_equal, assert_matches

RTOL, ATOL = KERNEL_TOL, 1e-5
rng = np.random.default_rng(7)


def check(spec: str, inputs: dict, variant: str, kernel=None, **options):
    """The kernel's outputs (``kernel``: one compiled before, reused) against the oracle."""
    kernel = kernel or redfuser.compile(spec, variant=variant, tune=False, **options)
    out = kernel(**inputs)
    ref = redfuser.reference(spec, inputs)
    assert list(out) == list(ref)
    for name, r in ref.items():
        if r.dtype.kind in "iu":
            assert_indices_equal(out[name], r, f"{spec!r} [{variant}] {name}")
        else:
            assert_matches(out[name], r, RTOL, ATOL, f"{spec!r} [{variant}] {name}")
    return out


ELEMENTWISE = ("s = sum(relu(x[i])); m = max(maximum(x[i], 0)); u = sum(minimum(x[i], 0)); "
               "p = sum(maximum(x[i], y[i])); q = sum(minimum(y[i], x[i])); w = max(x[i])")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("spec", [ELEMENTWISE, "m = min(x[i]); d = sum(exp(m - x[i]))"])
def test_elementwise_max_min_and_selections_propagate_nan(spec, variant):
    """Repro kernel_relu_nan.py: relu, maximum and minimum kept NaN in evaluate and the
    reference but not in the kernel (LLVM's float max drops it).  NaN on either side, in the
    lanes, the tiles and the tail of rows of 77 and 300 elements; rows without NaN unchanged."""
    for n in (77, 300):
        x = rng.normal(size=(6, n)).astype(np.float32)
        y = rng.normal(size=(6, n)).astype(np.float32)
        x[0, 1], x[1, n - 1], x[2, n // 2], x[3, :] = np.nan, np.nan, np.nan, np.nan
        y[4, 3] = np.nan
        inputs = {"x": x, "y": y} if "y[i]" in spec else {"x": x}
        check(spec, inputs, variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_feature_axis_selections_are_per_feature(variant):
    """Repro kernel_feature_max.py: max(v[i, :]) took one max over all N x D elements and
    broadcast it.  Features offset by +100 and -100 make a shared max underflow the sums; the
    anchored sum and a min must be per feature too (an arg-selection over a feature vector
    is a SpecError)."""
    v = rng.normal(size=(3, 40, 4)).astype(np.float32)
    v[..., 0] += 100
    v[..., 1] -= 100
    v[0, 5, 2] = np.nan
    spec = "m = max(v[i, :]); d = sum(exp(v[i, :] - m)); w = min(v[i, :])"
    out = check(spec, {"v": v}, variant)
    assert out["m"].shape == (3, 4) and np.isnan(out["m"][0, 2]) and not np.isnan(out["m"][1]).any()


def test_tensorir_softmax_over_a_middle_axis_is_per_feature():
    """Repro tir_softmax_axis1_nan.py: fuse() of a softmax over axis 1 shared one max across
    the feature axis, so features whose logits sit ~100 below another's gave 0/0 = NaN."""
    shape = (2, 16, 4)
    x = te.placeholder(shape, "float32", name="x")
    func = te.create_prim_func([x, topi.nn.softmax(x, axis=1)])
    fused = redfuser.fuse(func)
    a = rng.normal(size=shape).astype(np.float32)
    a[..., 0] += 100.0
    a[..., 1] -= 100.0
    zeros = np.zeros(shape, np.float32)
    before, after = run_cpu(func, [a, zeros]), run_cpu(fused, [a, zeros])
    assert not np.isnan(after[1]).any()
    e = np.exp(a.astype(np.float64) - a.max(axis=1, keepdims=True))
    np.testing.assert_allclose(after[1], e / e.sum(axis=1, keepdims=True), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(after[1], before[1], rtol=RTOL, atol=ATOL)


# (cascade, variant, rows, n): tiles and a tail in every variant, the masked tiles of causal
# attention, and blocks of rows (9 queries sharing K/V of 520 x 16: blocks of 8 and a last one)
ATTENTION_CASES = [("attention", "rolling", (2, 3), 200), ("attention", "rolling", (1, 9), 520),
                   ("attention", "split", (2, 3), 200), ("attention", "unfused", (2, 3), 200),
                   ("causal_attention", "rolling", (2, 3), 77),
                   ("causal_attention", "unfused", (2, 3), 77)]


@pytest.mark.parametrize(("name", "variant", "rows", "n"), ATTENTION_CASES)
def test_large_logits_see_one_score_for_the_max_and_the_exp(name, variant, rows, n):
    """Repro attention_large_logits.py: the running max and the exp(s - m) terms used
    differently rounded scores (a product rounded for the max, fused into an FMA for the exp),
    so at scale 1e6 d drifted from 1 and at 1e20 o was NaN.  d = 1 exactly for a one-hot
    softmax, o = the winning value row."""
    inputs = example_inputs(name, n=n, rows=rows, d=16, seed=3)
    if name == "causal_attention":
        inputs["pos"] = np.full(rows[-1:], n // 2, np.float32).reshape(1, -1)
    kernel = redfuser.compile(name, variant=variant, tune=False, threads=1)  # one build
    for scale in (1e3, 1e6, 1e20):
        out = check(name, {**inputs, "scale": scale}, variant, kernel)
        if scale > 1e3:
            np.testing.assert_array_equal(out["d"], 1.0)
    if rows == (1, 9):
        assert kernel.plan.row_block > 1


def test_scores_are_fenced_on_both_targets():
    """The score of attention is computed through the target's no-contraction form: an LLVM
    arithmetic fence on the CPU, __fmul_rn on CUDA (nvcc never fuses it into an FMA)."""
    inputs = example_inputs("attention", n=40, rows=(1, 1), d=16)
    cpu = redfuser.compile("attention", tune=False).prepare(**inputs)
    assert "llvm.arithmetic.fence" in cpu.source()
    cuda = redfuser.compile("attention", target="cuda", tune=False).prepare(**inputs)
    assert "__fmul_rn(" in cuda.cuda_source()


def arg_rows(n: int = 64) -> np.ndarray:
    x = np.round(rng.normal(size=(7, n))).astype(np.float32)  # ties
    x[0, 10] = np.nan
    x[1, 3] = np.inf
    x[2] = -np.inf
    x[3, 5] = -np.inf
    x[4, [7, 9]] = np.inf
    x[5] = np.nan
    return x


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("spec", ["moe_routing", "m = max(x[i]); e = argmax(x[i] - m)",
                                  "m = min(x[i]); e = argmin(exp(m - x[i]))",
                                  "m = max(x[i]); d = sum(exp(x[i] - m)); "
                                  "e = argtopk(exp(x[i] - m) / d, 3)"])
def test_arg_selections_of_anchored_bodies_follow_the_reference_in_nan_and_inf_rows(spec,
                                                                                   variant):
    """Repro nan_semantics.py (arg part): at a NaN or infinite anchor exp(x - m) / d is NaN
    (or flat) for every x, so the reference's argtopk is 0..k-1; the fused rule ranked x and
    returned the NaN's index first.  evaluate (any chunking) and every kernel variant."""
    x = arg_rows()
    ref = redfuser.reference(spec, {"x": x})
    for chunks in (None, [20, 44], [1] * 64):
        got = redfuser.derive(spec).evaluate({"x": x}, chunks=chunks)
        assert_indices_equal(got["e"], ref["e"], f"evaluate {chunks}")
    check(spec, {"x": x}, variant, **({"splits": 3} if variant == "split" else {}))


def negative_view() -> torch.Tensor:
    z = torch.complex(torch.zeros(2, 6), torch.arange(12, dtype=torch.float32).reshape(2, 6))
    x = z.conj().imag  # -imag, kept as a view with the negative bit: memory holds +imag
    assert x.is_neg()
    return x


def test_torch_views_with_the_negative_bit_are_read_with_their_sign():
    """Repro torch_neg_view.py: kernel, evaluate and reference read x.conj().imag through
    DLPack without its negative bit, i.e. as -x."""
    x = negative_view()
    plain = x.resolve_neg().clone()
    expected = redfuser.reference("softmax", {"x": plain.numpy()})
    for got in (redfuser.compile("softmax", tune=False)(x=x),
                redfuser.derive("softmax").evaluate({"x": x}),
                redfuser.reference("softmax", {"x": x})):
        np.testing.assert_allclose(np.asarray(got["m"]), expected["m"], rtol=RTOL)
        np.testing.assert_allclose(np.asarray(got["y"]), expected["y"], rtol=RTOL, atol=ATOL)


def test_out_views_with_lazy_bits_are_refused():
    """A kernel writes memory; a view with torch's negative bit would read it negated."""
    kernel = redfuser.compile("softmax", tune=False)
    x = torch.ones(2, 6)
    with pytest.raises(ValueError, match=r"out\['m'\] is a view with its neg bit set"):
        kernel(x=x, out={"m": negative_view()[:, 0]})


def _unlifted_module():
    """group_norm, instance_norm, batch_norm in training, attention and softmax: every
    reduction the pass meets."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4, 6, 6), "float32"))
    q = relax.Var("q", relax.TensorType((1, 8, 2, 16), "float32"))
    ones, zeros = (relax.const(np.full(4, c, "float32")) for c in (1, 0))
    with bb.function("main", [x, q]):
        with bb.dataflow():
            g = bb.emit(relax.op.nn.group_norm(x, ones, zeros, num_groups=2, channel_axis=1,
                                               axes=[2, 3]))
            n = bb.emit(relax.op.nn.instance_norm(x, ones, zeros, channel_axis=1, axes=[2, 3]))
            b = bb.emit(relax.op.nn.batch_norm(x, ones, zeros, zeros, ones, axis=1,
                                               training=True))
            a = bb.emit(relax.op.nn.attention(q, q, q))
            s = bb.emit(relax.op.nn.softmax(x))
            out = bb.emit_output(relax.Tuple([g, n, relax.TupleGetItem(b, 0), a, s]))
        bb.emit_func_output(out)
    return bb.get()


def test_relax_report_names_every_reduction_it_meets():
    """Item 7 of the reliability findings: group_norm, instance_norm, batch_norm in training
    and R.nn.attention were left out of the report silently; each now appears (and all five
    are fused)."""
    fused, report = fuse_module(_unlifted_module())
    kinds = {g.ops[0].split()[0]: g for g in report.groups}
    assert set(kinds) == {"group_norm", "instance_norm", "batch_norm", "attention", "softmax"}
    assert report.fused == 5 and "batch_norm" in str(report)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_per_element_output_may_read_a_dot_product(variant):
    """y[i] = dot(a, w[i, :]) * r: each element's dot over D (rmsnorm_gemm's dx reads
    dot(dy, w[i, :])); this crashed the lowering with an AttributeError."""
    spec = "r = sum(x[i])\ny[i] = dot(a, w[i, :]) * r + x[i]"
    g = np.random.default_rng(0)
    inputs = {"x": g.normal(size=(3, 37)).astype(np.float32),
              "a": g.normal(size=(3, 5)).astype(np.float32),
              "w": g.normal(size=(37, 5)).astype(np.float32)}
    got = redfuser.compile(spec, variant=variant, tune=False)(**inputs)
    want = redfuser.reference(spec, {k: v.astype(np.float64) for k, v in inputs.items()})
    for name in want:
        assert_matches(got[name], want[name], KERNEL_TOL, KERNEL_TOL, name)


@pytest.mark.parametrize("name", ["linear_cross_entropy", "attention"])
def test_dots_along_the_feature_axis_match_the_oracle(name):
    """At D >= FEATURE_CHUNKS vectors the tile's dot products run along the features (rows x
    group register sums, then a horizontal tree): blocks of rows with a tail block, tiles
    with a tail, against the float64 oracle."""
    d = FEATURE_CHUNKS * LANES
    inputs = example_inputs(name, n=301, rows=(37,) if name != "attention" else (2, 19), d=d)
    kernel = redfuser.compile(name, tune=False)
    got = kernel(**inputs)
    assert "blocks of" in str(kernel.plan)
    want = redfuser.reference(name, {k: np.asarray(v, np.float64) for k, v in inputs.items()})
    for out in want:
        assert_matches(got[out], want[out], KERNEL_TOL, KERNEL_TOL, out)


MAP_SPEC = "dx[i] = dl * (exp(x[i] - m) / d - t[i])"  # cross-entropy's dx: no reduction


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [0, 1, 9])
def test_a_spec_of_per_element_lines_only_is_a_map_kernel(variant, n):
    rule = redfuser.derive(MAP_SPEC)
    assert "per element (one pass: a map, no reduction)" in str(rule)
    x = rng.normal(size=(3, n)).astype(np.float32)
    if n > 1:
        x[1, 0], x[2, 1] = -np.inf, np.nan  # exp(-inf) = 0 and NaN stay where they are
    inputs = {"x": x, "t": rng.normal(size=(3, n)).astype(np.float32),
              "dl": rng.normal(size=3).astype(np.float32),
              "m": np.abs(rng.normal(size=3)).astype(np.float32),
              "d": (1 + rng.random(3)).astype(np.float32)}
    check(MAP_SPEC, inputs, variant)


def test_a_map_that_reads_no_stream_asks_for_its_length():
    kernel, a = redfuser.compile("y[i] = a * 2 + i", tune=False), np.ones(2, np.float32)
    with pytest.raises(ValueError, match="streams only the index i: pass N="):
        kernel(a=a)
    np.testing.assert_array_equal(kernel(a=a, N=3)["y"], [[2, 3, 4], [2, 3, 4]])
