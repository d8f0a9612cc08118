"""Generated attention variants through the scores (``algebra.backward_scores``): a score
transform users ask for one variant at a time (a temperature, a bias linear in the key's
position: ALiBi's, a tanh softcap) times a mask (none, causal, its mirror), every
gradient (q, k, v and the learned scalars) against central differences of the float64
oracle (``redfuser.reference`` of the forward spec, not the code under test).

Tolerance: tests/api/test_torch_backward_generated.py's (float32 products and kernels,
float64 differences with step 1e-5): 2e-3 of the gradient's largest magnitude per row,
plus 2e-3 absolute.
"""

from __future__ import annotations

import itertools
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import redfuser.torch as rt
from redfuser import torch_scores
from tests.support import central_differences, examples

STEP, TOL = 1e-5, 2e-3
ROWS, D = (3,), 3
# The softcap's c is drawn small enough that tanh saturates in float32 on some keys
# (|s / c| > 4.5): its dc was inf there once (algebra.backward_vectors.OPAQUE).
TRANSFORMS = ("dot(q, k[i, :]) * t", "dot(q, k[i, :]) * t + a * i",
              "c * tanh(dot(q, k[i, :]) / c)")
MASKS = (None, "i <= p", "i >= p")
_names = itertools.count()


def _spec(transform: str, mask: str | None) -> str:
    if mask is None:
        return (f"s = {transform}\nm = max(s)\nd = sum(exp(s - m))\n"
                "o = sum(exp(s - m) * v[i, :]) / d")
    return (f"s = where({mask}, {transform}, -inf)\nm = max(s)\n"
            f"d = sum(where({mask}, exp(s - m), 0))\n"
            f"o = sum(where({mask}, exp(s - m) * v[i, :], 0)) / d")


def _inputs(spec: str, n: int, rng: np.random.Generator) -> dict:
    """q per row, k and v shared by the rows (1 x N x D), the scalars per row; p sorted
    (the mask's positions), so the rows the blocks reach are narrowed too."""
    out = {"q": rng.normal(size=(*ROWS, D)), "k": rng.normal(size=(1, n, D)),
           "v": rng.normal(size=(1, n, D)), "t": rng.uniform(0.5, 1.5, ROWS),
           "a": rng.uniform(-0.5, 0.5, ROWS), "c": rng.uniform(0.1, 2.0, ROWS),
           "p": np.sort(rng.integers(0, n, ROWS)).astype(float)}
    return {k: v.astype(np.float32) for k, v in out.items()}


@settings(max_examples=examples(0.4), deadline=None)
@given(transform=st.sampled_from(TRANSFORMS), mask=st.sampled_from(MASKS),
       n=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_generated_attention_variants_match_differences_of_the_oracle(transform, mask, n,
                                                                      seed):
    spec, rng = _spec(transform, mask), np.random.default_rng(seed)
    _check(spec, _inputs(spec, n, rng), rng)


@pytest.mark.parametrize("n", [1, 5])
def test_a_saturated_softcap_has_a_finite_scale_gradient(n):
    """|s / c| up to 40: tanh is 1 in float32 on most keys, where the scale's gradient
    was once 0 / 0 (module comment on TRANSFORMS)."""
    spec, rng = _spec(TRANSFORMS[2], None), np.random.default_rng(n)
    inputs = _inputs(spec, n, rng)
    _check(spec, inputs | {"q": 4 * inputs["q"], "c": np.full(ROWS, 0.2, np.float32)}, rng)


# A learned scalar of the normaliser, and whether the backward runs through the scores:
# an attention sink's logit (m stabilises once d is read as d_sum + exp(a - m): the
# coefficients are attention's, the sink's gradient a map beside them), and a term added
# after the stabiliser (m selects: its subgradient is a per-element value of the other
# orientation's kernel, which once crashed there; not coefficients times one vector).
NORMALISERS = (("s = dot(q, k[i, :]) * t\nm = max(s)\nd = sum(exp(s - m)) + exp(a - m)\n"
                "o = sum(exp(s - m) * v[i, :]) / d", True),
               ("s = dot(q, k[i, :]) * t\nm = max(s)\nd = sum(exp(s - m))\n"
                "o = sum(exp(s - m) * v[i, :]) / (d + a * a)", False))


@pytest.mark.parametrize("n", [1, 4, 300])
@pytest.mark.parametrize("spec, through", NORMALISERS)
def test_a_learned_scalar_of_the_normaliser(spec, through, n):
    rng = np.random.default_rng(n)
    _check(spec, _inputs(spec, n, rng), rng, through_scores=through)


def _check(spec: str, inputs: dict, rng: np.random.Generator,
           through_scores: bool = True) -> None:
    op = rt.op(spec, name=f"generated_scores_{next(_names)}", tune=False)
    inputs = {k: v for k, v in inputs.items() if k in op.inputs}
    upstream = {"o": rng.normal(size=(*ROWS, D))}
    leaves = {k: torch.tensor(v, requires_grad=k != "p") for k, v in inputs.items()}
    outs = op(*(leaves[k] for k in op.inputs))
    assume(torch.isfinite(outs[op.outputs.index("o")]).all())  # a row that sees no key
    with mock.patch.object(torch_scores, "_blocks", side_effect=torch_scores._blocks) as spy:
        (outs[op.outputs.index("o")].double() * torch.tensor(upstream["o"])).sum().backward()
    assert spy.called == through_scores, f"{spec!r}: through the scores: {spy.called}"
    for name in (k for k in inputs if k != "p"):
        want = central_differences(spec, inputs, upstream, name, STEP, rows=ROWS)
        got = leaves[name].grad.double().numpy()
        scale = np.max(np.abs(want), axis=-1, keepdims=True) if want.ndim else abs(want)
        bad = ~(np.abs(got - want) <= TOL * (1 + scale))
        assert not bad.any(), f"{spec!r}: d{name} = {got[bad]}, differences {want[bad]}"
