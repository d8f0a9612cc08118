"""The CPU kernels' fast paths against the float64 oracle: stashed per-element outputs
(``algebra.stash``), lanes aligned on shared anchors (merges that add), whole-row tiles
with a peeled first tile, and the top-k insertion (one test against the last entry, then
a slot-parallel insert; a values-only selection reading its indexed twin).

Tolerance: rtol 2e-6 / atol 1e-6 for softmax-like outputs (each output is one rounded exp,
a sum of <= 8192 terms in 64 lanes and one division: a few float32 ulps); NaN and +-inf must
sit exactly where the reference has them; indices must be equal.
"""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import redfuser
from algebra.skip import skip_conditions
from algebra.stash import stashes
from redfuser.lowering.cpu.plan import FOLD_LANES, TILE_ELEMENTS, lane_aligned, stash_applies
from redfuser.lowering.emitter import folded
from tests.support import examples, float32_streams, rule_for

SOFTMAX_LIKE = [
    "softmax",
    "m = max(x[i]); d = sum(exp((x[i] - m) / T)); y[i] = exp((x[i] - m) / T) / d",
    "m = min(x[i]); d = sum(exp(m - x[i])); y[i] = 3 * exp(m - x[i]) / d",
]


def check(out: dict, ref: dict, rtol: float = 2e-6, atol: float = 1e-6):
    for name, want in ref.items():
        got = out[name]
        if want.dtype.kind in "iu":
            np.testing.assert_array_equal(got, want, err_msg=name)
            continue
        got = got.astype(np.float64)
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(got), test(want), err_msg=f"{name}: {test}")
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=atol, err_msg=name)


def inputs_for(spec: str, x: np.ndarray) -> dict:
    params = {"T": np.full(x.shape[:-1], 0.7, np.float32)} if "T)" in spec else {}
    return {"x": x, **params}


# -- the stash: derived, proven, and only where it holds -------------------------------------

def test_stashes_are_derived_and_proven_where_the_output_is_basis_times_factor():
    for spec in SOFTMAX_LIKE:
        rule = rule_for(spec)
        (s,) = rule.stashes.values()
        assert s.obligation.check()
        assert not {sym.name for sym in s.factor.free_symbols} & {"x", "i"}
    for spec in ("log_softmax", "layernorm", "rmsnorm", "l2_normalize",
                 "m = max(x[i]); d = sum(exp(x[i] - m)); y[i] = exp(2 * (x[i] - m)) / d"):
        rule = rule_for(spec)
        assert stashes(rule.cascade, rule.components) == {}, spec
    assert "stash" in str(rule_for("softmax"))


@pytest.mark.parametrize("n", [33, 64, 127, 128, 300, 2050, TILE_ELEMENTS + 3,
                               2 * TILE_ELEMENTS + 5])
def test_stashed_softmax_matches_the_oracle_across_lengths(n):
    """Lengths around the lane counts and the whole-row tile, with tails; rows holding NaN,
    +inf, all -inf, a late new maximum in the tail and values far below the maximum."""
    g = np.random.default_rng(n)
    x = g.normal(size=(6, n)).astype(np.float32) * 4
    x[1, n // 3] = np.nan
    x[2, :] = -np.inf
    x[3, 5] = np.inf
    x[4, -1] = 60.0  # a new maximum in the tail, after the stashed tile
    x[5, ::3] = -80.0  # exp underflows to 0 in float32 for these
    for spec in SOFTMAX_LIKE:
        kernel = redfuser.compile(spec, tune=False)
        inputs = inputs_for(spec, x)
        out = kernel(**inputs)
        check(out, redfuser.reference(spec, inputs))
        geo = kernel.geometry(**inputs)
        one_tile = n < 2 * TILE_ELEMENTS  # one tile: every value stashed at one anchor
        assert stash_applies(kernel.rule, geo, kernel.plan) == one_tile, n
        assert ("stashed" in kernel.plan.reason) == one_tile


@settings(max_examples=examples(0.6), deadline=None)
@given(data=st.data(), n=st.integers(32, 300), rows=st.integers(1, 4))
def test_stashed_and_aligned_kernels_match_the_oracle(data, n, rows):
    spec = data.draw(st.sampled_from(SOFTMAX_LIKE + ["logsumexp", "greedy_token"]))
    x = data.draw(float32_streams((rows, n), limit=30.0, huge=1e30,
                                  inject=data.draw(st.sampled_from([-np.inf, np.inf,
                                                                    np.nan]))))
    inputs = inputs_for(spec, x)
    out = redfuser.compile(spec, tune=False)(**inputs)
    ref = redfuser.reference(spec, inputs)
    check(out, ref, rtol=1e-5, atol=1e-6)


# -- aligned lanes ------------------------------------------------------------------------------

def test_lanes_align_only_where_anchors_read_single_selections():
    assert lane_aligned(rule_for("softmax")) and lane_aligned(rule_for("logsumexp"))
    assert lane_aligned(rule_for("softmax_moments")) is False  # mu is a sum: not idempotent
    assert lane_aligned(rule_for("variance")) is False
    assert lane_aligned(rule_for("rmsnorm")) is False  # nothing is re-anchored


@pytest.mark.parametrize("name", ["softmax_moments", "variance", "layernorm"])
@pytest.mark.parametrize("n", [2 * FOLD_LANES, 1000, TILE_ELEMENTS + 100])
def test_unaligned_many_lane_kernels_match_the_oracle(name, n):
    """Per-lane anchors (sums as anchors) with merges that re-anchor.  atol 1e-4: the data
    sits at 100 (float32 ulp 7.6e-6), so x - mean carries a few ulps that LayerNorm divides
    by std ~2 and multiplies by |g| up to ~4."""
    g = np.random.default_rng(7)
    x = (g.normal(size=(3, n)) * 2 + 100).astype(np.float32)  # an offset: Welford matters
    inputs = {"x": x}
    if name == "layernorm":
        inputs.update(g=g.normal(size=(3, n)).astype(np.float32),
                      b=g.normal(size=(3, n)).astype(np.float32), eps=1e-5)
    kernel = redfuser.compile(name, tune=False)
    check(kernel(**inputs), redfuser.reference(name, inputs), rtol=1e-5, atol=1e-4)
    assert kernel.plan.lanes == FOLD_LANES


# -- top-k ----------------------------------------------------------------------------------------

TIE_SCALE = 1e-12  # below this, float64 exp(x - m) cannot tell x from 0
TOPK = ["moe_routing", "e = argtopk(x[i], 3)", "p = topk(-x[i], 5); e = argtopk(-x[i], 5)",
        "m = max(x[i]); d = sum(exp(x[i] - m)); e = argtopk(exp(x[i] - m) / d, 4)"]


@settings(max_examples=examples(0.4), deadline=None)  # a build per example: ~5 s each
@given(data=st.data(), n=st.integers(8, 90), rows=st.integers(1, 3),
       variant=st.sampled_from(["rolling", "split", "unfused"]))
def test_topk_kernels_match_the_oracle_with_ties_and_infinities(data, n, rows, variant):
    """Few distinct values (ties: the lower index first), -inf and +inf entries; NaN rows
    are not drawn here (an anchored body of a NaN row is NaN everywhere: issue-tracked)."""
    spec = data.draw(st.sampled_from(TOPK))
    x = data.draw(float32_streams((rows, n), kinds=("ties", "grid", "normal"),
                                  inject=data.draw(st.sampled_from([-np.inf, None]))))
    # Distinct values closer to each other than 1e-12 tie in the oracle's float64 scores
    # (exp(-1e-32) == 1.0): the kernels rank x itself (exact), the oracle cannot tell.
    assume(not np.any((np.abs(x) < TIE_SCALE) & (x != 0)))
    kernel = redfuser.compile(spec, variant=variant, tune=False)
    check(kernel(x=x), redfuser.reference(spec, {"x": x}), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("variant", ["rolling", "split", "unfused"])
def test_topk_of_a_monotone_body_ranks_its_core_in_every_variant(variant):
    """exp(x - m) / d rounds to equal float32 values for x = 0 and 1e-11; the float64 oracle
    tells them apart, and so does ranking x itself (the unfused baseline ranked the
    rounded values: hypothesis found it)."""
    x = np.array([[0.0] + [1e-11] * 7, [1e-11] * 7 + [0.0]], np.float32)
    kernel = redfuser.compile("moe_routing", variant=variant, tune=False)
    check(kernel(x=x), redfuser.reference("moe_routing", {"x": x}), rtol=1e-5, atol=1e-7)


def test_a_values_only_selection_reads_its_indexed_twin():
    rule = rule_for("moe_routing")
    comps, aliases = folded(rule)
    assert aliases == {"p": "e_best"} and len(comps) == len(rule.components) - 1
    x = np.random.default_rng(3).normal(size=(5, 300)).astype(np.float32)
    out = redfuser.compile("moe_routing", tune=False)(x=x)
    check(out, redfuser.reference("moe_routing", {"x": x}))
    assert (np.diff(out["p"], axis=1) <= 0).all()  # the twin's sorted values, best first


@pytest.mark.parametrize("n", [32, 300, 3 * TILE_ELEMENTS])
def test_an_anchor_read_from_its_twin_is_folded_before_what_it_anchors(n):
    """greedy_token's m = max(x) is argmax(x)'s best: folded after d, d's tile anchor was the
    initial -inf (read as 0), and exp(86 - 0) summed over 32 elements overflowed (CI, issue
    11's fast paths)."""
    comps, aliases = folded(rule_for("greedy_token"))
    assert aliases["m"] == "token_best" and comps[0].reduction.name == "token"
    x = np.full((2, n), 86.0, np.float32)
    x[1, n // 2] = 88.0
    check(redfuser.compile("greedy_token", tune=False)(x=x),
          redfuser.reference("greedy_token", {"x": x}))


# -- skipped and unmasked tiles (algebra.skip) ---------------------------------------------------

def test_skip_conditions_need_identity_terms_and_no_count():
    assert [str(c) for c in skip_conditions(rule_for("causal_attention"))] == ["i <= pos"]
    for spec in ("attention", "softmax", "m = max(where(i <= pos, x[i], -inf)); "
                 "e = argmax(where(i <= pos, x[i], -inf))",  # an index: a fully masked row
                 "s = sum(where(i <= pos, x[i], 0)) / N"):  # N counts the skipped elements
        assert skip_conditions(rule_for(spec)) == [], spec


@pytest.mark.parametrize("rows, n, d", [(24, 300, 32), (5, 70, 8)])  # row blocks; one lane
def test_causal_tiles_skipped_or_unmasked_match_the_oracle(rows, n, d):
    """Queries at positions that make key tiles fully masked (skipped), fully visible (the
    select dropped) and split by the mask; NaN and inf in masked keys never reach the
    result; a query with no visible key (pos -1) gives what the reference gives."""
    g = np.random.default_rng(rows)
    q = g.normal(size=(2, rows, d)).astype(np.float32)
    k = g.normal(size=(2, 1, n, d)).astype(np.float32)
    v = g.normal(size=(2, 1, n, d)).astype(np.float32)
    pos = np.sort(g.integers(-1, n + 5, size=(1, rows))).astype(np.float32)
    pos[0, 0] = -1
    for j in range(int(pos.max()) + 1, n):
        k[:, :, j, j % d], v[:, :, j, (j + 1) % d] = np.nan, np.inf
    inputs = {"q": q, "k": k, "v": v, "scale": d ** -0.5, "pos": pos}
    ref = redfuser.reference("causal_attention", inputs)
    for variant in ("rolling", "unfused"):
        kernel = redfuser.compile("causal_attention", variant=variant, tune=False)
        check(kernel(**inputs), ref, rtol=1e-5, atol=1e-6)
    assert (kernel.plan.row_block > 1) == (rows >= 16)
