"""Backward cascades (``algebra.backward``): the library's prove, refusals name the value
and the reason, the prover catches a wrong gradient, and the kernels of generated
backward cascades match central differences of the float64 oracle (not the code under
test: ``redfuser.reference`` of the forward spec, differentiated numerically).

Tolerance of the property test: the backward kernel computes in float32 from float32
inputs (a few roundings relative to the gradient's scale per row) and the central
difference in float64 with step h ~ 1e-5 (truncation ~h**2 times a third derivative of
O(1) cascades): 2e-3 of the row's largest gradient, plus 2e-3 absolute, holds both with
room.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import redfuser
from algebra import NoBackward, derive
from algebra.backward import REFUSALS, written
from algebra.backward_proof import is_zero
from algebra.spec import parse
from tests.support import cascade_inputs, cascades, examples, rule_for

# (softmax_moments proves too, in ~7 s: its three levels make the N = 3 proof the slowest)
PROVEN = ("softmax", "log_softmax", "logsumexp", "cross_entropy", "layernorm", "rmsnorm",
          "l2_normalize", "variance")
# library cascade -> the start of the reason its backward is refused
REFUSED = {
    "attention": "result o is a feature vector",
    "causal_attention": "result o is a feature vector",
    "rmsnorm_gemm": "result y is a feature vector",
    "softmin_average": "result y is a feature vector",
    "moe_routing": "p = topk(...) selects elements",
    "greedy_token": "p = max(...) selects elements",
    "geometric_mean": "g_prod = prod(...): only sum reductions",
}
STEP = 1e-5
TOL = 2e-3


@pytest.mark.parametrize("name", PROVEN)
def test_library_backwards_are_derived_and_proven(name):
    b = derive(name).backward()
    assert b.proven, str(b)
    assert b.proofs and all(ok for _, ok in b.proofs)
    assert set(b.saved) <= set(parse(b.forward_spec).outputs)  # the forward returns them
    assert "x" in b.gradients  # every one of these differentiates its stream


@pytest.mark.parametrize("name,reason", sorted(REFUSED.items()))
def test_refused_backwards_name_the_value_and_the_reason(name, reason):
    with pytest.raises(NoBackward, match=f"^{reason.replace('(', '[(]').replace(')', '[)]')}"):
        derive(name).backward()


def test_an_index_output_is_refused_by_name():
    with pytest.raises(NoBackward, match="token is an index"):
        derive("greedy_token").backward(outputs=("token",))
    assert "index" in REFUSALS


def test_what_the_forward_saves_is_derived():
    """softmax keeps m and d (y is recomputed from them); log_softmax keeps its hidden sum,
    which the written forward names."""
    assert derive("softmax").backward().saved == ("d", "m")
    b = derive("log_softmax").backward()
    assert b.saved == ("lse_sum", "m") and "lse_sum = sum(" in b.forward_spec
    x = np.random.default_rng(0).normal(size=(3, 7))
    ours, theirs = redfuser.reference(b.forward_spec, {"x": x}), redfuser.reference(
        "log_softmax", {"x": x})
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-12)


def test_the_prover_tells_a_wrong_gradient_from_a_right_one():
    x, m, d = sp.symbols("x m d", real=True)
    assert is_zero(sp.exp(x - m) / d - sp.exp(x) * sp.exp(-m) / d)
    assert not is_zero(sp.exp(x - m) / d - sp.exp(x - m) / d ** 2)
    assert is_zero(x / sp.Abs(x) - sp.sign(x))  # where the derivative exists


def test_written_forward_round_trips_through_the_parser():
    for name in PROVEN:
        cascade = derive(name).cascade
        again = parse(written(cascade))
        assert set(cascade.outputs) <= set(again.outputs)


def _loss(spec: str, inputs: dict, upstream: dict) -> float:
    ref = redfuser.reference(spec, inputs)
    return float(sum(np.sum(upstream[o] * ref[o]) for o in upstream))


def _central_differences(spec: str, inputs: dict, upstream: dict, name: str) -> np.ndarray:
    base = {k: np.asarray(v, np.float64) for k, v in inputs.items()}
    out = np.zeros_like(base[name])
    for idx in np.ndindex(out.shape):
        h = STEP * max(1.0, abs(base[name][idx]))
        plus, minus = dict(base), dict(base)
        plus[name], minus[name] = base[name].copy(), base[name].copy()
        plus[name][idx] += h
        minus[name][idx] -= h
        out[idx] = (_loss(spec, plus, upstream) - _loss(spec, minus, upstream)) / (2 * h)
    return out


@settings(max_examples=examples(0.4), deadline=None,
          suppress_health_check=[HealthCheck.filter_too_much])
@given(specs=cascades(), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6))
def test_generated_backward_kernels_match_differences_of_the_oracle(specs, seed, n):
    spec, _ = specs
    try:
        rule = rule_for(spec)
        assume(isinstance(rule, redfuser.FusionRule))
        b = rule.backward()
    except (redfuser.NotFusable, redfuser.SpecError, NoBackward):
        assume(False)  # refused by the forward engine, or a backward the engine refuses
    assume(b.proven and not b.is_map)
    rng = np.random.default_rng(seed)
    inputs = cascade_inputs(rule, rng, (2,), n, d=3)
    forward = redfuser.reference(b.forward_spec, inputs)
    upstream = {o: rng.normal(size=forward[o].shape) for o in b.upstream}
    assume(all(np.isfinite(forward[o]).all() for o in b.upstream))
    grads = redfuser.compile(b.spec, tune=False)(
        **inputs, **{s: forward[s].astype(np.float32) for s in b.saved},
        **{g: upstream[o].astype(np.float32) for o, g in b.upstream.items()})
    for name, (grad, _) in b.gradients.items():
        want = _central_differences(spec, inputs, upstream, name)
        got = np.asarray(grads[grad], np.float64).reshape(want.shape)
        scale = np.max(np.abs(want), axis=-1, keepdims=True)
        bad = ~(np.abs(got - want) <= TOL * (1 + scale))
        assert not bad.any(), f"{spec!r}: {grad} = {got[bad]}, differences {want[bad]}"
