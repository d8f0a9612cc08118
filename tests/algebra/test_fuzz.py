"""Fuzzing the spec language: ``derive`` either returns a rule that verifies, or raises
``SpecError`` / ``NotFusable``, never anything else; rules it does return agree with the
float64 reference.  Plus the messages of specific bad and non-fusable specs, and one
regression test per distinct engine failure the fuzzer has found (smallest spec we know).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import redfuser
from tests.support import (
    TEXT,
    assert_indices_equal,
    assert_matches,
    examples,
    finite_max_abs,
    make_inputs,
    schedules,
    specs,
    time_limit,
)

DERIVE_SECONDS = 15  # derive takes well under a second for anything the fuzzer writes


def _note(outcome: str):
    if currently_in_test_context():  # shown by pytest --hypothesis-show-statistics
        event(outcome)


def derive_or_reject(spec: str):
    """The rule, or None when derive rejects the spec the documented way: a SpecError that
    names line and column, or a NotFusable that names the reduction and the culprit."""
    try:
        with time_limit(DERIVE_SECONDS, f"derive({spec!r})"):
            rule = redfuser.derive(spec)
    except redfuser.SpecError as e:
        _note("SpecError")
        assert e.line is not None and "line " in str(e) and "column " in str(e), str(e)
        return None
    except redfuser.NotFusable as e:
        _note("NotFusable")
        assert f"reduction '{e.reduction}'" in str(e) and str(e.culprit) in str(e), str(e)
        return None
    _note("derived")
    assert isinstance(rule, redfuser.FusionRule)
    assert rule.verify() is True, spec
    return rule


@settings(max_examples=examples(6))  # 150 by default
@given(spec=specs(), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_derive_returns_verified_rule_or_documented_error(spec, seed, data):
    rule = derive_or_reject(spec)
    if rule is None or "x" not in {s.name for s in rule.cascade.streams}:
        return
    _note("evaluated")
    inputs = make_inputs(rule, np.random.default_rng(seed))
    chunks, tree = data.draw(schedules(5))
    fused = rule.evaluate(inputs, chunks=chunks, tree=tree)
    ref = redfuser.reference(spec, inputs)
    assert list(fused) == list(ref)
    for name in ref:
        assert fused[name].shape == ref[name].shape, name
        if ref[name].dtype.kind in "iu":
            assert_indices_equal(fused[name], ref[name], name)
        else:  # float64 throughout: generous next to its 1e-16 rounding
            assert_matches(fused[name], ref[name], 1e-6, 1e-8 * (1 + finite_max_abs(ref[name])),
                           name)


@settings(max_examples=examples(2.4))  # 60 by default
@given(TEXT)
def test_arbitrary_text_is_a_rule_or_a_spec_error(text):
    derive_or_reject(text)


# -- specific specs ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["r0 = prod(x[i] + x[i])\nr1 = r0",
                                  "p = prod(x[i] + N)\ne = exp(p)\ns = sum(x[i] * p)"])
def test_a_result_read_from_a_product_is_its_value_not_its_sign(spec):
    """Found by the fuzzer: a product derives two components (its signs, then its log-sum)
    under one name, and an epilogue reading it was formed after the first: r1 = r0 came
    out r0.sign (1.0 against 10.3), in rule.evaluate and in the kernel."""
    rule = derive_or_reject(spec)
    inputs = make_inputs(rule, np.random.default_rng(0))
    ref = redfuser.reference(spec, inputs)
    kernel = redfuser.compile(spec, tune=False)(
        **{k: np.asarray(v, np.float32) for k, v in inputs.items()})
    for name in ref:
        assert_matches(rule.evaluate(inputs)[name], ref[name], 1e-9, 0, name)
        assert_matches(kernel[name], ref[name], 1e-5, 0, name)


@pytest.mark.parametrize("spec, error", [
    ("r0[i] = x[i]\nr1 = sum(pow(-1, pi))", "line 2, column 10: 'pow(-1, pi)' is undefined"),
    ("r = prod(maximum(pow(x[i] - 0.5, sqrt(pi)), log(1) - tanh(0.5)))", None),
    ("r0 = (sqrt(x[i]) + r2 / x[i]) * x[i]\nr1 = prod(r0)", None),
])
def test_specs_the_fuzzer_found_derive_or_name_their_constant(spec, error):
    """Found by the fuzzers: (-1)**pi, whose realness sympy's assumptions leave open, is a
    complex constant (it reached the numeric compiler as NotImplementedError); max() of
    such a constant met in a proof raised sympy's "not comparable"; a product of
    sqrt(x) + r2 / x, which sympy does not know to be real, failed its polar-form proof
    (a law of every real value, now proven on a real symbol)."""
    if error:
        with pytest.raises(redfuser.SpecError, match=re.escape(error)):
            redfuser.derive(spec, passes="auto")
        return
    rule = derive_or_reject(spec)
    for seed in range(3):
        inputs = make_inputs(rule, np.random.default_rng(seed))
        fused, ref = rule.evaluate(inputs), redfuser.reference(spec, inputs)
        for name in ref:
            assert_matches(fused[name], ref[name], 1e-6, 1e-8 * (1 + finite_max_abs(ref[name])),
                           name)


@pytest.mark.parametrize("spec, reduction, culprit", [
    ("m = max(x[i]); r = sum(relu(x[i] - m))", "r", "relu"),
    ("a = sum(x[i]); r = sum(round(x[i] / a))", "r", "round"),
    ("m = max(x[i]); r = sum(abs(x[i] - m))", "r", "Abs"),
    ("m = max(x[i]); r = sum(maximum(x[i], m))", "r", "max(x, m)"),
    ("m = max(x[i]); r = sum(exp(x[i] * m))", "r", "exp(m*x)"),
    ("m = max(x[i]); s = sum(sqrt(x[i] - m))", "s", "sqrt"),
    ("m = sum(x[i]); r = prod(x[i] + m)", "r", "m + x"),
    ("m = sum(x[i]); r = max(x[i] * m)", "r", "m*x"),
    ("m = max(x[i]); r = argmax(relu(x[i] - m))", "r", "relu"),
])
def test_not_fusable_names_reduction_and_culprit(spec, reduction, culprit):
    with pytest.raises(redfuser.NotFusable) as info:
        redfuser.derive(spec)
    message = str(info.value)
    assert f"'{reduction}'" in message and culprit in message, message
    assert info.value.reduction == reduction


@pytest.mark.parametrize("spec, words", [
    ("", ["empty"]),
    ("# only a comment\n", ["empty"]),
    ("m = foo(x[i])", ["unknown function", "foo"]),
    ("m = max(x[i]); d = sum(exp(x[i] - max(x[i])))", ["nested"]),
    ("d = sum(exp(x[i] - m)); m = max(x[i])", ["'m'", "before its definition"]),
    ("a = sum(x[i]*b); b = sum(x[i]*a)", ["cycle"]),
    ("m = argmax(x[i]); s = sum(dot(m, k[i]))", ["shape mismatch", "dot"]),
    ("m = topk(x[i], 2); s = sum(dot(m, k[i]))", ["shape mismatch", "dot"]),
    ("m = max(x[i]", ["syntax error"]),
    ("m = max(x[j])", ["indexed by 'i'"]),
    ("m = topk(x[i], 0)", ["positive integer"]),
    ("m = max(x[i]); m = sum(x[i])", ["assigned twice"]),
    ("y = 2 * 3", ["no reduction"]),
])
def test_spec_error_names_line_and_column(spec, words):
    with pytest.raises(redfuser.SpecError) as info:
        redfuser.derive(spec)
    message = str(info.value)
    assert "line" in message and "column" in message, message
    for word in words:
        assert word in message, message


def test_spec_error_position_points_at_the_problem():
    with pytest.raises(redfuser.SpecError) as info:
        redfuser.derive("m = max(x[i])\nd = sum(exp(x[i] - m))\ns = sum(fooo(x[i]))")
    assert (info.value.line, info.value.col) == (3, 9)
    assert "line 3, column 9" in str(info.value)


@pytest.mark.parametrize("spec", ["m = max(x[i])\x00", "m = max(x[i])\n\ud800"])
def test_unreadable_characters_are_positioned_spec_errors(spec):
    """A NUL byte, or a lone surrogate that cannot be encoded: a SpecError naming the place."""
    with pytest.raises(redfuser.SpecError) as info:
        redfuser.derive(spec)
    assert info.value.line is not None, str(info.value)
    assert "line" in str(info.value) and "column" in str(info.value)


# -- regressions: small specs the fuzzer found (each states the expected behaviour) -------------

RNG_X = np.random.default_rng(3).uniform(0.5, 1.5, (2, 5))


@pytest.mark.parametrize("spec", ["r = sum(0 * x[i])", "r = sum(x[i] - x[i])",
                                  "m = max(x[i]); r = sum(exp(x[i] - m) - exp(x[i] - m))"])
def test_sum_of_an_identically_zero_body(spec):
    """The body simplifies to 0: derive must return a rule (r = 0) or reject it the documented
    way, not crash."""
    rule = derive_or_reject(spec)
    if rule is not None:
        np.testing.assert_array_equal(rule.evaluate({"x": RNG_X})["r"], 0.0)


@pytest.mark.parametrize("spec", ["r = sum(2 ** (x[i] ** x[i]))",
                                  "r = sum(pow(b, pow(x[i], x[i])))"])
def test_tower_of_powers_derives_in_bounded_time(spec):
    rule = derive_or_reject(spec)  # fails with Hang after DERIVE_SECONDS
    if rule is not None:
        inputs = {"x": RNG_X, "b": np.full(2, 0.5)}
        inputs = {k: v for k, v in inputs.items() if k in {p.name for p in rule.cascade.params}
                  | {s.name for s in rule.cascade.streams}}
        np.testing.assert_allclose(rule.evaluate(inputs)["r"],
                                   redfuser.reference(spec, inputs)["r"], rtol=1e-9)


def test_deeply_nested_exponentials_derive_or_reject():
    rule = derive_or_reject("r = sum(exp(exp(exp(x[i]))))")
    if rule is not None:
        x = np.full((1, 2), -3.0)
        np.testing.assert_allclose(rule.evaluate({"x": x})["r"],
                                   2 * np.exp(np.exp(np.exp(-3.0))), rtol=1e-12)


@pytest.mark.parametrize("spec, expected", [
    ("r = sum(x[i] * sigmoid(pi))", RNG_X.sum(-1) / (1 + np.exp(-np.pi))),
    ("r = sum(x[i]) * relu(pi)", RNG_X.sum(-1) * np.pi),
])
def test_function_of_a_symbolic_constant_evaluates(spec, expected):
    rule = derive_or_reject(spec)
    assert rule is not None
    np.testing.assert_allclose(rule.evaluate({"x": RNG_X})["r"], expected, rtol=1e-12)
    np.testing.assert_allclose(redfuser.reference(spec, {"x": RNG_X})["r"], expected, rtol=1e-12)


@pytest.mark.parametrize("spec, inputs", [
    ("m = max(v[i, :])", {"v": np.random.default_rng(4).uniform(0.5, 1.5, (2, 5, 3))}),
    ("r0 = dot(x[i], a[:]); r1 = max(x[i])",
     {"x": np.random.default_rng(5).uniform(0.5, 1.5, (2, 5, 3)), "a": np.ones((2, 3))}),
])
def test_max_over_a_feature_vector_body(spec, inputs):
    """max() of a feature-axis body is accepted by derive (it is per-feature), so evaluate must
    run it and match the reference (or derive must reject it with a SpecError)."""
    rule = derive_or_reject(spec)
    if rule is not None:
        fused, ref = rule.evaluate(inputs, chunks=[2, 3]), redfuser.reference(spec, inputs)
        for name in ref:
            np.testing.assert_allclose(fused[name], ref[name], rtol=1e-12)


@pytest.mark.parametrize("spec", [
    "t = topk(x[i], 2); y[i] = x[i] - t",  # k values against the N stream elements
    "r0 = topk((x[i] + dot(x[i, :], x[i, :])), 1)",  # a feature vector per element
])
def test_shape_mismatch_is_a_spec_error(spec):
    with pytest.raises(redfuser.SpecError, match="line"):
        redfuser.derive(spec)


@pytest.mark.parametrize("spec, x, expected", [
    ("t = argmax(x[i])", [[np.nan, np.nan], [1.0, np.nan]], [0, 1]),
    ("t = argmax(sqrt(-x[i]))", [[1.0, 2.0], [0.5, 3.0]], [0, 0]),
    ("t = argtopk(x[i], 2)", [[np.nan, np.nan, 1.0]], [[0, 1]]),
])
def test_index_of_nan_bodies_follows_numpy(spec, x, expected):
    """NaN bodies (NaN input, or a function outside its domain): the reference follows numpy
    (NaN counts as the maximum); the fused index must at least be a valid position, and
    should agree with the reference."""
    x = np.array(x)
    fused = redfuser.derive(spec).evaluate({"x": x}, chunks=[1, x.shape[-1] - 1])["t"]
    assert ((0 <= fused) & (fused < x.shape[-1])).all(), f"index out of range: {fused}"
    np.testing.assert_array_equal(redfuser.reference(spec, {"x": x})["t"], expected)
    np.testing.assert_array_equal(fused, expected)


def test_complex_constant_is_rejected_or_nan():
    """(-1) ** 0.5 is a SpecError ('undefined'); (-1) ** (1/3) is complex as well: derive must
    reject it the same way, or evaluate must give numpy's NaN, not raise."""
    spec = "r = sum(x[i] * pow(-1, 1/3))"
    rule = derive_or_reject(spec)
    if rule is not None:
        assert np.isnan(rule.evaluate({"x": RNG_X})["r"]).all()


@pytest.mark.parametrize("spec, value", [("m = max(x[i]); z = m - m", 0.0),
                                         ("m = max(x[i]); z = m / m", 1.0)])
def test_result_that_simplifies_to_a_constant(spec, value):
    """z simplifies to a number: it is still a per-row result of shape (*rows,)."""
    rule = derive_or_reject(spec)
    assert rule is not None
    np.testing.assert_array_equal(rule.evaluate({"x": RNG_X}, chunks=[2, 3])["z"], [value] * 2)
    np.testing.assert_array_equal(redfuser.reference(spec, {"x": RNG_X})["z"], [value] * 2)
