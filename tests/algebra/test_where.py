"""where(cond, a, b), comparisons and masks: parse errors, the select law, and masked cascades
(padding masks, causal attention, safe softmax) against the float64 oracle, through
``rule.evaluate`` (random chunkings and merge trees) and through the kernels.

Masked slots hold -inf, +inf or NaN on purpose: under select semantics they must never reach
a result.  Tolerances are those of the unmasked tests in ``test_properties.py`` (same
arithmetic on the selected elements): max exact, sums of exponentials and their ratios
``RTOL = 1e-4``, differences ``1e-5`` relative to the data's scale; for attention the float32
rounding of the dot product (``D eps |s|``) is added.  NaN and +-inf must sit exactly where
the reference has them.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import redfuser
from algebra.functions import Where
from algebra.ieee import AsWritten, IsNaN
from algebra.selects import lift
from algebra.spec import parse
from tests.support import (
    EPS32,
    F32,
    assert_matches,
    examples,
    finite_max_abs,
    float32_streams,
    row_shapes,
    rule_for,
    schedules,
    stream_lengths,
)

RTOL = 1e-4
JUNK = (-np.inf, np.inf, np.nan)  # what masked slots hold: none of it may leak

MASKED_SOFTMAX = ("s = where(keep[i] > 0, x[i], -inf)\nm = max(s)\nd = sum(exp(s - m))\n"
                  "y[i] = where(keep[i] > 0, exp(x[i] - m) / d, 0)")
# masked elements contribute nothing whatever their values: the selects hold whole terms
# (exp(s - m) * x at a masked element would be 0 * x, NaN for junk x, as numpy computes it)
SAFE_MEAN = ("s = where(keep[i] > 0, x[i], -inf)\nm = max(s)\n"
             "d = sum(where(keep[i] > 0, exp(s - m), 0))\n"
             "o = where(d > 0, sum(where(keep[i] > 0, exp(s - m) * x[i], 0)) / d, 0)")
MASKED_VARIANCE = ("c = sum(where(keep[i] > 0, 1, 0))\n"
                   "mean = sum(where(keep[i] > 0, x[i], 0)) / c\n"
                   "var = sum(where(keep[i] > 0, (x[i] - mean)**2, 0)) / c")
SAFE_CAUSAL = ("s = where(i <= pos, dot(q, k[i, :]) * scale, -inf)\nm = max(s)\n"
               "d = sum(exp(s - m))\no = where(d > 0, sum(exp(s - m) * v[i, :]) / d, 0)")
PADDED_ATTENTION = ("s = where(valid[i] > 0, dot(q, k[i, :]) * scale, -inf)\nm = max(s)\n"
                    "d = sum(exp(s - m))\no = sum(exp(s - m) * v[i, :]) / d")


# -- the language --------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "line", "col", "words"), [
    ("m = max(x[i] > 0)", 1, 9, "is a condition (true or false), used as a number"),
    ("m = sum((x[i] > 0) + 1)", 1, 10, "write where(x[i] > 0, 1, 0)"),
    ("m = sum(where(x[i], 1, 0))", 1, 15, "where() needs a condition"),
    ("m = sum(x[i])\ny[i] = x[i] > m", 2, 8, "'y' is a condition"),
    ("m = sum(where(x[i] > 0 & x[i] < 1, 1, 0))", 1, 22, "binds tighter than a comparison"),
    ("m = sum(where(~x[i] > 0, 1, 0))", 1, 16, "needs a condition"),
    ("m = sum(where(not x[i], 1, 0))", 1, 19, "'not' needs a condition"),
    ("m = sum(where(x[i] is 0, 1, 0))", 1, 15, "cannot compare"),
    ("m = sum(where(x[i] > 0, 1))", 1, 9, "where() takes 3 argument(s)"),
    ("t = topk(x[i], 2)\ns = sum(where(v[i, :] > t, 1, 0))", 2, 15,
     "top-k values combined with a feature-axis vector"),
    ("ok = sum(x[i]) > 0", 1, 6, "'ok' is a condition"),
])
def test_misused_conditions_are_spec_errors_with_position(spec, line, col, words):
    with pytest.raises(redfuser.SpecError) as err:
        parse(spec)
    assert (err.value.line, err.value.col) == (line, col), str(err.value)
    assert words in str(err.value)


def test_chained_comparisons_and_connectives():
    c = parse("mask = 0 <= x[i] < 1 and not i > pos or x[i] == 2\nm = sum(where(mask, x[i], 0))")
    x, i, pos = (sp.Symbol("x", real=True), sp.Symbol("i", nonnegative=True, integer=True),
                 sp.Symbol("pos", real=True))
    cond = (sp.Le(0, x) & (x < 1) & (~(i > pos) | IsNaN(pos))) | sp.Eq(x, 2)  # IEEE's not
    assert c.reductions[0].body == Where(cond, x, 0)


def test_selects_are_lifted_and_never_turned_into_arithmetic():
    """exp(where(c, s - m, -inf)) * v = where(c, exp(s - m) * v, 0 * v): the select law, not
    c*a + (1-c)*b; the 0 * v stays as written (NaN where v is inf or NaN), and so does the
    -inf that would absorb m (exp(-inf - m) is NaN at m = -inf)."""
    s, m, v = sp.symbols("s m v", real=True)
    c = s > 0
    assert lift(sp.exp(Where(c, s - m, -sp.oo)) * v) == Where(c, v * sp.exp(s - m),
                                                               v * AsWritten(0))
    assert lift(sp.exp(Where(c, s, -sp.oo) - m)) == Where(c, sp.exp(s - m),
                                                           sp.exp(AsWritten(-sp.oo) - m))
    assert sp.simplify(Where(c, s, -sp.oo)).has(Where)  # sympy leaves the select alone
    rule = redfuser.derive("causal_attention")
    assert all(rule.status) and rule.verify()
    assert str(rule.running["d"]) == "where(d_count > 0, d, 0)"


def test_condition_on_an_anchor_is_refused_with_the_reason():
    with pytest.raises(redfuser.NotFusable) as err:
        redfuser.derive("m = max(x[i])\nc = sum(where(x[i] > m - 1, 1, 0))")
    assert err.value.reduction == "c"
    assert str(err.value.culprit) == "x > m - 1"
    assert "reads the earlier result(s) m" in err.value.why


def test_select_in_an_anchored_max_body_is_refused():
    with pytest.raises(redfuser.NotFusable, match="inside a max/min/arg"):
        redfuser.derive("m = max(x[i])\nd = sum(exp(x[i] - m))\n"
                        "p = max(where(i <= pos, exp(x[i] - m) / d, 0))")


def test_masked_max_and_argmax_without_anchors():
    x = np.array([[3.0, np.nan, 1.0, np.inf], [np.nan, np.nan, np.nan, np.nan]], F32)
    keep = np.array([[0, 0, 1, 0], [0, 0, 0, 0]], F32)
    spec = "m = max(where(keep[i] > 0, x[i], -inf))\nj = argmax(where(keep[i] > 0, x[i], -inf))"
    out = rule_for(spec).evaluate({"x": x, "keep": keep}, chunks=[1, 3])
    ref = redfuser.reference(spec, {"x": x, "keep": keep})
    np.testing.assert_array_equal(out["m"], [1.0, -np.inf])
    np.testing.assert_array_equal(ref["m"], [1.0, -np.inf])
    np.testing.assert_array_equal(out["j"], ref["j"])


def test_fully_masked_causal_rows():
    """pos = -1 masks every key: m = -inf, d = 0, o = 0/0 = NaN as in the reference; the safe
    form where(d > 0, ..., 0) gives 0."""
    from algebra.library import example_inputs

    inputs = example_inputs("causal_attention", n=6, rows=(2, 3), d=4)
    inputs["pos"] = np.array([[-1, 0, 5]], F32)
    inputs["k"][..., 1:, :] = np.nan  # masked for the first two queries
    out = rule_for("causal_attention").evaluate(inputs, chunks=[2, 4])
    assert np.all(out["m"][:, 0] == -np.inf) and np.all(out["d"][:, 0] == 0)
    assert np.isnan(out["o"][:, 0]).all() and np.isfinite(out["o"][:, 1]).all()
    safe = rule_for(SAFE_CAUSAL).evaluate(inputs, chunks=[3, 3])
    assert np.all(safe["o"][:, 0] == 0)
    np.testing.assert_array_equal(safe["o"][:, 1], out["o"][:, 1])
    assert np.isnan(out["m"][:, 2]).all()  # the last query reads the NaN keys: NaN, as np.max


# -- masked cascades against the oracle (evaluate) ----------------------------------------------

@st.composite
def masked_streams(draw):
    """(inputs, chunks, tree): x (*rows, N) and keep (0/1); masked slots of x hold junk, and
    some rows may be masked entirely."""
    rows, n = draw(row_shapes()), draw(stream_lengths())
    x = draw(float32_streams(rows + (n,), kinds=("normal", "grid", "ties")))
    keep = draw(hnp.arrays(np.bool_, rows + (n,)))
    if rows and draw(st.booleans()):
        keep[draw(hnp.arrays(np.bool_, rows))] = False  # whole rows masked
    x = np.where(keep, x, draw(st.sampled_from(JUNK))).astype(F32)
    return {"x": x, "keep": keep.astype(F32)}, draw(schedules(n))


@given(masked_streams())
def test_masked_softmax(case):
    inputs, (chunks, tree) = case
    fused, ref = _both(MASKED_SOFTMAX, inputs, chunks, tree)
    assert_matches(fused["m"], ref["m"], 0, 0, "m")
    assert_matches(fused["d"], ref["d"], RTOL, 0, "d")
    assert_matches(fused["y"], ref["y"], RTOL, 1e-6, "y")


@given(masked_streams())
def test_safe_masked_mean(case):
    inputs, (chunks, tree) = case
    fused, ref = _both(SAFE_MEAN, inputs, chunks, tree)
    assert_matches(fused["o"], ref["o"], RTOL, 1e-5 * (1 + finite_max_abs(inputs["x"])), "o")
    assert not np.isnan(fused["o"]).any()  # fully masked rows give 0, junk never leaks


@given(masked_streams())
def test_masked_variance(case):
    """Polynomial re-anchoring under a mask: an empty selection is 0 (mean and var 0/0)."""
    inputs, (chunks, tree) = case
    fused, ref = _both(MASKED_VARIANCE, inputs, chunks, tree)
    scale = 1 + finite_max_abs(inputs["x"])
    assert_matches(fused["mean"], ref["mean"], RTOL, 1e-5 * scale, "mean")
    assert_matches(fused["var"], ref["var"], RTOL, 1e-5 * scale**2, "var")


@st.composite
def masked_attention(draw, padded: bool):
    """Causal (pos per query, -1 for a fully masked one) or padded (valid per key) attention;
    keys masked for every query hold junk in K and V."""
    h, lq, d, n = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(2, 4)), \
        draw(stream_lengths(1, 10))
    q, k, v = (draw(float32_streams(s, kinds=("normal", "grid"), limit=2.0))
               for s in ((h, lq, d), (h, 1, n, d), (h, 1, n, d)))
    if padded:
        valid = draw(hnp.arrays(np.bool_, (h, 1, n)))
        masked, extra = ~valid[..., None], {"valid": valid.astype(F32)}
    else:
        pos = draw(hnp.arrays(np.int64, (1, lq), elements=st.integers(-1, n)))
        masked = (np.arange(n) > pos.max())[None, None, :, None]
        extra = {"pos": pos.astype(F32)}
    junk = draw(st.sampled_from(JUNK))
    k, v = (np.where(masked, junk, a).astype(F32) for a in (k, v))
    return {"q": q, "k": k, "v": v, "scale": 0.5, **extra}, draw(schedules(n))


@pytest.mark.parametrize("spec, padded", [("causal_attention", False), (SAFE_CAUSAL, False),
                                          (PADDED_ATTENTION, True)])
@settings(max_examples=examples(0.6))
@given(data=st.data())
def test_masked_attention(spec, padded, data):
    inputs, (chunks, tree) = data.draw(masked_attention(padded))
    fused, ref = _both(spec, inputs, chunks, tree)
    _check_attention(fused, ref, inputs)


def _check_attention(fused, ref, inputs):
    d = inputs["q"].shape[-1]
    s_bound = inputs["scale"] * d * finite_max_abs(inputs["q"]) * finite_max_abs(inputs["k"])
    weight_rtol = RTOL + 8 * d * EPS32 * s_bound  # float32 rounding of s, through exp()
    assert_matches(fused["m"], ref["m"], 0, 8 * d * EPS32 * (1.0 + s_bound), "m")
    assert_matches(fused["d"], ref["d"], weight_rtol, 0, "d")
    assert_matches(fused["o"], ref["o"], weight_rtol,
                   weight_rtol * (1.0 + finite_max_abs(inputs["v"])), "o")


def _both(spec, inputs, chunks=None, tree=None):
    fused = rule_for(spec).evaluate(inputs, chunks=chunks, tree=tree)
    ref = redfuser.reference(spec, inputs)
    assert list(fused) == list(ref)
    return fused, ref


# -- kernels ------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ("rolling", "split", "unfused"))
@settings(max_examples=examples(0.12))  # 3 per variant: each example compiles a kernel
@given(data=st.data())
def test_masked_kernels_match_the_oracle(variant, data):
    padded = data.draw(st.booleans())
    inputs, _ = data.draw(masked_attention(padded))
    spec = PADDED_ATTENTION if padded else "causal_attention"
    out = redfuser.compile(spec, variant=variant)(**inputs)
    _check_attention(out, redfuser.reference(spec, inputs), inputs)
    case, _ = data.draw(masked_streams())
    out = redfuser.compile(MASKED_SOFTMAX, variant=variant)(**case)
    ref = redfuser.reference(MASKED_SOFTMAX, case)
    assert_matches(out["m"], ref["m"], 0, 0, "m")
    assert_matches(out["y"], ref["y"], RTOL, 1e-6, "y")


@pytest.mark.parametrize("mask", [-1e30, float(np.finfo(np.float32).min), -1e4])
def test_an_additive_mask_value_is_not_cancelled_into_the_scores(mask):
    """A mask added to the scores (``x + where(c, 0, L)``, torch's ``finfo.min`` or -1e4)
    stays in the masked branch only: each branch of the score is a computed value of its
    own, and the unmasked ``exp(x/4 - m)`` must not become ``exp((x/4 + L) - L - m)``,
    which loses x in float32 (error 0.17 at L = -1e30 before the fix)."""
    spec = (f"t1 = where(c[i] > 0.5, 0.0, {mask!r}); t3 = x[i] * 0.25 + t1; m = max(t3); "
            "d = sum(exp(t3 - m)); y[i] = exp(t3 - m) / d")
    rng = np.random.default_rng(0)
    inputs = {"x": rng.normal(0, 2, (4, 64)).astype(F32),
              "c": (rng.random((4, 64)) > 0.3).astype(F32)}
    ref = redfuser.reference(spec, inputs)
    for variant in ("rolling", "unfused"):
        out = redfuser.compile(spec, variant=variant, tune=False)(**inputs)
        for name in ("d", "y"):
            assert_matches(out[name], ref[name], RTOL, 1e-7, f"{variant} {name} at L = {mask}")
