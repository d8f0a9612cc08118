"""Backwards of staged cascades (``StagedRule.backward``, ``algebra.stages_backward``): the
whole cascade's backward, derived and proven as a one-pass rule's, with its forward and
backward specs derived in stages; the proof tells the chain through an earlier stage's final
from a gradient without it; the kernels it compiles to match central differences of the
float64 oracle (not the code under test).  Tolerance as tests/algebra/test_backward.py's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import sympy as sp

import redfuser
from algebra.adjoint import RowSum
from algebra.backward_proof import prove
from algebra.library import STAGED
from algebra.spec import parse
from tests.support import central_differences

BACKWARD_SECONDS = 2.0  # each library backward derives in well under this (measured < 0.6 s)
STEP = 1e-5
TOL = 2e-3


@pytest.mark.parametrize("name", sorted(STAGED))
def test_staged_library_backwards_are_derived_proven_and_fast(name):
    rule = redfuser.derive(name)
    start = time.perf_counter()
    b = rule.backward()
    elapsed = time.perf_counter() - start
    assert elapsed < BACKWARD_SECONDS, f"{name}'s backward took {elapsed:.2f} s"
    assert b.proven and rule.backward() is b  # derived once a rule
    assert set(b.saved) <= set(parse(b.forward_spec).outputs)
    saved_by_pass = [set(b.saved) & set(results) for results in b.forward_passes]
    assert len(b.forward_passes) == rule.passes and set().union(*saved_by_pass) == set(b.saved)
    assert str(b).startswith(f"staged forward ({rule.passes} passes)")
    assert "the backward spec runs in one pass over the stream" in str(b)


def test_mads_backward_reverses_through_the_mean_and_keeps_sign():
    """abs'(u) = sign(u) as torch's (sign(0) = 0), never sympy's Piecewise of u / |u| (which
    no select case fixes: an unproven gradient after 38 s); the mean's adjoint is a sum over
    the row, the stream's gradients add; the forward saves mu alone."""
    b = redfuser.derive("mad").backward()
    assert b.spec.splitlines() == ["g_mu_sum = sum(dmad*sign(mu - x[i])/N**2)",
                                   "dx[i] = g_mu_sum - dmad*sign(mu - x[i])/N"]
    assert b.saved == ("mu",) and b.forward_spec == redfuser.derive("mad").cascade.text
    assert "forward pass 1 computes mu_sum, mu; saves mu" in str(b)


def test_the_proof_tells_the_chain_through_an_earlier_final_from_a_gradient_without_it():
    """mad's dx without mu's adjoint (the later stage's backward alone) fails the proof."""
    b = redfuser.derive("mad").backward()
    c = b.forward
    sym = {s.name: s for r in c.reductions for s in r.body.free_symbols}
    g = sp.Symbol("g_mu_sum", real=True)
    line = ("g_mu_sum", RowSum(parse(b.spec).reductions[0].body))
    right = b.maps["dx"]
    for form, holds in ((right, True), (right.subs(g, 0), False)):
        proofs = prove(c, sym, [line], {"mad": sp.Symbol("dmad", real=True)}, {}, [],
                       [(c.streams[0], "dx", form)], {}, [])
        assert all(ok for _, ok in proofs) is holds


def test_a_selection_and_a_learned_parameter_of_a_staged_cascade():
    """relu_sum: its max is differentiated at its selection (the forward's first pass
    gains m_at = argmax), t gets dt, a sum of the second pass's condition."""
    b = redfuser.derive("relu_sum").backward()
    assert b.saved == ("m", "m_at") and "m_at = argmax(x[i])" in b.forward_spec
    assert b.forward_passes == (("m", "m_at"), ("s",))
    assert set(b.gradients) == {"x", "t"} and "dt = sum(" in b.spec


# a relu of x - v where v is itself a sum of relus: the proof splits the relu inside the
# later condition, and the backward spells that condition v < x[i] where the loss has x - v > 0
NESTED_KINKS = "mu = sum(x[i]) / N\nv = sum(relu(x[i] - mu))\nw = sum(relu(x[i] - v))"


def test_the_proof_of_nested_kinks_tells_a_wrong_gradient_from_a_right_one():
    """The nested cascade's backward is proven (1.6 s alone: a user's, not held to the
    library's 2 s); its dx without the chain through v (g_v's terms) fails."""
    b = redfuser.derive(NESTED_KINKS, passes="auto").backward()
    assert b.proven
    c = b.forward
    sym = {s.name: s for r in c.reductions for s in r.body.free_symbols}
    lines = [(r.name, RowSum(r.body)) for r in parse(b.spec).reductions]
    right = b.maps["dx"]
    g_v = next(s for s in right.free_symbols if s.name == "g_v")
    for form, holds in ((right, True), (right.subs(g_v, 0), False)):
        proofs = prove(c, sym, lines, {"w": sp.Symbol("dw", real=True)}, {}, [],
                       [(c.streams[0], "dx", form)], {}, [])
        assert all(ok for _, ok in proofs) is holds


@pytest.mark.parametrize("spec", [
    "m = max(x[i])\nr = sum(abs(x[i] - p) * exp(x[i] - m))",  # one pass: sign kept too
    "mu = sum(x[i]) / N\nv = sum(relu(x[i] - mu + p))",  # a user's staged spec
])
def test_user_specs_with_kinks_are_proven(spec):
    rule = redfuser.derive(spec, passes="auto")
    start = time.perf_counter()
    assert rule.backward().proven
    assert time.perf_counter() - start < BACKWARD_SECONDS


@pytest.mark.parametrize("name", sorted(STAGED))
def test_staged_backward_kernels_match_differences_of_the_oracle(name):
    """The staged forward (its saved values as outputs) and the backward spec compiled as
    any spec, their gradients against central differences of the float64 oracle."""
    b = redfuser.derive(name).backward()
    rng = np.random.default_rng(7)
    inputs = {"x": rng.normal(size=(3, 11)).astype(np.float32)}
    if "t" in redfuser.derive(name).cascade.names:
        inputs["t"] = np.full(3, 0.6 if name == "relu_sum" else 0.08, np.float32)  # per row
    forward = redfuser.compile(redfuser.derive(b.forward_spec, passes="auto"), tune=False)(
        **inputs)
    upstream = {o: rng.normal(size=forward[o].shape) for o in b.upstream}
    given = inputs | {s: np.asarray(forward[s], np.float32) for s in b.saved} | {
        g: upstream[o].astype(np.float32) for o, g in b.upstream.items()}
    for s in b.selections:  # relu_sum's max: the upstream 1 at the saved argmax
        given[s.selector] = np.eye(11, dtype=np.float32)[given[s.index].astype(int)]
    kernel = redfuser.compile(b.spec, tune=False)
    reads = {v.name for v in (*kernel.rule.cascade.streams, *kernel.rule.cascade.params)}
    grads = kernel(**{k: v for k, v in given.items() if k in reads})
    for input_name, (grad, _) in b.gradients.items():
        want = central_differences(redfuser.derive(name).cascade.text, inputs, upstream,
                                   input_name, STEP)
        got = np.asarray(grads[grad], np.float64).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * (1 + np.abs(want).max()))
