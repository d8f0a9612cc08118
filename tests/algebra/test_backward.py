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

import re

import numpy as np
import pytest
import sympy as sp
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import redfuser
from algebra import NoBackward, derive
from algebra.adjoint import RowSum
from algebra.backward import REFUSALS, written
from algebra.backward_proof import Unrolled, is_zero, prove
from algebra.backward_selections import rewritten
from algebra.backward_shared import shared_sums
from algebra.functions import Dot, Where
from algebra.library import LIBRARY
from algebra.spec import parse
from tests.support import cascade_inputs, cascades, central_differences, examples, rule_for

PROVEN = ("softmax", "log_softmax", "logsumexp", "cross_entropy", "layernorm", "rmsnorm",
          "l2_normalize", "variance", "softmax_moments", "attention", "causal_attention",
          "rmsnorm_gemm", "softmin_average", "linear_cross_entropy", "moe_routing",
          "greedy_token", "softmax_entropy", "geometric_mean",
          "mad", "relu_sum", "threshold_mass")  # the last three staged (test_staged.py)
STEP = 1e-5
TOL = 2e-3


@pytest.mark.parametrize("name", PROVEN)
def test_library_backwards_are_derived_and_proven(name):
    b = derive(name).backward()
    assert b.proven, str(b)
    assert b.proofs and all(ok for _, ok in b.proofs)
    assert set(b.saved) <= set(parse(b.forward_spec).outputs)  # the forward returns them
    streams = {s.name for s in b.forward.streams}
    assert streams <= set(b.gradients)  # every one of these differentiates its streams


def test_attention_backward_is_flash_attentions():
    """What FlashAttention-2's backward does by hand comes out of the derivation: the
    forward keeps m, d and o (not the N x N probabilities); delta = dot(do, o) per row; dq
    is a sum over the keys in the rows' orientation; dk and dv are sums over the queries,
    written with the queries as the stream (one kernel per key row: deterministic); the
    learnable scale gets its gradient too; every one proven at two features."""
    b = derive("causal_attention").backward()
    assert b.saved == ("d", "m", "o") and b.dots == {"delta": ("do", "o")}
    assert {n: g for n, (g, _) in b.gradients.items()} == {
        "q": "dq", "scale": "dscale", "k": "dk", "v": "dv"}
    assert "other orientation" in b.gradients["k"][1] and "per row" in b.gradients["q"][1]
    assert b.spec.startswith("dq = sum(") and b.columns.startswith("dk = sum(")
    assert "q[i, :]" in b.columns and "pos[i]" in b.columns and "at <= pos[i]" in b.columns
    assert b.column_params == {"at": "position"} and "pos" in b.zero
    assert b.proven and sum("2 features" in what for what, _ in b.proofs) == 6
    assert "spec in the other orientation" in str(b)


def test_the_component_proof_tells_a_wrong_vector_gradient_from_a_right_one():
    """dv[i, :] = do * exp(s_i - m) / d proves at two features; without the / d it fails."""
    c = parse(LIBRARY["attention"][0])
    sym = {s.name: s for r in c.reductions for s in r.body.free_symbols}
    do, delta = sp.Symbol("do", real=True), sp.Symbol("delta", real=True)
    u = Unrolled(c, sym, [], {"o": do}, {"o": (do, delta)}, 2, {"m"})
    q, k, v, m, scale = (sym[n] for n in ("q", "k", "v", "m", "scale"))
    d = next(r.symbol for r in c.reductions if r.name == "d")
    right = do * sp.exp(scale * Dot(q, k) - m) / d
    for j in range(2):
        got = u.gradient(u.loss(), u.element(v, j))
        assert all(is_zero(g - w) for g, w in zip(got, u.at(right, j), strict=True))
        assert not all(is_zero(g - w) for g, w in zip(got, u.at(right * d, j), strict=True))


def test_a_selection_routes_its_upstream_to_the_elements_the_forward_selected():
    """moe_routing: dx = y * (sel - dot(dp, p)), sel the upstream scattered to the saved
    argtopk (the spec's own e); greedy_token: its max probability needs an argmax over the
    same body, which the forward gains (token's body differs); proven on every choice."""
    b = derive("moe_routing").backward()
    (s,) = b.selections
    assert (s.selector, s.index, s.upstream, s.adds_index) == ("sel_p", "e", "dp", False)
    assert b.saved == ("d", "e", "m", "p") and not b.is_map and "sel_p[i]" in b.spec
    assert str(b.maps["dx"]) == "(-delta_p + sel_p)*exp(-m + x)/d"
    assert "each of the 6 choices of p" in str(b)
    g = derive("greedy_token").backward()
    assert g.selections[0].index == "p_at" and g.selections[0].adds_index
    assert "p_at = argmax(" in g.forward_spec and g.proven


def test_the_proof_of_a_selection_tells_a_wrong_gradient_from_a_right_one():
    """moe_routing's dx without its -dot(dp, p) term (the softmax's own Jacobian) fails."""
    b = derive("moe_routing").backward()
    c = rewritten(b.forward, b.selections)
    sym = {s.name: s for r in c.reductions for s in r.body.free_symbols}
    right = b.maps["dx"]
    wrong = right.subs(sp.Symbol("delta_p", real=True), 0)
    for form, holds in ((right, True), (wrong, False)):
        proofs = prove(c, sym, [], {"p": sp.Symbol("dp", real=True)}, {}, ["m"],
                       [(c.streams[0], "dx", form)], {}, [], b.selections)
        assert all(ok for _, ok in proofs) is holds


def test_an_index_output_is_refused_by_name():
    with pytest.raises(NoBackward, match="token is an index"):
        derive("greedy_token").backward(outputs=("token",))
    assert "index" in REFUSALS


def test_what_the_forward_saves_is_derived():
    """softmax keeps d and its output y (read, not recomputed: the forward is unchanged);
    log_softmax keeps its hidden sum, which the written forward names."""
    b = derive("softmax").backward()
    assert b.saved == ("d", "y") and b.forward_spec == b.forward.text
    b = derive("log_softmax").backward()
    assert b.saved == ("lse_sum", "m") and "lse_sum = sum(" in b.forward_spec
    x = np.random.default_rng(0).normal(size=(3, 7))
    ours, theirs = redfuser.reference(b.forward_spec, {"x": x}), redfuser.reference(
        "log_softmax", {"x": x})
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-12)


def test_a_differentiated_output_is_read_where_that_saves_a_transcendental():
    """softmax's backward reads y for exp(x - m) / d (no exp, no x: torch's dx = y * (dy -
    sum(dy * y))), also where only part of a term matches (y and d differentiated: g_d *
    exp(x - m) is g_d * d * y); differentiating d alone, y is recomputed."""
    b = derive("softmax").backward()
    assert b.outputs_read == ("y",) and b.per_element == {"x", "dy", "y"}
    assert b.spec.splitlines() == ["g_d = sum(-dy[i]*y[i]/d)", "dx[i] = y[i]*(d*g_d + dy[i])"]
    assert "y: the forward's output, saved (no recompute)" in str(b) and b.proven
    both = derive("softmax").backward(outputs=("y", "d"))
    assert both.outputs_read == ("y",) and "exp(" not in both.spec and both.proven
    alone = derive("softmax").backward(outputs=("d",))
    assert alone.outputs_read == () and "exp(-m + x[i])" in alone.spec and alone.proven


@pytest.mark.parametrize("name", ["l2_normalize", "rmsnorm", "layernorm", "log_softmax"])
def test_an_output_that_saves_no_transcendental_nor_work_is_recomputed(name):
    """l2_normalize's y = x / r and rmsnorm's x * g / r: dx reads x anyway, so y would be
    one more stream for one product; layernorm's and log_softmax's y appear in no line."""
    b = derive(name).backward()
    assert b.outputs_read == () and "y" not in b.saved and not re.search(r"\by\[i\]", b.spec)


def test_the_proof_unrolls_a_read_output_as_its_definition():
    """softmax's dx = y * (dy - sum(dy * y)) proves with y its closed form; without the
    sum it does not."""
    c = parse(LIBRARY["softmax"][0])
    x, (m, d) = c.streams[0], (r.symbol for r in c.reductions)
    y, dy, g = (sp.Symbol(n, real=True) for n in ("y", "dy", "g"))
    lines = [("g", RowSum(dy * y))]
    for form, holds in ((y * (dy - g), True), (y * dy, False)):
        proofs = prove(c, {"x": x, "m": m, "d": d}, lines, {"y": dy}, {}, ["m"],
                       [(x, "dx", form)], {}, [])
        assert len(proofs) == 4 and all(ok for _, ok in proofs) is holds


def test_a_backward_kernel_reading_outputs_matches_differences_of_the_oracle():
    """e = exp(x - m) and y = x / d both read (no exp, no x in the backward), given the
    forward oracle's outputs, against central differences of the oracle."""
    spec = "m = max(x[i])\nd = sum(exp(x[i] - m))\ne[i] = exp(x[i] - m)\ny[i] = x[i] / d"
    b = derive(spec).backward()
    assert b.outputs_read == ("e", "y") and not re.search(r"exp\(|\bx\[i\]", b.spec)
    rng = np.random.default_rng(4)
    inputs = {"x": rng.normal(size=(3, 7)).astype(np.float32)}
    forward = redfuser.reference(b.forward_spec, inputs)
    upstream = {o: rng.normal(size=forward[o].shape) for o in b.upstream}
    given = {s: forward[s].astype(np.float32) for s in b.saved} | {
        g: upstream[o].astype(np.float32) for o, g in b.upstream.items()} | _selectors(
        b, forward, upstream, 7)
    kernel = redfuser.compile(b.spec, tune=False)
    reads = {s.name for s in (*kernel.rule.cascade.streams, *kernel.rule.cascade.params)}
    got = np.asarray(kernel(**{k: v for k, v in given.items() if k in reads})["dx"])
    want = central_differences(spec, inputs, upstream, "x", STEP)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * (1 + np.abs(want).max()))


def test_the_prover_tells_a_wrong_gradient_from_a_right_one():
    x, m, d = sp.symbols("x m d", real=True)
    assert is_zero(sp.exp(x - m) / d - sp.exp(x) * sp.exp(-m) / d)
    assert not is_zero(sp.exp(x - m) / d - sp.exp(x - m) / d ** 2)
    assert is_zero(x / sp.Abs(x) - sp.sign(x))  # where the derivative exists


def test_only_a_case_where_the_loss_is_undefined_is_outside_the_domain():
    """A fully masked row (the select's condition false: the loss is 0/0) proves nothing
    about that case, and the case where it holds must still be 0; a loss undefined in every
    case proves nothing at all."""
    x, p = sp.symbols("x p", real=True)
    masked = Where(x > p, x, sp.S.Zero) / Where(x > p, sp.S.One, sp.S.Zero)  # 0/0 where off
    assert is_zero(Where(x > p, x - x, sp.S.One), masked)
    assert not is_zero(Where(x > p, x, sp.S.Zero), masked)
    assert not is_zero(x, sp.nan)


def test_written_forward_round_trips_through_the_parser():
    for name in PROVEN:
        cascade = derive(name).cascade
        again = parse(written(cascade))
        assert set(cascade.outputs) <= set(again.outputs)


def _selectors(b, forward: dict, upstream: dict, n: int) -> dict:
    """Each selection's per-element input: its upstream (or 1) at the saved indices."""
    out = {}
    for s in b.selections:
        index = np.asarray(forward[s.index]).astype(np.int64)
        up = upstream[s.result] if s.upstream else np.ones(index.shape)
        if s.k is None:
            index, up = index[..., None], up[..., None]
        sel = np.zeros((*index.shape[:-1], n))
        np.put_along_axis(sel, index, up, -1)
        out[s.selector] = sel.astype(np.float32)
        if s.delta:
            out[s.delta] = np.sum(up * forward[s.result], -1).astype(np.float32)
    return out


@settings(max_examples=examples(0.4), deadline=None,
          suppress_health_check=[HealthCheck.filter_too_much])
@given(specs=cascades(), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6))
def test_generated_backward_kernels_match_differences_of_the_oracle(specs, seed, n):
    spec, _ = specs
    try:
        rule = rule_for(spec)
        assume(isinstance(rule, redfuser.FusionRule))
        # feature vectors need the other orientation's layout: tests/api/
        # test_torch_backward_generated.py runs them through the torch op
        assume(not rule.cascade.vector_inputs)
        assume(all(n >= (r.k or 1) for r in rule.cascade.reductions))  # top-k needs k <= N
        b = rule.backward()
    except (redfuser.NotFusable, redfuser.SpecError, NoBackward):
        assume(False)  # refused by the forward engine, or a backward the engine refuses
    assume(b.proven and not b.is_map)
    rng = np.random.default_rng(seed)
    inputs = cascade_inputs(rule, rng, (2,), n, d=3)
    forward = redfuser.reference(b.forward_spec, inputs)
    upstream = {o: rng.normal(size=forward[o].shape) for o in b.upstream}
    assume(all(np.isfinite(forward[o]).all() for o in b.upstream))
    kernel = redfuser.compile(b.spec, tune=False)
    reads = {s.name for s in (*kernel.rule.cascade.streams, *kernel.rule.cascade.params)}
    given = inputs | {s: forward[s].astype(np.float32) for s in b.saved} | {
        g: upstream[o].astype(np.float32) for o, g in b.upstream.items()} | _selectors(
        b, forward, upstream, n)
    grads = kernel(**{k: v for k, v in given.items() if k in reads})  # not the indices
    for name, (grad, _) in b.gradients.items():
        want = central_differences(spec, inputs, upstream, name, STEP)
        got = np.asarray(grads[grad], np.float64).reshape(want.shape)
        scale = np.max(np.abs(want), axis=-1, keepdims=True)
        bad = ~(np.abs(got - want) <= TOL * (1 + scale))
        assert not bad.any(), f"{spec!r}: {grad} = {got[bad]}, differences {want[bad]}"


def test_a_backward_with_nothing_to_differentiate_is_refused_by_name():
    with pytest.raises(NoBackward, match="p is an index: integer outputs have no gradient"):
        derive("m = max(x[i])\np = argmax(x[i] - m)").backward()


@pytest.mark.parametrize("spec, dx", [
    ("r = sum(x[i]) / N", "dr/N"),  # a broadcast of the upstream: no kernel
    ("m = sum(x[i]) / N\nr = sum(x[i] - m)", "0"),  # sum(c) = N * c, so r is 0 for any x
])
def test_a_sum_of_a_row_constant_is_n_times_it_and_needs_no_kernel(spec, dx):
    b = derive(spec).backward()
    assert b.proven and b.is_map and "sum(" not in b.spec and str(b.maps["dx"]) == dx


def test_shared_gradients_sum_over_the_rows_what_the_row_backward_writes_per_element():
    b = derive("layernorm").backward()
    s = shared_sums(b, scalars=("eps",))
    assert s.gradients == ("dg", "db") and "n_stream" not in s.sums  # N unread: none passed
    rows = parse(s.rows).outputs
    assert "dx" in rows and not {"dg", "db", "deps"} & set(rows)  # nor a scalar's deps
    rng = np.random.default_rng(5)
    x, dy, g = rng.normal(size=(6, 9)), rng.normal(size=(6, 9)), rng.random(9) + 0.5
    fwd = redfuser.reference(b.forward_spec, {"x": x, "g": g, "b": g, "eps": 1e-5})
    given = {"x": x, "dy": dy, "g": np.broadcast_to(g, x.shape), "mean": fwd["mean"],
             "var": fwd["var"], "eps": 1e-5}
    per_element = redfuser.reference(b.spec, given)
    summed = redfuser.reference(s.sums, {k: given[k] for k in ("x", "dy", "mean", "var",
                                                              "eps")})  # stream: the rows
    for name in s.gradients:
        np.testing.assert_allclose(summed[name], per_element[name].sum(0), rtol=1e-12)


def test_a_product_passes_its_log_derivative_and_geometric_means_max_stabilises():
    """geometric_mean's g_prod = prod(exp((x - m) / N)) passes -g_prod to m, which cancels
    what g = g_prod * exp(m) passes (m a stabiliser, proven as softmax's m is); dx needs no
    sum: a broadcast of dg * g / N, which the caller runs."""
    b = derive("geometric_mean").backward()
    assert b.proven and b.stabilisers == ("m",) and b.products == ("g_prod",)
    assert b.saved == ("g_prod", "m") and b.is_map and b.spec == "dx[i] = dg*g_prod*exp(m)/N"
    assert "g_prod: a product, differentiated by its log-derivative" in str(b)
    assert "adjoint of m = 0 for every N: m only stabilises" in str(b)


@pytest.mark.parametrize("spec, lines", [
    ("p = prod(1 + exp(x[i]))", ["dx[i] = dp*p*exp(x[i])/(exp(x[i]) + 1)"]),
    ("p = prod(exp(x[i] * t))", ["dt = sum(dp*p*x[i])", "dx[i] = dp*p*t"]),  # a new sum
    ("p = prod(where(i <= pos, exp(x[i]), 1))", ["dx[i] = where(i <= pos, dp*p, 0)"]),
])
def test_products_of_factors_that_cannot_be_zero_are_derived_and_proven(spec, lines):
    b = derive(spec).backward()
    assert b.proven and b.products == ("p",) and b.spec.splitlines() == lines


@pytest.mark.parametrize("spec, factor", [
    ("p = prod(x[i])", "x[i]"),
    ("p = prod(where(x[i] > 0, exp(x[i]), x[i]))", "where(x[i] > 0, exp(x[i]), x[i])"),
    ("p = prod(exp(x[i]) - 1)", "exp(x[i]) - 1"),
])
def test_a_product_whose_factor_can_be_zero_is_refused_by_name(spec, factor):
    """p/factor is not the derivative where a factor is 0 (torch's zero handling needs
    the product of the other factors): refused, not a NaN at the zero."""
    with pytest.raises(NoBackward, match=f"^p = prod[(]{re.escape(factor)}[)]: a factor can "
                                         "be 0, where p/factor is not its derivative"):
        derive(spec).backward()


def test_the_proof_unrolls_a_product_as_the_product_of_its_factors():
    """prod(1 + exp(x)) at N = 1, 2, 3: the log-derivative proves; a sum's rule applied
    to it (dx = dp * exp(x), no p / factor) does not."""
    c = parse("p = prod(1 + exp(x[i]))")
    x, p = c.streams[0], c.reductions[0].symbol
    dp = sp.Symbol("dp", real=True)
    sym = {"x": x, "p": p}
    right = dp * p * sp.exp(x) / (1 + sp.exp(x))
    for form, holds in ((right, True), (dp * sp.exp(x), False)):
        proofs = prove(c, sym, [], {"p": dp}, {}, [], [(x, "dx", form)], {}, [])
        assert len(proofs) == 3 and all(ok for _, ok in proofs) is holds


def test_a_products_backward_kernel_matches_differences_of_the_oracle():
    """prod(exp(x * t)), t each row's own: dt is a sum the backward kernel runs; dx and dt
    against central differences of the float64 oracle (the forward spec's reference)."""
    spec = "p = prod(exp(x[i] * t))"
    b = derive(spec).backward()
    rng = np.random.default_rng(2)
    inputs = {"x": rng.normal(size=(4, 6)).astype(np.float32),
              "t": rng.uniform(0.2, 0.6, size=4).astype(np.float32)}
    forward = redfuser.reference(spec, inputs)
    upstream = {"p": rng.normal(size=forward["p"].shape)}
    kernel = redfuser.compile(b.spec, tune=False)
    grads = kernel(x=inputs["x"], t=inputs["t"], p=forward["p"].astype(np.float32),
                   dp=upstream["p"].astype(np.float32))
    for name, (grad, _) in b.gradients.items():
        want = central_differences(spec, inputs, upstream, name, STEP)
        got = np.asarray(grads[grad], np.float64).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * (1 + np.abs(want).max()))


@pytest.mark.parametrize("result, zero", [
    ("y[i] = exp(x[i] + a - m) / d", True),  # softmax: shift-invariant
    ("lse = m + log(d)", False),  # d lse / d a = 1
])
def test_the_prover_tells_a_zero_gradient_from_one_that_is_not(result, zero):
    """A parameter's gradient claimed 0 (``Backward.zero``) is checked against sympy.diff
    of the loss like any other: a shift of every score is invisible to softmax's output,
    not to its logsumexp."""
    c = parse(f"m = max(x[i] + a)\nd = sum(exp(x[i] + a - m))\n{result}")
    sym = {s.name: s for s in c.params} | {r.name: r.symbol for r in c.reductions}
    out = c.outputs[-1]
    proofs = prove(c, sym, [], {out: sp.Symbol(f"d{out}", real=True)}, {}, [], [], {}, [],
                   zero=("a",))
    assert [ok for claim, ok in proofs if "d a = 0" in claim] == [zero] * 3
