"""Edge cases of the fused rule against the float64 oracle: streams starting with -inf, rows
of all -inf, anchors that are -inf for a while, N = 1, ties in max and top-k (lowest index
first), scalar streams whose row axis equals N, and the output-shape convention.  The
tolerances are test_properties.py's (``RULE_RTOL``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import redfuser
from tests.support import (
    F32,
    MOE_K2,
    assert_indices_equal,
    assert_matches,
    finite_max_abs,
    float32_streams,
    library_inputs,
    loose_compare,
    row_shapes,
    rule_for,
    run_both,
    schedules,
    stream_lengths,
)
from tests.support import RULE_RTOL as RTOL

NEG_INF = -np.inf

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
    loose_compare(fused, ref)
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
    # sums of exponentials are rescaled by a positive factor when the anchor moves: relative
    # accuracy.  (x - m)**2 is re-anchored by expanding it, S + 2 (m0 - m) T + n (m0 - m)**2,
    # which cancels to about 0 when the anchor settles on x itself: its error is relative to
    # the terms the state held before, (|x| + |y|)**2 each, not to r
    terms = n * (finite_max_abs(x, axis=-1) + finite_max_abs(y, axis=-1)) ** 2
    atol = RTOL * terms if "**2" in spec else 0
    assert_matches(fused["r"], ref["r"], RTOL, atol, "r")


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
    loose_compare(fused, ref)


def test_topk_larger_than_stream_is_rejected():
    with pytest.raises(ValueError, match="k = 8"):
        rule_for("moe_routing").evaluate({"x": np.zeros((2, 1), F32)})


def test_moe_k2_on_two_elements():
    x = np.array([[0.5, 2.0], [1.0, 1.0]], F32)
    fused, ref = run_both(MOE_K2, {"x": x}, [1, 1], (1, 0))
    assert fused["e"].tolist() == [[1, 0], [0, 1]]
    loose_compare(fused, ref)


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
    loose_compare(fused, ref)


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
