"""Range-safe numerics: products, normalised sums, inf/NaN at non-finite anchors, torch's
logsumexp convention and empty streams, each through ``evaluate`` (any chunking and merge
tree), the float64 ``reference`` and the compiled kernels (rolling, split, unfused).

Tolerances (float32 eps = 1.19e-7):

* A product is exp of a float32 log-sum L, so its relative error is the absolute error of L:
  each of the N terms log|f_i| (its parts log|x_i| and log|m| are formed apart, and each
  re-anchoring shift) rounds at its own magnitude, so ``PROD_ULPS * eps * (N + sum_i
  |ln|f_i|| + |ln|x_i|| + |ln|m||)`` bounds it (from the float64 values), plus the product's
  sensitivity to a float32 running anchor (a mean) being a few ulps off; a direct float32
  product would err by N eps, and overflow where the log-sum does not.
* Single normalised values (5e20 from (3e20, 4e20)) take a few roundings: rtol 1e-6.
* Values that are exactly an identity, an infinity or NaN are compared exactly.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import redfuser
from algebra.library import LIBRARY, example_inputs
from algebra.numeric import compile_expr
from tests.support import (
    EPS32,
    F32,
    VARIANTS,
    assert_matches,
    examples,
    kernel_variants,
    rule_for,
    schedules,
    values,
)

INF, NAN = np.inf, np.nan
PROD_ULPS = 8  # roundings per term of the log-sum (log, add, re-anchoring shift), doubled
ANCHOR_ULPS = 8  # how far a float32 running anchor (a mean) may be off the exact one
F32_MAX = float(np.finfo(F32).max)


@functools.cache
def kernel(spec: str, variant: str):
    return redfuser.compile(spec, variant=variant, tune=False)


def every_path(spec: str, inputs: dict, chunks=None, tree=None) -> dict[str, dict]:
    """Outputs of evaluate and of each kernel variant, by path name."""
    out = {"evaluate": rule_for(spec).evaluate(inputs, chunks=chunks, tree=tree)}
    out.update({v: kernel(spec, v)(**inputs) for v in kernel_variants(spec)})
    return out


def assert_all_match(spec, inputs, rtol, names=None, chunks=None, tree=None):
    ref = redfuser.reference(spec, inputs)
    for path, out in every_path(spec, inputs, chunks, tree).items():
        for name in names or ref:
            assert_matches(out[name], ref[name], rtol, 0, f"{path} {name}")


# -- products: a log-sum and a product of signs (repro prod_nan.py) ---------------------------

PRODUCTS = {  # spec -> the magnitude its stream is drawn with (float64 factors stay in range)
    "m = max(x[i]); p = prod(exp(x[i] - m))": 1e30,
    "m = max(abs(x[i])); p = prod(x[i] / m)": 1e30,
    "mu = sum(x[i]) / N; p = prod(exp(x[i] - mu))": 8.0,  # exp(x - mu) overflows beyond 700
    "p = prod(x[i])": 1e3,
    "m = max(x[i]); p = prod(exp(x[i] - m) * x[i])": 1e3,
    "geometric_mean": 40.0,  # its epilogue exp(m) is inf in float32 beyond 88 (spec's own form)
}


def prod_rtol(spec: str, inputs: dict) -> np.ndarray:
    """Per row: PROD_ULPS * eps * (N + sum |ln|f_i|| + the logs of |x_i| and of the anchors,
    which the state forms apart) for the roundings of the log-sum, plus
    the product's own sensitivity to its anchors moving by ANCHOR_ULPS float32 ulps (a float32
    running mean is a few ulps off the exact one, and prod(exp(x - mu)) moves by N times
    that; the multi-pass float32 form has the same error)."""
    red = [r for r in rule_for(spec).cascade.reductions if r.op == "prod"][0]
    ref = redfuser.reference(spec, inputs)
    env = {**{k: np.asarray(v, np.float64)[..., None] for k, v in ref.items()},
           "x": np.asarray(inputs["x"], np.float64), "N": float(inputs["x"].shape[-1])}
    body = compile_expr(red.body)
    with np.errstate(all="ignore"):
        logs = np.log(np.abs(np.broadcast_to(body(env, np.dtype(np.float64)),
                                             inputs["x"].shape)))
        shift = np.zeros(inputs["x"].shape[:-1])
        for a in red.anchors:
            for sign in (-1, 1):
                moved = {**env, a.name: env[a.name] * (1 + sign * ANCHOR_ULPS * EPS32)}
                other = np.log(np.abs(np.broadcast_to(body(moved, np.dtype(np.float64)),
                                                      inputs["x"].shape)))
                change = np.abs(np.sum(np.where(np.isfinite(other - logs), other - logs, 0),
                                       axis=-1))
                shift = np.maximum(shift, change)
        # the state forms log|x| and log|m| apart: each rounds at its own magnitude (69 at
        # 1e30), whatever the magnitude of their difference log|x / m|
        parts = np.abs(np.log(np.abs(env["x"]))) + sum(
            np.abs(np.log(np.abs(env[a.name]))) for a in red.anchors)
    size = np.sum(np.where(np.isfinite(logs), np.abs(logs), 0) +
                  np.where(np.isfinite(parts), parts, 0), axis=-1)
    return PROD_ULPS * EPS32 * (logs.shape[-1] + size) + shift


def assert_product(fused, ref, rtol, name: str):
    """fused ~ the float64 product rounded to float32: a product beyond float32's range is
    +-inf there (1e40 from forty 10s), one within rtol of the limit may round either way."""
    ref, fused = np.asarray(ref, np.float64), np.asarray(fused)
    rtol = np.broadcast_to(rtol, ref.shape)
    edge = np.abs(ref) * (1 + rtol) >= F32_MAX
    both = edge & np.isinf(fused) & (np.sign(fused) == np.sign(ref))
    with np.errstate(over="ignore"):
        want = np.where(np.abs(ref) > F32_MAX, ref.astype(F32), ref)
    assert_matches(np.where(both, want, fused), want, rtol, 0, name)


@pytest.mark.parametrize("spec, x", [
    ("m = max(x[i]); p = prod(exp(x[i] - m))", [10.0] * 12),
    ("m = max(abs(x[i])); p = prod(x[i] / m)", [100.0] * 40),
    ("mu = sum(x[i]) / N; p = prod(exp(x[i] - mu))", [10.0] * 12),
    ("p = prod(x[i])", [1e30, 1e30, 1e-30, 1e-30, -2.0, 3.0]),  # C**N * prod(G) overflowed
])
def test_product_stays_in_range(spec, x):
    """Repro prod_nan.py: twelve factors exp(10 - 10) are 1, not exp(-120) * exp(120) = NaN."""
    inputs = {"x": np.array([x], F32)}
    ref = redfuser.reference(spec, inputs)
    assert np.isfinite(ref["p"]).all()
    for path, out in every_path(spec, inputs).items():
        assert_product(out["p"], ref["p"], prod_rtol(spec, inputs), path)


@st.composite
def product_case(draw, spec: str, n_max: int = 12):
    rows, n = draw(st.sampled_from([(), (2,), (2, 3)])), draw(st.integers(1, n_max))
    limit = PRODUCTS[spec]
    kind = draw(st.sampled_from(["wide", "grid", "ties", "near1"]))
    elements = {"wide": values("normal", limit),
                "grid": st.integers(-16, 16).map(lambda k: k * 0.25),
                "ties": st.sampled_from([-1.0, 0.5, 2.0, 0.0]),
                "near1": st.floats(0.5, 2.0, width=32)}[kind]
    x = draw(hnp.arrays(F32, rows + (n,), elements=elements))
    if draw(st.booleans()):  # huge and tiny magnitudes in one stream
        scale = draw(hnp.arrays(np.float64, rows + (n,), elements=st.sampled_from(
            [1.0, 1e-20, 1e15])))
        x = np.clip(x * scale, -limit, limit).astype(F32)
    return x, *draw(schedules(n))


@pytest.mark.parametrize("spec", sorted(PRODUCTS))
@settings(max_examples=examples(1.5))
@given(data=st.data())
def test_product_any_schedule_matches_reference(spec, data):
    """The log-domain product in any chunking and merge tree, against the float64 product of
    the spec's own factors (huge and tiny magnitudes mixed: the factors stay in float64's
    range, so the oracle's product is exact where float32's would not be)."""
    x, chunks, tree = data.draw(product_case(spec))
    inputs = {"x": x}
    ref = redfuser.reference(spec, inputs)
    fused = rule_for(spec).evaluate(inputs, chunks=chunks, tree=tree)
    out = [r for r in rule_for(spec).cascade.outputs if r in ("p", "g")][0]
    assert_product(fused[out], ref[out], prod_rtol(spec, inputs), out)


@pytest.mark.parametrize("spec", sorted(PRODUCTS))
@settings(max_examples=examples(0.4))
@given(data=st.data())
def test_product_kernels_match_reference(spec, data):
    """Every kernel variant on the same forms (fixed shape: one compile per variant)."""
    lim = PRODUCTS[spec]
    x = data.draw(hnp.arrays(F32, (3, 40), elements=values("normal", lim)))
    inputs = {"x": x}
    ref = redfuser.reference(spec, inputs)
    out = [r for r in rule_for(spec).cascade.outputs if r in ("p", "g")][0]
    for v in VARIANTS:
        assert_product(kernel(spec, v)(**inputs)[out], ref[out], prod_rtol(spec, inputs), v)


@pytest.mark.parametrize("x", [[INF, 1, 2], [-INF, 1, 2], [-INF] * 3, [NAN, 1, 2],
                               [0.0, -1.0, 2.0], [0.0, INF, 1.0]])
@pytest.mark.parametrize("spec", ["m = max(x[i]); p = prod(exp(x[i] - m))",
                                  "m = max(abs(x[i])); p = prod(x[i] / m)", "p = prod(x[i])"])
def test_product_inf_nan_and_zero_follow_the_reference(spec, x):
    """log|0| = -inf, log|inf| = inf, -inf + inf = NaN: 0 * inf is NaN as in the reference."""
    assert_all_match(spec, {"x": np.array([x], F32)}, 1e-6, ["p"])


# -- normalised sums: anchor powers stay in the state (repro normalised_overflow.py) ----------

NORM = "m = max(abs(x[i])); s = m * sqrt(sum((x[i] / m)**2))"


@pytest.mark.parametrize("spec, x", [
    (NORM, [[3e20, 4e20], [3e-25, 4e-25], [-3e20, 4e20]]),  # x**2 over- and underflows
    ("m = max(abs(x[i])); s = sum(x[i] / m)", [[3e-40, 4e-40]]),  # 1/m overflows
    ("m = max(x[i]); s = sum(x[i] / m)", [[-3, 0, 2, 0.5, -1, 1], [-3, 0, 2, -INF, 1, 1]]),
    ("m = max(x[i]); s = sum(x[i] * m)", [[-3, 0, -1, 2, 0.5, 1]]),  # m passes through 0
])
def test_normalised_sum_stays_in_range(spec, x):
    """The state keeps the spec's terms (x / m)**2 at the running m, re-anchored by
    (m / m')**2, and is held at 1 where m is 0 (a pole of 1/m, a zero of m)."""
    assert_all_match(spec, {"x": np.array(x, F32)}, 1e-6, ["s"])


# -- inf at an infinite anchor: IEEE unless every element was finite (repro nan_semantics.py) -

@pytest.mark.parametrize("x", [[1, 2, -INF, 3], [1, 2, INF, 3], [-INF] * 4, [INF, -INF, 1, 2]])
def test_variance_with_an_infinite_element_is_nan(x):
    """mean = -inf and (-inf - -inf)**2 = NaN in the reference (and torch.var): the limit
    rule (highest power of the infinite shift dominates) applies only to finite elements."""
    inputs = {"x": np.array([x], F32)}
    assert np.isnan(redfuser.reference("variance", inputs)["var"]).all()
    assert torch.isnan(torch.var(torch.tensor(inputs["x"]), -1, correction=0)).all()
    assert_all_match("variance", inputs, 0, ["mean", "var"])


def test_moments_at_1e30_follow_float32_not_the_oracle():
    """Repro nan_semantics.py (moments at 1e30): (x - mu)**2 of 2e30 is 4e60, beyond float32,
    and the element's softmax weight underflows to 0, so its term is 0 * inf = NaN in float32
    (torch's multi-pass float32 form too) where float64 gives 0.  Every path agrees on it,
    and on the values float32 can hold (m, d, mu match the oracle)."""
    x = np.array([[1e30, 1e30, 1.0, -1e30]], F32)
    ref = redfuser.reference("softmax_moments", {"x": x})
    t = torch.tensor(x)
    p = torch.softmax(t, -1)
    mu = (p * t).sum(-1, keepdim=True)
    assert ref["var"].tolist() == [0.0] and torch.isnan((p * (t - mu) ** 2).sum(-1)).all()
    for path, out in every_path("softmax_moments", {"x": x}).items():
        for name in ("m", "d", "mu"):
            assert_matches(out[name], ref[name], 1e-6, 0, f"{path} {name}")
        assert np.isnan(out["var"]).all(), path


def test_infinite_anchor_of_finite_elements_is_the_limit():
    """a = log(sum(x)) = log(0) = -inf with finite x: (x - a)**2 is +inf, not inf - inf."""
    spec = "a = log(sum(x[i])); s = sum((x[i] - a)**2)"
    inputs = {"x": np.array([[1.0, -1.0, 0.5, -0.5]], F32)}
    assert redfuser.reference(spec, inputs)["s"].tolist() == [INF]
    assert_all_match(spec, inputs, 0, ["s"])


def test_exponent_of_huge_logits_is_formed_before_scaling():
    """exp((x - m)/T) at x = m = 3e30: x/T - m/T contracted into an fma is 2e23, not 0."""
    x = np.array([[1e30, -1e30, 2e30, 3e30] * 2], F32)
    for out in every_path("softmax_entropy", {"x": x, "T": 0.7}).values():
        assert out["d"].tolist() == [2.0] and out["h"] == pytest.approx(np.log(2), rel=1e-6)


# -- logsumexp: torch's clamped max -----------------------------------------------------------

LSE_ROWS = [[1, 2, INF], [-INF] * 3, [1, -INF, 3], [INF] * 3, [-INF, INF, 1], [NAN, 1, 2],
            [1e30, 1e30, -1e30]]


def test_logsumexp_follows_torch():
    """+inf in a row gives +inf, a row of -inf gives -inf (torch clamps an infinite max to 0;
    the plain max - max would be NaN), NaN stays NaN; the clamp is the spec's own where()."""
    x = np.array(LSE_ROWS, F32)
    want = torch.logsumexp(torch.tensor(x), -1).numpy()  # float32: a few ulps from float64
    assert_matches(want, redfuser.reference("logsumexp", {"x": x})["lse"], 1e-6, 0, "torch")
    for path, out in every_path("logsumexp", {"x": x}, chunks=[1, 2], tree=(1, 0)).items():
        assert_matches(out["lse"], want.astype(np.float64), 1e-6, 0, path)
    assert "isinf" in LIBRARY["logsumexp"][0] and all(rule_for("logsumexp").status)


def test_isinf_and_isfinite_are_conditions_split_case_by_case():
    rule = redfuser.derive("m = max(x[i]); c = where(isfinite(m), m, 0); "
                           "s = sum(exp(x[i] - c)); f = where(isinf(m), 1, 0)")
    assert all(rule.status)
    x = np.array([[1.0, INF], [-INF, -INF], [0.0, 1.0]], F32)
    assert_all_match(rule.cascade.text, {"x": x}, 1e-7)
    with pytest.raises(redfuser.SpecError, match="condition"):
        redfuser.derive("m = max(x[i]); s = sum(isinf(x[i]))")


# -- empty streams (repro kernel_N0.py) -------------------------------------------------------

EMPTY = [n for n in LIBRARY if n not in ("moe_routing", "greedy_token")]


@pytest.mark.parametrize("name", EMPTY)
def test_empty_stream_gives_the_identities(name):
    """N = 0: sum 0, prod 1, max -inf, min +inf, then the epilogues (mean 0/0 = NaN,
    logsumexp -inf), the same in evaluate, reference and every kernel variant."""
    inputs = example_inputs(name, n=0, rows=(3, 2), d=4)
    ref = redfuser.reference(name, inputs)
    for path, out in every_path(name, inputs).items():
        for k, v in ref.items():
            assert out[k].shape == v.shape, (path, k)
            np.testing.assert_array_equal(out[k], v.astype(F32), err_msg=f"{path} {k}")


def test_empty_stream_matches_torch():
    x = np.zeros((3, 0), F32)
    t = torch.tensor(x)
    assert redfuser.compile("logsumexp")(x=x)["lse"].tolist() == \
        torch.logsumexp(t, -1).tolist() == [-INF] * 3
    out = redfuser.compile("s = sum(x[i]); p = prod(x[i]); m = max(x[i]); mean = s / N")(x=x)
    assert out["s"].tolist() == t.sum(-1).tolist() and out["p"].tolist() == t.prod(-1).tolist()
    assert out["m"].tolist() == [-INF] * 3 and np.isnan(out["mean"]).all()


def test_empty_stream_refuses_an_index_reduction_in_one_message():
    x = np.zeros((2, 0), F32)
    calls = {"reference": lambda: redfuser.reference("greedy_token", {"x": x}),
             "evaluate": lambda: rule_for("greedy_token").evaluate({"x": x}),
             **{v: lambda v=v: kernel("greedy_token", v)(x=x) for v in VARIANTS}}
    for call in calls.values():
        with pytest.raises(ValueError, match=r"argmax\(token\) of an empty stream \(N = 0\)"):
            call()
    with pytest.raises(ValueError, match="an empty stream has no chunks"):
        rule_for("softmax").evaluate({"x": np.zeros((2, 0), F32)}, chunks=[0])
