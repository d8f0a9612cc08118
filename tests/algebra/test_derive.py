"""Rule families: what the engine derives for each, and that it refuses what it cannot prove."""

import numpy as np
import pytest
import sympy as sp

import redfuser
from algebra.components import LinearComponent, SelectComponent
from algebra.prove import Obligation, is_zero


def lines(rule, which="update"):
    return {str(k): str(v) for k, v in getattr(rule, f"{which}_lines")()}


def test_softmax_is_the_online_rescale():
    rule = redfuser.derive("softmax")
    up = lines(rule)
    assert up["m'"] == "max(m, x)"
    assert up["d'"] == "d*exp(m - m') + exp(-m' + x)"
    assert lines(rule, "merge")["d"] == "d_L*exp(-m + m_L) + d_R*exp(-m + m_R)"
    assert [s.init for s in rule.state] == [-sp.oo, 0]
    assert "rank-1 re-anchoring" in rule.components[1].case


def test_attention_divides_once_at_the_end():
    rule = redfuser.derive("attention")
    assert "exp(m - m')" in lines(rule)["o_sum'"]
    assert lines(rule, "finalize")["o"] == "o_sum/d"
    assert rule.outputs == ("m", "d", "o")


def test_variance_is_anchored_not_a_sum_of_squares():
    rule = redfuser.derive("variance")
    var = rule.components[1]
    assert isinstance(var, LinearComponent) and var.matrix.shape == (3, 3)
    assert [str(b) for b in var.basis] == ["(-mean + x)**2", "-mean + x", "1"]
    # upper-triangular binomial shift: only the anchor difference appears
    assert var.matrix[0, 2] == (sp.Symbol("mean'", real=True) - sp.Symbol("mean", real=True)) ** 2
    assert "x**2" not in str(rule)
    assert lines(rule, "finalize")["var"] == "var_sum/n"


def test_anchor_power_stays_in_the_state_other_factors_move_to_finalize():
    """A power of an anchor (1/d) is kept: the state is the spec's own normalised sum,
    re-anchored by the ratio d/d' (repro normalised_overflow.py); a factor with other zeros
    or poles (1/(d + 1)) moves to finalize."""
    rule = redfuser.derive("m = max(x[i]); d = sum(exp(x[i] - m)); "
                           "o = sum(exp(x[i] - m) / d * v[i])")
    comp = rule.components[2]
    d, m = sp.Symbol("d", positive=True), sp.Symbol("m", real=True)
    assert comp.finalize == sp.Symbol("o", real=True)
    assert sp.simplify(comp.matrix[0, 0] - d * sp.exp(m - sp.Symbol("m'", real=True))
                       / sp.Symbol("d'", positive=True)) == 0
    assert "1/d kept in the state" in comp.case and comp.guards == {"d"}
    moved = redfuser.derive("m = max(x[i]); d = sum(exp(x[i] - m)); "
                            "o = sum(exp(x[i] - m) / (d + 1) * v[i])").components[2]
    assert moved.finalize == sp.Symbol("o", real=True) / (d + 1)
    assert "1/(d + 1) applied at finalize" in moved.case and not moved.guards


def test_finite_rank_two_for_entropy():
    rule = redfuser.derive("softmax_entropy")
    h = rule.components[2]
    assert h.matrix.shape == (2, 2) and h.matrix[1, 0] == 0


def test_three_level_chain_depends_on_three_anchors():
    rule = redfuser.derive("softmax_moments")
    var = rule.components[-1]
    assert {a.name for a in var.anchors} == {"m", "d", "mu"}
    assert var.matrix.shape == (3, 3)


def test_monotone_commutation_removes_the_dependence():
    rule = redfuser.derive("moe_routing")
    p, e = rule.components[2], rule.components[3]
    assert isinstance(p, SelectComponent) and str(p.core) == "x"
    assert "strictly increasing" in p.case and "disappears" in p.case
    assert str(p.finalize) == "exp(-m + p)/d"
    assert e.state[1].kind == "indices_k"


def test_decreasing_body_swaps_the_direction():
    rule = redfuser.derive("d = sum(exp(x[i])); r = max(1 / (d + exp(x[i]))); "
                           "a = argmax(1 / (d + exp(x[i])))")
    r = rule.components[1]
    assert str(r.core) == "exp(x)" and r.direction == -1 and "direction swapped" in r.case
    x = np.array([[3.0, -1.0, 2.0, -1.0]])
    out = rule.evaluate({"x": x}, chunks=[1, 3])
    ref = redfuser.reference(rule.cascade, {"x": x})
    assert out["r"][0] == pytest.approx(ref["r"][0])
    assert out["r"][0] == pytest.approx(1 / (out["d"][0] + np.exp(-1)))
    assert out["a"][0] == ref["a"][0] == 1  # first of the tied minima of x


def test_non_strict_monotone_allowed_for_values_only():
    redfuser.derive("m = max(x[i]); r = max(relu(x[i] - m))")
    with pytest.raises(redfuser.NotFusable, match="strictly monotone"):
        redfuser.derive("m = max(x[i]); r = argmax(relu(x[i] - m))")


def test_product_is_a_log_sum_and_a_sign_product():
    """prod(C(a) G(x)) = prod(sign G) * sign(C)**n * exp(sum(log|C G|)): the log-sum is
    re-anchored like any sum, so exp(x - m) stays exp(sum(x - m)) (repro prod_nan.py)."""
    rule = redfuser.derive("m = max(x[i]); p = prod(exp(x[i] - m) * x[i])")
    sign, log = rule.components[1], rule.components[2]
    assert str(sign.factor) == "sign(x)" and sign.reduction.name == "p"
    assert "log-domain product" in log.case and "re-anchoring" in log.case
    assert str(log.basis[0]) == "-m + x + log(Abs(x))"
    assert str(rule.running["p"]) == "p.sign*exp(p.log)"
    assert all(rule.status) and rule.verify()
    assert any(o.name == "p: polar form of x" for o in rule.obligations)


@pytest.mark.parametrize(("spec", "culprit"), [
    ("m = max(x[i]); r = sum(relu(x[i] - m))", "relu(-m + x)"),
    ("a = sum(x[i]); r = sum(round(x[i] / a))", "round(x/a)"),
    ("m = max(x[i]); r = sum(1 / (x[i] - m))", "1/(-m + x)"),
    ("m = max(x[i]); r = sum(exp(x[i] * m))", "exp(m*x)"),
    ("m = max(x[i]); r = max((x[i] - m)**2)", "(-m + x)**2"),
    ("m = max(x[i]); r = max(x[i] * m + y[i])", "m*x + y"),
    ("m = max(x[i]); r = prod(x[i] - m)", "-m + x"),
    ("mu = sum(x[i]) / N; v = sum((x[i] - mu)**30)", "(-mu + x)**30"),
])
def test_not_fusable_names_reduction_culprit_and_reason(spec, culprit):
    with pytest.raises(redfuser.NotFusable) as err:
        redfuser.derive(spec)
    msg = str(err.value)
    assert msg.startswith(f"reduction '{spec.split(';')[-1].split('=')[0].strip()}'"), msg
    assert f"`{culprit}`" in msg
    assert err.value.why


def test_obligations_fail_rather_than_pass_when_sympy_cannot_reduce():
    x, m0, m1 = sp.symbols("x m0 m1", real=True)
    assert not Obligation("wrong", "", sp.exp(x - m1), sp.exp(x - m0)).check()
    assert not is_zero(sp.sin(x) ** 2 + sp.cos(x) ** 2 - 1 + sp.Symbol("eps"))
    assert not Obligation("sign", "", x - m0, sign="positive").check()  # undecidable is a failure
    assert Obligation("sign", "", sp.exp(x), sign="positive").check()


@pytest.mark.parametrize("name", list(redfuser.LIBRARY))
def test_every_library_rule_is_proven_and_verifies(name):
    rule = redfuser.derive(name)
    assert all(rule.status) and rule.verify()
    assert rule.name == name
    assert rule.to_latex() and rule.to_json()
    assert "obligations proven" in str(rule)


def test_an_index_commutes_with_a_power_whose_derivative_vanishes_only_at_a_point():
    """argmax((x - m)**3) = argmax(x): 3*(x - m)**2 >= 0 is 0 only at x = m, so the order
    stays strict; the rule proves both facts.  (x - m)**2 and m*(x - m)**3 (m may be 0) are
    refused."""
    rule = redfuser.derive("m = max(x[i])\np = argmax((x[i] - m)**3)")
    names = [o.name for o in rule.obligations]
    assert "p: isolated zeros" in names and rule.verify()
    x = np.array([[0.5, -2.0, 3.0, 3.0, 1.0]], np.float32)
    assert redfuser.compile(rule, tune=False)(x=x)["p"][0] == 2
    for body in ("(x[i] - m)**2", "m*(x[i] - m)**3"):
        with pytest.raises(redfuser.NotFusable, match="not provably strictly monotone"):
            redfuser.derive(f"m = max(x[i])\np = argmax({body})")
