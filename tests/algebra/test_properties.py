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
    MOE_K2,
    assert_indices_equal,
    assert_matches,
    examples,
    finite_max_abs,
    float32_streams,
    library_inputs,
    loose_compare,
    row_shapes,
    run_both,
    schedules,
    stream_lengths,
    streamed_case,
)
from tests.support import RULE_RTOL as RTOL

NEG_INF = -np.inf


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

@pytest.mark.parametrize("name", sorted(redfuser.LIBRARY))
@settings(max_examples=examples(1 / 3))  # 8 per entry by default
@given(rows=row_shapes(), n=stream_lengths(8, 12), seed=st.integers(0, 2**32 - 1),
       sched=st.data())
def test_library_entry_matches_reference(name, rows, n, seed, sched):
    inputs = library_inputs(name, np.random.default_rng(seed), rows, n)
    chunks, tree = sched.draw(schedules(n))
    fused, ref = run_both(name, inputs, chunks, tree)
    loose_compare(fused, ref)


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


