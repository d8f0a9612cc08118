"""The engine's own names (the count, state columns, ``<r>_best``, hidden results, the anchor
points of its proofs) never equal a name of the spec: rules, their numpy run and their kernels
compute what the float64 reference computes whatever the user calls things.

Regression tests of the repros ``name_collisions.py`` (user names ``n``, ``var_sum_1``,
``j_best``, ``t_max``, a result called ``n``) and the ``u`` case of ``misleading_reasons.py``.
Tolerance: rtol 1e-5 / atol 1e-5 (float32 sums of 7 unit-scale elements plus an exactly
representable 100: a few float32 ulps of 100); before the fix the values were off by 100.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from hypothesis import given
from hypothesis import strategies as st

import redfuser
from algebra.spec import parse
from tests.support import rule_for, schedules

X = np.random.default_rng(0).normal(size=(2, 7)).astype(np.float32)
X64 = X.astype(np.float64)

# (spec, inputs, output, numpy truth computed independently in float64)
CASES = [
    ("mean = sum(x[i]) / N; var = sum((x[i] - mean)**2) / N + n", {"x": X, "n": 100.0}, "var",
     X64.var(axis=-1) + 100),
    ("mean = sum(x[i]) / N; var = sum((x[i] - mean)**2) / N + var_sum_1",
     {"x": X, "var_sum_1": 100.0}, "var", X64.var(axis=-1) + 100),
    ("j = argmax(x[i]); j_best = min(x[i])", {"x": X}, "j", X64.argmax(axis=-1)),
    ("j = argmax(x[i]); j_best = min(x[i])", {"x": X}, "j_best", X64.min(axis=-1)),
    ("t = max(x[i]) + t_max", {"x": X, "t_max": 5.0}, "t", X64.max(axis=-1) + 5),
    ("n = sum(x[i]); v = sum((x[i] - n / N)**2)", {"x": X}, "n", X64.sum(axis=-1)),
    ("n = sum(x[i]); v = sum((x[i] - n / N)**2)", {"x": X}, "v", X64.var(axis=-1) * 7),
    ("u = max(x[i]); t = max(exp(x[i] - u))", {"x": X}, "t", np.ones(2)),
    ("m = max(x[i]); d = sum(exp(x[i] - m) * m_1 + m_0)", {"x": X, "m_1": 2.0, "m_0": 1.0}, "d",
     2 * np.exp(X64 - X64.max(axis=-1, keepdims=True)).sum(axis=-1) + 7),
    ("m = max(x[i]); s = sum(x[i] - m); s_1 = sum((x[i] - s)**2)", {"x": X}, "s_1",
     ((X64 - (X64 - X64.max(-1, keepdims=True)).sum(-1, keepdims=True)) ** 2).sum(-1)),
]


@pytest.mark.parametrize(("spec", "inputs", "name", "truth"), CASES)
def test_user_names_equal_to_engine_names_compute_the_reference(spec, inputs, name, truth):
    rule = redfuser.derive(spec)
    assert rule.verify()
    ref = redfuser.reference(spec, inputs)[name]
    np.testing.assert_allclose(ref, truth, rtol=1e-12, atol=1e-12)  # the oracle is right too
    fused = rule.evaluate(inputs, chunks=[3, 4])[name]
    kernel = redfuser.compile(spec)(**inputs)[name]
    for got in (fused, kernel):
        np.testing.assert_allclose(got.astype(np.float64), truth, rtol=1e-5, atol=1e-5)


def _invented(rule) -> set[str]:
    """Every name the engine made: state symbols not named after their own reduction, and
    the symbols its proof obligations introduce."""
    own = {r.name for r in rule.cascade.reductions}
    names = {s.symbol.name for s in rule.state} - own
    for o in rule.obligations:
        for side in (o.lhs, o.rhs):
            if isinstance(side, sp.Basic):
                names |= {s.name for s in side.free_symbols}
    spec_symbols = {s.name for s in (*rule.cascade.streams, *rule.cascade.params)} | own | {
        *rule.cascade.epilogues, "N", "i"}
    return names - spec_symbols


@pytest.mark.parametrize("spec", [c[0] for c in CASES] + [
    "m = max(x[i]); m_0 = sum(exp(x[i] - m)); m_2 = sum(exp(x[i] - m) * (x[i] - m_1))",
    "d = sum(x[i]); d_count = sum(where(x[i] > 0, exp(x[i] - d), 0)) + d_count_",
    "n = sum(x[i]); n_ = sum((x[i] - n)**2); n__ = prod(x[i] / n_)",
])
def test_invented_names_are_fresh(spec):
    rule = redfuser.derive(spec)
    taken = parse(spec).names
    clash = {n for n in _invented(rule) if n in taken}
    assert not clash, f"engine names equal spec names: {clash}"
    assert rule.count.name not in taken


def test_count_is_renamed_only_when_the_spec_uses_n():
    assert redfuser.derive("variance").count.name == "n"
    rule = redfuser.derive("n = sum(x[i]); v = sum((x[i] - n / N)**2)")
    assert rule.count.name == "n_"
    assert "finalize (n_ = N)" in str(rule)


def test_hidden_results_are_fresh_against_names_read_later():
    cascade = parse("t = max(x[i]) + t_max + max(y[i])")
    assert [r.name for r in cascade.reductions] == ["t_max_", "t_max__"]
    assert {p.name for p in cascade.params} == {"t_max"}


# names the engine would invent for the template below (count, columns, hidden, proof points)
ENGINE_LIKE = ("n", "n_", "u", "d", "d_1", "d_2", "d_count", "m_0", "m_1", "m_2", "v_sum",
               "v_sum_1", "v_sum_2", "j_best", "t_max", "m_L")


@given(names=st.permutations(ENGINE_LIKE), sched=schedules(6))
def test_any_engine_like_names_compute_the_numpy_truth(names, sched):
    """Results, parameters and outputs named like engine names, in any combination."""
    d, p, q, j = names[:4]
    spec = (f"m = max(x[i]); {d} = sum(exp(x[i] - m)); {j} = argmax(x[i] * {p}); "
            f"v = sum((x[i] - {d} / N)**2 * {p}) / N + {q}")
    inputs = {"x": X[:, :6], p: 2.0, q: 100.0}
    out = rule_for(spec).evaluate(inputs, chunks=sched[0], tree=sched[1])
    x = X64[:, :6]
    dv = np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
    np.testing.assert_allclose(out[d], dv[:, 0], rtol=1e-5)
    np.testing.assert_array_equal(out[j], x.argmax(-1))
    np.testing.assert_allclose(out["v"], ((x - dv / 6) ** 2 * 2).mean(-1) + 100, rtol=1e-5)


def test_stash_tile_anchor_is_fresh_against_a_parameter_named_like_it():
    spec = "m = max(x[i]); d = sum(exp(x[i] - m)); y[i] = exp(x[i] - m) / d * m_t"
    rule = redfuser.derive(spec)
    stash = rule.stashes["y"]
    assert {s.name for s in stash.factor.free_symbols} == {"m", "m_t", "m_t_", "d"}
    assert stash.obligation.check()
    x = np.random.default_rng(1).normal(size=(3, 500)).astype(np.float32)
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    truth = e / e.sum(-1, keepdims=True) * 5
    out = redfuser.compile(rule)(x=x, m_t=5.0)["y"]
    np.testing.assert_allclose(out, truth, rtol=1e-5, atol=1e-7)
