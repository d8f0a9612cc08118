"""A spec means what numpy computes from it in IEEE arithmetic, not what sympy simplifies it
to over the real numbers: x/x is NaN at 0, inf and NaN; x - x is NaN at +-inf; NaN == NaN is
false; not (x > 0) is true at a NaN; NaN != t is true.  Each case is checked in the kernel,
in ``rule.evaluate`` and in the float64 oracle (which evaluates the spec's syntax tree as
written), against numpy written by hand.  Regression tests of ../shared/repros/r2_where_*,
r2_spec_self_cancel, r2_staged_*, and the clamped denominator of torch's var/std.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import redfuser
from algebra.ieee import AsWritten

X = np.array([[1.0, np.nan, 3.0, np.inf, -2.0, -np.inf, 0.0]], np.float32)
T = np.array([np.nan], np.float32)


def _every_way(spec: str, inputs: dict) -> dict[str, float]:
    """r of a one-row spec from the kernel, the rule's numpy run and the oracle."""
    rule = redfuser.derive(spec, passes="auto")
    return {"kernel": float(redfuser.compile(rule)(**inputs)["r"][0]),
            "evaluate": float(rule.evaluate(inputs)["r"][0]),
            "reference": float(redfuser.reference(spec, inputs)["r"][0])}


with np.errstate(all="ignore"):
    CASES = [  # (spec, inputs, numpy's value)
        ("r = sum(where(x[i] == x[i], 1, 0))", {"x": X}, (X == X).sum()),
        ("r = sum(where(x[i] - x[i] == 0, 1, 0))", {"x": X}, (X - X == 0).sum()),
        ("r = sum(where(x[i] >= x[i], 1, 0))", {"x": X}, (X >= X).sum()),
        ("r = sum(where(exp(x[i]) > 0, 1, 0))", {"x": X}, (np.exp(X) > 0).sum()),
        ("r = sum(where(abs(x[i]) >= 0, 1, 0))", {"x": X}, (np.abs(X) >= 0).sum()),
        ("r = sum(where(not (x[i] > 0), 1, 0))", {"x": X}, (~(X > 0)).sum()),
        ("r = sum(where(not (x[i] < 2), 1, 0))", {"x": X}, (~(X < 2)).sum()),
        ("r = sum(where(not (x[i] > t), 1, 0))", {"x": X, "t": T}, (~(X > T[:, None])).sum()),
        ("r = sum(where(~(x[i] > 0), 1, 0))", {"x": X}, (~(X > 0)).sum()),
        ("r = sum(where(x[i] != 0, 1, 0))", {"x": X}, (X != 0).sum()),
        ("r = sum(where(x[i] != t, 1, 0))", {"x": X, "t": T}, (X != T[:, None]).sum()),
        ("r = sum(where(x[i] != x[i], 1, 0))", {"x": X}, (X != X).sum()),
        ("r = sum(where(isnan(x[i]), 1, 0))", {"x": X}, np.isnan(X).sum()),
        ("r = sum(x[i] / x[i])", {"x": X[:, [0, 4]]}, 2.0),
        ("r = sum(x[i] / x[i])", {"x": X}, np.nan),
        ("r = sum(x[i] * 0)", {"x": X[:, [0, 4]]}, 0.0),
        ("r = sum(x[i] * 0)", {"x": X}, np.nan),
        ("r = sum(x[i] - x[i])", {"x": X}, np.nan),
        ("r = sum(x[i] + 1 - x[i])", {"x": X[:, [0, 2, 4]]}, 3.0),
        ("r = sum(exp(log(x[i])))", {"x": X[:, [0, 4]]}, np.nan),  # log(-2) is NaN
        ("r = max(where(x[i] == x[i], x[i], -inf))", {"x": X}, np.inf),
    ]


@pytest.mark.parametrize("spec, inputs, want", CASES, ids=[f"{c[0]}|{c[1]['x'].size}"
                                                             for c in CASES])
def test_kernel_evaluate_and_oracle_compute_what_numpy_computes(spec, inputs, want):
    for way, got in _every_way(spec, inputs).items():
        assert np.isnan(got) == np.isnan(want) and (np.isnan(want) or got == want), \
            f"{way}: {got}, numpy {want}"


def test_sympy_folds_are_kept_as_written_in_the_spec():
    rule = redfuser.derive("r = sum(x[i] / x[i])")
    assert rule.cascade.reductions[0].body.has(AsWritten)


def test_a_nan_filter_of_an_all_nan_row_gives_an_empty_max():
    spec = "s = where(x[i] == x[i], x[i], -inf); m = max(s); d = sum(exp(s - m))"
    out = redfuser.compile(spec)(x=np.full((1, 8), np.nan, np.float32))
    assert out["m"][0] == -np.inf
    assert np.isnan(out["d"][0])  # exp(-inf - -inf), as numpy computes the spec
    assert np.isnan(redfuser.reference(spec, {"x": np.full((1, 8), np.nan)})["d"][0])


def test_staged_sum_keeps_a_small_offset_next_to_a_huge_max():
    x = (np.array([[0.0, -0.5, -0.2, -3.0]]) + 1e8).astype(np.float32)
    t = np.array([0.25], np.float32)
    assert redfuser.compile("relu_sum")(x=x, t=t)["s"][0] == pytest.approx(1.0, abs=0.25)


def test_a_later_stage_compares_the_index_with_an_argmax():
    spec = "a = argmax(x[i]); s = sum(where(i == a, x[i], 0))"
    x = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)
    out = redfuser.compile(redfuser.derive(spec, passes="auto"))(x=x)
    np.testing.assert_array_equal(out["s"], x.max(1))


CLAMPED = "mean = sum(x[i]) / N; var = sum((x[i] - mean)**2) / where(N > 1, N - 1, 0)"


@pytest.mark.parametrize("n", [0, 1, 2, 7])
def test_a_clamped_denominator_keeps_ieee_division_by_zero(n):
    """torch's var with correction 1 over max(0, N - 1): 0/0 is NaN at N = 1 and N = 0."""
    x = np.random.default_rng(n).normal(size=(3, n)).astype(np.float32)
    with warnings.catch_warnings():  # torch warns of the zero degrees of freedom
        warnings.simplefilter("ignore", UserWarning)
        want = torch.var(torch.tensor(x, dtype=torch.float64), dim=-1, correction=1).numpy()
    rule = redfuser.derive(CLAMPED)
    for got in (redfuser.reference(CLAMPED, {"x": x})["var"], rule.evaluate({"x": x})["var"],
                redfuser.compile(rule)(x=x)["var"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, equal_nan=True)


def test_a_division_by_a_select_that_can_be_zero_gives_signed_infinities():
    spec = "s = sum(x[i]); r = s / where(s > 100, s, 0)"
    x = np.array([[1.0, 2.0], [-1.0, -2.0], [0.0, 0.0], [60.0, 50.0]], np.float32)
    for out in (redfuser.compile(spec)(x=x)["r"], redfuser.reference(spec, {"x": x})["r"]):
        np.testing.assert_array_equal(out, [np.inf, -np.inf, np.nan, 1.0])


def test_numpy_connectives_join_conditions():
    spec = "r = sum(where({}, x[i], 0))"
    x = np.random.default_rng(1).normal(size=(2, 40)).astype(np.float32)
    pos = np.array([20.0, 30.0], np.float32)
    for numpy_form, python_form in [("(i <= pos) & (i > pos - 8)", "i <= pos and i > pos - 8"),
                                    ("(x[i] > 1) | (x[i] < -1)", "x[i] > 1 or x[i] < -1"),
                                    ("(x[i] > 0) ^ (i < 5)", "(x[i] > 0) != (i < 5)")]:
        inputs = {"x": x, "pos": pos} if "pos" in numpy_form else {"x": x}
        got = redfuser.compile(spec.format(numpy_form))(**inputs)["r"]
        if "!=" in python_form:  # xor: numpy's own, booleans compared as such
            i = np.arange(40)
            want = np.where((x > 0) ^ (i < 5), x, 0).sum(1)
        else:
            want = redfuser.reference(spec.format(python_form), inputs)["r"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec, words", [
    ("r = sum(x[i] & 1)", "'&' joins conditions"),
    ("r = sum(where(x[i] > 0 & x[i] < 1, 1, 0))", "binds tighter than a comparison"),
    ("r = sum(~x[i])", "not the number"),
])
def test_numpy_connectives_on_numbers_are_refused_clearly(spec, words):
    with pytest.raises(redfuser.SpecError) as err:
        redfuser.derive(spec)
    assert words in str(err.value)


def test_causal_attention_never_reads_masked_keys_or_values():
    """The library's masked sums select: NaN in keys and values past pos stays out, and a
    fully masked row gives d = 0 and o = 0/0 = NaN (as its spec computes in numpy)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in [(1, 2, 4), (1, 1, 6, 4),
                                                                (1, 1, 6, 4)])
    k[..., 4:, :] = np.nan
    v[..., 4:, :] = np.nan
    inputs = dict(q=q, k=k, v=v, scale=0.5, pos=np.array([[-1.0, 3.0]], np.float32))
    for out in (redfuser.compile("causal_attention")(**inputs),
                redfuser.reference("causal_attention", inputs)):
        assert out["d"][0, 0] == 0 and np.isnan(out["o"][0, 0]).all()
        assert np.isfinite(out["o"][0, 1]).all()


def test_an_as_written_masked_softmax_is_nan_on_a_fully_masked_row_like_torch():
    spec = ("s = where(mask[i] > 0, x[i], -inf); m = max(s); d = sum(exp(s - m)); "
            "y[i] = exp(s - m) / d")
    x = np.random.default_rng(2).normal(size=(2, 8)).astype(np.float32)
    mask = np.ones((2, 8), np.float32)
    mask[0] = 0
    mask[1, :3] = 0
    want = torch.softmax(torch.tensor(x).masked_fill(torch.tensor(mask) == 0, -np.inf),
                         -1).numpy()
    for out in (redfuser.compile(spec)(x=x, mask=mask), redfuser.reference(spec,
                                                                           dict(x=x, mask=mask))):
        np.testing.assert_allclose(out["y"], want, rtol=1e-5, atol=1e-7, equal_nan=True)


def test_a_rule_with_a_select_of_an_as_written_value_prints():
    """str(rule) simplified a select over as_written(-oo) on sympy's non-commutative path,
    which recursed without end (a select's commutativity was left open)."""
    spec = "s = where(c[i] > 0.5, -inf, x[i]); m = max(s); d = sum(exp(s - m)); " \
           "y[i] = exp(s - m) / d"
    assert "as_written(-oo)" in str(redfuser.derive(spec))
