"""Property tests: the fused one-pass rule (``evaluate``, float32, any chunking and merge tree)
against the float64 multi-pass oracle (``reference``), plus unit tests of the edge cases.

Tolerances (float32 eps = 1.19e-7; N <= 12):

* ``max``/``min``/``topk`` values select one float32 input, so ``m`` is compared exactly.
* ``RTOL = 1e-4`` (~840 ulps) for sums of positive terms and their ratios: each element costs a
  few float32 roundings, and exp() turns an absolute error of its argument (at most
  |x - m| * eps/2 while exp has not underflowed, i.e. |x - m| < ~90) into a relative one, so
  the expected error is ~1e-6 and RTOL leaves two orders of magnitude of head room.
* Absolute tolerances are always taken relative to the scale of the data the output is
  computed from (for example ``1e-5 * (1 + max|x|)`` for ``x - lse``), because float32
  cancellation errors are relative to that scale, not to the (possibly tiny) result.
* Every comparison also allows float32's smallest normal number (1.2e-38, ``TINY32`` in
  conftest) absolutely: below it float32 keeps no relative accuracy at all.
* NaN and +-inf must sit exactly where the reference has them (``assert_matches``).
* Index outputs are compared exactly, on values drawn from a 0.25 grid (or a set of four
  values) so that float32 and float64 order the elements the same way.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import redfuser
from tests.support import (
    EPS32,
    F32,
    assert_indices_equal,
    assert_matches,
    examples,
    finite_max_abs,
    float32_streams,
    row_shapes,
    rule_for,
    schedules,
    stream_lengths,
    streamed_case,
)

RTOL = 1e-4
MOE_K2 = ("m = max(x[i]); d = sum(exp(x[i] - m)); p = topk(exp(x[i] - m) / d, 2); "
          "e = argtopk(exp(x[i] - m) / d, 2)")
NEG_INF = -np.inf


def run_both(spec: str, inputs: dict, chunks=None, tree=None):
    """(fused, reference) outputs; checks names, shapes and the float32 working dtype."""
    rule = rule_for(spec)
    fused = rule.evaluate(inputs, chunks=chunks, tree=tree)
    ref = redfuser.reference(spec, inputs)
    assert list(fused) == list(ref) == list(rule.outputs)
    dtype = np.result_type(*[v.dtype for v in inputs.values()
                             if isinstance(v, np.ndarray) and v.ndim])
    for name in fused:
        assert fused[name].shape == ref[name].shape, name
        if ref[name].dtype.kind == "f":
            assert fused[name].dtype == dtype, f"{name} computed in {fused[name].dtype}"
    return fused, ref


def _lse_atol(ref_m):
    """lse = log(d) + m rounds at the scale of |m|."""
    m = np.abs(np.asarray(ref_m, np.float64))
    return 1e-5 * (1.0 + np.where(np.isfinite(m), m, 0.0))


# -- softmax family ----------------------------------------------------------------------------

@given(streamed_case(inject=NEG_INF))
def test_softmax_statistics(case):
    x, chunks, tree = case
    fused, ref = run_both("softmax", {"x": x}, chunks, tree)
    assert_matches(fused["m"], ref["m"], 0, 0, "m")
    assert_matches(fused["d"], ref["d"], RTOL, 0, "d")  # d in [1, N] where finite
    assert_matches(fused["y"], ref["y"], RTOL, 1e-6, "y")  # y in [0, 1]


@given(streamed_case(inject=NEG_INF))
def test_logsumexp(case):
    x, chunks, tree = case
    fused, ref = run_both("logsumexp", {"x": x}, chunks, tree)
    assert_matches(fused["m"], ref["m"], 0, 0, "m")
    assert_matches(fused["lse"], ref["lse"], RTOL, _lse_atol(ref["m"]), "lse")


@given(streamed_case(inject=NEG_INF))
def test_log_softmax(case):
    x, chunks, tree = case
    fused, ref = run_both("log_softmax", {"x": x}, chunks, tree)
    assert_matches(fused["lse"], ref["lse"], RTOL, _lse_atol(ref["m"]), "lse")
    # y = x - lse cancels: its error is relative to the row's magnitudes.
    atol = 1e-5 * (1.0 + finite_max_abs(x, axis=-1, keepdims=True))
    assert_matches(fused["y"], ref["y"], RTOL, atol, "y")


@given(streamed_case(kinds=("normal", "grid", "ties", "huge")))
def test_softmax_entropy(case):
    x, chunks, tree = case
    rows = x.shape[:-1]
    t = np.linspace(0.25, 4.0, int(np.prod(rows)), dtype=F32).reshape(rows) if rows else 0.7
    fused, ref = run_both("softmax_entropy", {"x": x, "T": t}, chunks, tree)
    assert_matches(fused["m"], ref["m"], 0, 0, "m")
    assert_matches(fused["d"], ref["d"], RTOL, 0, "d")
    # every term t*exp(t) (t = (x - m)/T <= 0) is bounded by 1/e, and so is its rounding error
    # times ~|t|: h in [0, log N] has an absolute error of a few N ulps.
    assert_matches(fused["h"], ref["h"], RTOL, 2e-5, "h")


@given(streamed_case(kinds=("normal", "grid", "ties")))
def test_softmax_moments_three_levels(case):
    x, chunks, tree = case
    fused, ref = run_both("softmax_moments", {"x": x}, chunks, tree)
    scale = 1.0 + finite_max_abs(x, axis=-1)  # |mu| <= max|x|, var <= (2 max|x|)**2
    assert_matches(fused["m"], ref["m"], 0, 0, "m")
    assert_matches(fused["d"], ref["d"], RTOL, 0, "d")
    assert_matches(fused["mu"], ref["mu"], RTOL, 1e-5 * scale, "mu")
    assert_matches(fused["var"], ref["var"], RTOL, 1e-5 * scale**2, "var")


@given(st.data())
def test_softmin_average(data):
    rows, n = data.draw(row_shapes()), data.draw(stream_lengths())
    d = data.draw(st.integers(1, 4))
    x = data.draw(float32_streams(rows + (n,), inject=np.inf))  # +inf masks a softmin entry
    v = data.draw(float32_streams(rows + (n, d), kinds=("normal", "grid"), limit=4.0))
    chunks, tree = data.draw(schedules(n))
    fused, ref = run_both("softmin_average", {"x": x, "v": v}, chunks, tree)
    assert_matches(fused["m"], ref["m"], 0, 0, "m")
    assert_matches(fused["d"], ref["d"], RTOL, 0, "d")
    # y is a convex combination of the rows of v
    assert_matches(fused["y"], ref["y"], RTOL, 1e-5 * (1.0 + finite_max_abs(v)), "y")


# -- attention ---------------------------------------------------------------------------------

@st.composite
def attention_cases(draw, several_queries: bool):
    h, d, n = draw(st.integers(1, 3)), draw(st.integers(2, 4)), draw(stream_lengths(1, 10))
    if several_queries:  # q (H, L, D); k, v (H, 1, N, D) broadcast over the L queries
        q_shape, kv_shape = (h, draw(st.integers(2, 4)), d), (h, 1, n, d)
    else:  # one query per head: q (H, D); k, v (H, N, D)
        q_shape, kv_shape = (h, d), (h, n, d)
    q, k, v = (draw(float32_streams(s, kinds=("normal", "grid"), limit=2.0))
               for s in (q_shape, kv_shape, kv_shape))
    scale = draw(st.sampled_from([float(1 / np.sqrt(d)), 0.5, 1.0]))
    return {"q": q, "k": k, "v": v, "scale": scale}, draw(schedules(n))


def _check_attention(inputs, chunks, tree, out_shape):
    fused, ref = run_both("attention", inputs, chunks, tree)
    d = inputs["q"].shape[-1]
    assert fused["o"].shape == out_shape
    # s = scale * dot(q, k) is rounded in float32 with an absolute error <= D eps S, where S
    # bounds |s|; exp() turns it into a relative error of the weights.
    s_bound = inputs["scale"] * d * finite_max_abs(inputs["q"]) * finite_max_abs(inputs["k"])
    weight_rtol = RTOL + 8 * d * EPS32 * s_bound
    assert_matches(fused["m"], ref["m"], 0, 8 * d * EPS32 * (1.0 + s_bound), "m")
    assert_matches(fused["d"], ref["d"], weight_rtol, 0, "d")
    assert_matches(fused["o"], ref["o"], weight_rtol,
                   weight_rtol * (1.0 + finite_max_abs(inputs["v"])), "o")


@given(attention_cases(several_queries=False))
def test_attention_single_query(case):
    inputs, (chunks, tree) = case
    _check_attention(inputs, chunks, tree, inputs["q"].shape)


@given(attention_cases(several_queries=True))
def test_attention_several_queries_broadcast_kv(case):
    inputs, (chunks, tree) = case
    _check_attention(inputs, chunks, tree, inputs["q"].shape)


# -- variance, layernorm, rmsnorm + GEMM -------------------------------------------------------

@given(rows=st.integers(4, 8), n=st.integers(2, 12), seed=st.integers(0, 2**32 - 1),
       sched=st.data())
def test_variance_large_common_offset(rows, n, seed, sched):
    """x = 1e4 + noise in float32: the running-mean anchoring keeps var accurate, where the
    one-pass textbook formula mean(x**2) - mean(x)**2 loses every digit."""
    rng = np.random.default_rng(seed)
    noise = rng.uniform(-1.0, 1.0, (rows, n))
    noise[:, :2] = (-1.0, 1.0)  # sum (x - mean)**2 >= 2, so var >= 2/N >= 1/6
    x = (1e4 + rng.permuted(noise, axis=1)).astype(F32)
    chunks, tree = sched.draw(schedules(n))
    fused, ref = run_both("variance", {"x": x}, chunks, tree)
    assert_matches(fused["mean"], ref["mean"], 1e-5, 0, "mean")
    err = np.abs(fused["var"] - ref["var"]) / ref["var"]
    assert err.max() < 1e-3, f"fused var relative error {err.max():.3g}"
    nf = F32(n)
    naive = (x * x).sum(-1, dtype=F32) / nf - (x.sum(-1, dtype=F32) / nf) ** 2
    naive_err = np.abs(naive - ref["var"]) / ref["var"]
    assert naive_err.max() > 1e-2, "the naive formula should fail here: the test is too easy"
    assert naive_err.max() > 100 * err.max()


@given(streamed_case(kinds=("normal", "grid", "ties", "huge"), huge=1e17))  # sum x^2 < 1e36
def test_layernorm(case):
    x, chunks, tree = case
    n = x.shape[-1]
    g = np.linspace(-2.0, 2.0, n, dtype=F32)
    b = np.linspace(1.0, -1.0, n, dtype=F32)
    fused, ref = run_both("layernorm", {"x": x, "g": g, "b": b, "eps": 1e-5}, chunks, tree)
    rows = x.shape[:-1]
    mean, var = (np.reshape(ref[k], rows) for k in ("mean", "var"))  # (*rows,) for the bounds
    xmax = finite_max_abs(x, axis=-1)
    spread = np.max(np.abs(x - mean[..., None]), axis=-1)
    assert_matches(fused["mean"], ref["mean"], RTOL, 1e-5 * xmax, "mean")
    # squares of |x| < ~1e-19 underflow float32: 1e-30 is the floor of what var can resolve
    var_atol = 1e-5 * spread**2 + (1e-5 * xmax) ** 2 + 1e-30
    assert_matches(fused["var"], ref["var"], RTOL, var_atol, "var")
    # (x - mean) / sqrt(var + eps): the rounding of x - mean is relative to max|x|, so the
    # normalised value errs by ~eps * max|x| / sigma.
    sigma = np.sqrt(var + 1e-5)[..., None]
    atol = 1e-5 * (1.0 + xmax[..., None] / sigma) * 2.0 + 1e-6
    assert_matches(fused["y"], ref["y"], RTOL, atol, "y")


@given(st.data())
def test_rmsnorm_gemm(data):
    rows, n = data.draw(row_shapes()), data.draw(stream_lengths())
    d_out = data.draw(st.integers(1, 4))
    x = data.draw(float32_streams(rows + (n,), huge=1e17))  # sum of squares stays < 1e36
    w = data.draw(float32_streams((n, d_out), kinds=("normal", "grid"), limit=2.0))
    chunks, tree = data.draw(schedules(n))
    fused, ref = run_both("rmsnorm_gemm", {"x": x, "w": w, "eps": 1e-6}, chunks, tree)
    assert fused["y"].shape == rows + (d_out,)
    assert_matches(fused["r"], ref["r"], RTOL, 0, "r")
    # y = sum_i x_i w_i / r cancels: scale by sum_i |x_i| |w_i| / r
    r = np.reshape(ref["r"], rows)[..., None]
    scale = (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64))) / r
    assert_matches(fused["y"], ref["y"], RTOL, 1e-5 * (scale + 1e-30), "y")


# -- selections with indices: values on a grid so float32 and float64 order alike -------------

@given(streamed_case(min_n=8, kinds=("grid", "ties"), inject=NEG_INF))
def test_moe_routing_top8(case):
    x, chunks, tree = case
    fused, ref = run_both("moe_routing", {"x": x}, chunks, tree)
    assert fused["p"].shape == fused["e"].shape == x.shape[:-1] + (8,)
    assert_matches(fused["d"], ref["d"], RTOL, 0, "d")
    assert_matches(fused["p"], ref["p"], RTOL, 1e-6, "p")
    assert_indices_equal(fused["e"], ref["e"], "e")


@given(streamed_case(min_n=2, kinds=("grid", "ties"), inject=NEG_INF))
def test_moe_routing_top2_custom(case):
    x, chunks, tree = case
    fused, ref = run_both(MOE_K2, {"x": x}, chunks, tree)
    assert_matches(fused["p"], ref["p"], RTOL, 1e-6, "p")
    assert_indices_equal(fused["e"], ref["e"], "e")
    finite = np.isfinite(fused["p"])
    assert (np.diff(np.where(finite, fused["p"], 0), axis=-1) <= 0).all(), "not descending"


@given(streamed_case(kinds=("grid", "ties"), inject=NEG_INF))
def test_greedy_token(case):
    x, chunks, tree = case
    fused, ref = run_both("greedy_token", {"x": x}, chunks, tree)
    assert_matches(fused["p"], ref["p"], RTOL, 0, "p")
    assert_indices_equal(fused["token"], ref["token"], "token")


# -- every library entry on ordinary inputs ----------------------------------------------------

def library_inputs(name: str, rng: np.random.Generator, rows: tuple, n: int, d: int = 3):
    """Inputs of the documented shapes for a library entry (float32, |values| <= ~3)."""
    def f(*shape):
        return rng.uniform(-3, 3, shape).astype(F32)

    if name == "attention":
        return {"q": f(*rows, d), "k": f(*rows, n, d), "v": f(*rows, n, d), "scale": 0.5}
    if name == "causal_attention":  # pos -1: a fully masked row
        return {"q": f(*rows, d), "k": f(*rows, n, d), "v": f(*rows, n, d), "scale": 0.5,
                "pos": rng.integers(-1, n, rows).astype(F32)}
    if name == "cross_entropy":
        return {"x": f(*rows, n), "t": f(*rows, n)}
    if name == "layernorm":
        return {"x": f(*rows, n), "g": f(n), "b": f(n), "eps": 1e-5}
    if name == "rmsnorm":
        return {"x": f(*rows, n), "g": f(n), "eps": 1e-6}
    if name == "rmsnorm_gemm":
        return {"x": f(*rows, n), "w": f(n, d), "eps": 1e-6}
    if name == "softmax_entropy":
        return {"x": f(*rows, n), "T": 1.5}
    if name == "linear_cross_entropy":  # label -1: a row no class is picked in
        return {"h": f(*rows, d), "w": f(n, d), "label": rng.integers(-1, n, rows).astype(F32)}
    if name == "softmin_average":
        return {"x": f(*rows, n), "v": f(*rows, n, d)}
    if name in ("relu_sum", "threshold_mass"):  # a threshold that selects some elements
        return {"x": f(*rows, n), "t": 1.0 if name == "relu_sum" else 0.5 / max(n, 1)}
    return {"x": f(*rows, n)}


def _loose_compare(fused, ref):
    """Generic check: values within RTOL of the reference, or 1e-4 of the output's own scale
    (every library output here is O(1) to O(N * 9) for |inputs| <= 3); indices exactly."""
    for name in ref:
        if ref[name].dtype.kind in "iu":
            assert_indices_equal(fused[name], ref[name], name)
        else:
            atol = 1e-4 * (1.0 + finite_max_abs(ref[name]))
            assert_matches(fused[name], ref[name], RTOL, atol, name)


@pytest.mark.parametrize("name", sorted(redfuser.LIBRARY))
@settings(max_examples=examples(1 / 3))  # 8 per entry by default
@given(rows=row_shapes(), n=stream_lengths(8, 12), seed=st.integers(0, 2**32 - 1),
       sched=st.data())
def test_library_entry_matches_reference(name, rows, n, seed, sched):
    inputs = library_inputs(name, np.random.default_rng(seed), rows, n)
    chunks, tree = sched.draw(schedules(n))
    fused, ref = run_both(name, inputs, chunks, tree)
    _loose_compare(fused, ref)


# -- unit tests: -inf, N = 1, ties ---------------------------------------------------------------

SCHEDULES_5 = [([5], None), ([1, 4], (1, 0)), ([2, 3], None),
               ([1, 1, 1, 1, 1], ((4, 3), (2, (1, 0)))), ([1, 2, 2], (2, 0, 1))]


@pytest.mark.parametrize("chunks, tree", SCHEDULES_5)
@pytest.mark.parametrize("spec", ["softmax", "logsumexp", "log_softmax", "greedy_token", MOE_K2])
def test_stream_starting_with_neg_inf(spec, chunks, tree):
    x = np.array([[NEG_INF, NEG_INF, 1.0, -2.0, 0.5], [NEG_INF, 3.0, 3.0, NEG_INF, -1.0]], F32)
    fused, ref = run_both(spec, {"x": x}, chunks, tree)
    for name, value in fused.items():
        assert not np.isnan(value).any(), f"{name} has NaN: {value}"
    _loose_compare(fused, ref)
    if "m" in fused:
        np.testing.assert_array_equal(fused["m"], [1.0, 3.0])
    if spec == "softmax":
        np.testing.assert_array_equal(fused["y"][:, 0], 0.0)


@pytest.mark.parametrize("chunks, tree", SCHEDULES_5)
def test_softmax_row_of_all_neg_inf(chunks, tree):
    x = np.array([[NEG_INF] * 5, [0.0, 1.0, NEG_INF, 2.0, 0.5]], F32)
    fused, ref = run_both("softmax", {"x": x}, chunks, tree)
    # the reference's own semantics: -inf - (-inf) = NaN in the all -inf row only
    assert np.isnan(ref["d"]).tolist() == [True, False]
    assert np.isnan(ref["y"]).all(axis=1).tolist() == [True, False]
    assert fused["m"].tolist() == [NEG_INF, 2.0]
    np.testing.assert_array_equal(np.isnan(fused["d"]), np.isnan(ref["d"]))
    np.testing.assert_array_equal(np.isnan(fused["y"]), np.isnan(ref["y"]))
    assert_matches(fused["d"], ref["d"], RTOL, 0, "d")
    assert_matches(fused["y"], ref["y"], RTOL, 1e-6, "y")


# The anchor is the max of *another* stream y: while y has only shown -inf, the running anchor
# is -inf although the bodies are finite at the final anchor.
FOREIGN_ANCHOR = {
    "m = max(y[i]); r = sum(exp(x[i] - m))": 1.1975402595,  # + exp(0.5 - 2): must not be lost
    "m = max(y[i]); r = sum(exp(m - x[i]))": 8.8486921692,
    "m = max(y[i]); r = sum((x[i] - m)**2)": 3.5,  # must not become inf - inf = NaN
}


@pytest.mark.parametrize("chunks, tree", [([3], None), ([1, 2], None), ([1, 2], (1, 0)),
                                          ([1, 1, 1], (2, (1, 0)))])
@pytest.mark.parametrize("spec", sorted(FOREIGN_ANCHOR))
def test_reanchoring_from_a_neg_inf_anchor(spec, chunks, tree):
    """y = [-inf, 1, 2]: the final m = 2 is finite and so is every body at it, so r is the
    plain sum over all three elements, the first included."""
    inputs = {"x": np.array([[0.5, 1.0, 1.5]], F32), "y": np.array([[NEG_INF, 1.0, 2.0]], F32)}
    fused, ref = run_both(spec, inputs, chunks, tree)
    np.testing.assert_allclose(ref["r"], [FOREIGN_ANCHOR[spec]], rtol=1e-8)  # 10-digit constant
    assert_matches(fused["r"], ref["r"], RTOL, 0, "r")


@pytest.mark.parametrize("spec", sorted(FOREIGN_ANCHOR))
@given(data=st.data())
def test_anchor_from_another_stream_with_masked_entries(spec, data):
    rows, n = data.draw(row_shapes()), data.draw(stream_lengths())
    x = data.draw(float32_streams(rows + (n,), kinds=("normal", "grid"), limit=4.0))
    y = data.draw(float32_streams(rows + (n,), kinds=("normal", "grid"), limit=4.0,
                                  inject=NEG_INF))
    chunks, tree = data.draw(schedules(n))
    fused, ref = run_both(spec, {"x": x, "y": y}, chunks, tree)
    assert_matches(fused["m"], ref["m"], 0, 0, "m")
    # sums of positive terms (each at most e^8 or 8^2 here): relative accuracy
    assert_matches(fused["r"], ref["r"], RTOL, 0, "r")


def test_softmax_moments_masked_logit_no_spurious_nan():
    """Masked (-inf) logits: wherever the reference is finite the fused value matches, and the
    fused rule never produces NaN where the reference has none."""
    x = np.array([[NEG_INF, 1.0, 2.0, 0.0], [0.5, 1.0, 2.0, 0.0]], F32)
    fused, ref = run_both("softmax_moments", {"x": x}, [1, 3], (1, 0))
    for name in ref:
        assert not (np.isnan(fused[name]) & ~np.isnan(ref[name])).any(), name
        fin = np.isfinite(ref[name])
        np.testing.assert_allclose(fused[name][fin], ref[name][fin], rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("name", sorted(set(redfuser.LIBRARY) - {"moe_routing"}))
def test_stream_of_length_one(name):
    inputs = library_inputs(name, np.random.default_rng(7), (2,), 1)
    fused, ref = run_both(name, inputs)
    _loose_compare(fused, ref)


def test_topk_larger_than_stream_is_rejected():
    with pytest.raises(ValueError, match="k = 8"):
        rule_for("moe_routing").evaluate({"x": np.zeros((2, 1), F32)})


def test_moe_k2_on_two_elements():
    x = np.array([[0.5, 2.0], [1.0, 1.0]], F32)
    fused, ref = run_both(MOE_K2, {"x": x}, [1, 1], (1, 0))
    assert fused["e"].tolist() == [[1, 0], [0, 1]]
    _loose_compare(fused, ref)


TIE_SCHEDULES = [([6], None), ([1, 1, 1, 1, 1, 1], (5, 4, 3, 2, 1, 0)),
                 ([2, 2, 2], ((2, 1), 0)), ([3, 3], (1, 0)), ([1, 5], (1, 0))]


@pytest.mark.parametrize("chunks, tree", TIE_SCHEDULES)
def test_argmax_ties_take_the_lowest_index(chunks, tree):
    x = np.array([[1.0, 3.0, 0.0, 3.0, 2.0, 3.0],
                  [5.0, 5.0, 5.0, 5.0, 5.0, 5.0],
                  [NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF],
                  [0.0, 0.0, 1.0, 0.0, 1.0, 1.0]], F32)
    fused, ref = run_both("greedy_token", {"x": x}, chunks, tree)
    assert fused["token"].tolist() == [1, 0, 0, 2]
    assert_indices_equal(fused["token"], ref["token"])
    low = rule_for("t = argmin(x[i])").evaluate({"x": -x}, chunks, tree)["t"]
    assert low.tolist() == [1, 0, 0, 2]


@pytest.mark.parametrize("chunks, tree", TIE_SCHEDULES)
def test_argtopk_ties_take_the_lowest_indices_values_descending(chunks, tree):
    x = np.array([[1.0, 3.0, 0.0, 3.0, 2.0, 3.0],
                  [5.0, 5.0, 5.0, 5.0, 5.0, 5.0],
                  [0.0, 0.0, 1.0, 0.0, 1.0, 1.0],
                  [NEG_INF, 2.0, NEG_INF, NEG_INF, 2.0, NEG_INF]], F32)
    spec = "p = topk(x[i], 4); e = argtopk(x[i], 4)"
    fused, ref = run_both(spec, {"x": x}, chunks, tree)
    assert fused["e"].tolist() == [[1, 3, 5, 4], [0, 1, 2, 3], [2, 4, 5, 0], [1, 4, 0, 2]]
    assert fused["p"].tolist() == [[3, 3, 3, 2], [5, 5, 5, 5], [1, 1, 1, 0],
                                   [2, 2, NEG_INF, NEG_INF]]
    assert_indices_equal(fused["e"], ref["e"])
    np.testing.assert_array_equal(fused["p"], ref["p"])
    fused, ref = run_both(MOE_K2, {"x": x}, chunks, tree)
    assert fused["e"].tolist() == [[1, 3], [0, 1], [2, 4], [1, 4]]
    assert_indices_equal(fused["e"], ref["e"])


# -- the library: proofs and derivation time -----------------------------------------------------

@pytest.mark.parametrize("name", sorted(redfuser.LIBRARY))
def test_library_rule_verifies(name):
    rule = redfuser.derive(name)
    assert rule.verify() is True
    assert all(rule.status)


@pytest.mark.parametrize("name", sorted(redfuser.LIBRARY))
def test_library_derivation_is_fast(name):
    start = time.perf_counter()
    redfuser.derive(name)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"deriving {name!r} took {elapsed:.2f} s"


# -- layout: scalar streams whose row axis happens to equal N -------------------------------------

@pytest.mark.parametrize("name, inputs", [
    ("rmsnorm_gemm", {"x": np.ones((3, 3), F32), "w": np.ones((3, 3), F32), "eps": 1e-6}),
    ("softmin_average", {"x": np.ones((2, 2), F32), "v": np.ones((2, 2, 2), F32)}),
])
def test_scalar_stream_with_rows_equal_to_n(name, inputs):
    """x is written x[i], so x of shape (*rows, N) is a scalar stream whatever rows is; rows =
    (N,) with D = N must not be rejected as ambiguous (there is no spelling that says 'scalar
    stream' in the library spec)."""
    fused, ref = run_both(name, inputs)
    _loose_compare(fused, ref)


# -- output shapes: (*rows,) for per-row results, (*rows, D) for feature vectors -----------------

def _ones(*shape):
    return np.ones(shape, F32)


@pytest.mark.parametrize("spec, inputs, expected", [
    ("softmax", {"x": _ones(5)}, {"m": (), "d": (), "y": (5,)}),
    ("variance", {"x": _ones(1)}, {"mean": (), "var": ()}),
    ("moe_routing", {"x": _ones(9)}, {"m": (), "d": (), "p": (8,), "e": (8,)}),
    ("attention", {"q": _ones(3), "k": _ones(4, 3), "v": _ones(4, 3), "scale": 1.0},
     {"m": (), "d": (), "o": (3,)}),
    ("attention", {"q": _ones(2, 1), "k": _ones(2, 4, 1), "v": _ones(2, 4, 1), "scale": 1.0},
     {"m": (2,), "d": (2,), "o": (2, 1)}),
    ("attention", {"q": _ones(2, 3, 1), "k": _ones(2, 1, 4, 1), "v": _ones(2, 1, 4, 1),
                   "scale": 1.0}, {"m": (2, 3), "d": (2, 3), "o": (2, 3, 1)}),
    ("softmin_average", {"x": _ones(2, 4), "v": _ones(2, 4, 1)}, {"m": (2,), "d": (2,),
                                                                 "y": (2, 1)}),
    ("rmsnorm_gemm", {"x": _ones(2, 4), "w": _ones(4, 1), "eps": 1e-6}, {"r": (2,), "y": (2, 1)}),
])
def test_output_shapes_follow_the_convention(spec, inputs, expected):
    fused, ref = run_both(spec, inputs)
    assert {k: v.shape for k, v in fused.items()} == expected
    assert {k: v.shape for k, v in ref.items()} == expected
