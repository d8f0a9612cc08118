"""Attention's backward through the scores (``algebra.backward_scores``,
``redfuser.torch_scores``): dq, dk, dv (and a learned scale's gradient) from the engine's
coefficients and batched products over blocks of keys, against torch's autograd of the
float64 reference (tests/support/gradients.py: float32 products and kernels)."""

from __future__ import annotations

import math
import operator
from unittest import mock

import pytest
import torch

import redfuser.torch as rt
from algebra import derive
from algebra.backward_scores import through_scores
from redfuser import torch_scores
from tests.support.gradients import assert_gradients_match

# (heads, queries, keys, D): 300 keys with D = 4 make two blocks (BLOCK), the last partial
SHAPES = [(2, 5, 5, 4), (1, 1, 1, 4), (1, 7, 300, 4), (2, 300, 300, 4)]


def _problem(heads: int, lq: int, lk: int, d: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(heads, lq, d, generator=g),
            "k": torch.randn(heads, 1, lk, d, generator=g),
            "v": torch.randn(heads, 1, lk, d, generator=g),
            "do": torch.randn(heads, lq, d, generator=g),
            "pos": torch.arange(lk - lq, lk, dtype=torch.float32).reshape(1, lq)}


def _reference(p: dict, causal: bool, scale, want: str = "qkv") -> dict:
    ref = {n: p[n].double().requires_grad_() for n in "qkv"}
    scale = torch.as_tensor(scale, dtype=torch.float64).requires_grad_("s" in want)
    s = ref["q"] @ ref["k"][:, 0].mT * scale
    if causal:  # query l at position pos[l] sees the keys up to it
        keys = torch.arange(s.shape[-1], dtype=torch.float64)
        s = s.masked_fill(keys > p["pos"].double()[0, :, None], -math.inf)
    (torch.softmax(s, -1) @ ref["v"][:, 0]).backward(p["do"].double())
    return {n: ref[n].grad for n in "qkv"} | ({"scale": scale.grad} if "s" in want else {})


def _ours(p: dict, name: str, scale, compiled: bool = False) -> tuple[dict, bool]:
    learned = isinstance(scale, torch.Tensor)
    op = rt.op(name, name=f"{name}_learned_scale", tune=False) if learned else \
        rt.op(name, scalars=("scale",), tune=False)
    leaves = {n: p[n].clone().requires_grad_() for n in "qkv"}
    leaves |= {"scale": scale.clone().requires_grad_() if learned else scale,
               "pos": p["pos"]}

    def model(*args):
        return op(*args)[op.outputs.index("o")]

    run = torch.compile(model, fullgraph=True) if compiled else model
    with mock.patch.object(torch_scores, "_blocks", side_effect=torch_scores._blocks) as spy:
        run(*(leaves[n] for n in op.inputs)).backward(p["do"])
    grads = {n: leaves[n].grad for n in "qkv"}
    return grads | ({"scale": leaves["scale"].grad} if learned else {}), spy.called


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["attention", "causal_attention"])
def test_gradients_through_the_scores_match_torch_autograd(name, shape):
    p = _problem(*shape, seed=1)
    got, through = _ours(p, name, 0.5)
    assert through, "the backward did not run through the scores"
    assert_gradients_match(got, _reference(p, name == "causal_attention", 0.5), name)


@pytest.mark.parametrize("name", ["attention", "causal_attention"])
def test_compiled_and_a_learned_scale(name):
    """Under torch.compile(fullgraph=True) the op is one call; a scale that requires grad
    gets the sum of its per-row coefficients."""
    p = _problem(2, 6, 9, 4, seed=2)
    scale = torch.tensor(0.4)
    got, through = _ours(p, name, scale, compiled=True)
    assert through
    assert_gradients_match(got, _reference(p, name == "causal_attention", 0.4, "qkvs"), name)


def test_two_runs_give_identical_bits():
    """dq's blocks add in a fixed order; each block's dk and dv is one product."""
    p = _problem(1, 7, 300, 4, seed=3)
    first, second = (_ours(p, "attention", 0.5)[0] for _ in range(2))
    assert all(torch.equal(first[n], second[n]) for n in "qkv")


def test_what_is_not_coefficients_times_one_vector_keeps_the_kernels():
    """v and k both read outside the scores: dk's summand is c1 * q + c2 * do, two
    vectors, so there is no one product per gradient; a bias per key is read outside the
    scores too (tests/api/test_torch_backward_sorted.py runs it)."""
    two = ("s = dot(q, k[i, :]) * scale\nm = max(s)\nd = sum(exp(s - m))\n"
           "o = sum(exp(s - m) * (v[i, :] + k[i, :])) / d")
    bias = ("s = dot(q, k[i, :]) * scale + b[i]\nm = max(s)\nd = sum(exp(s - m))\n"
            "o = sum(exp(s - m) * v[i, :]) / d")
    assert through_scores(derive(two).backward()) is None
    assert through_scores(derive(bias).backward()) is None
    assert through_scores(derive("attention").backward()) is not None


# comparison -> (its op's name, the condition on key i, the allowed (key, pos) pairs, the
# range of pos under which every query sees a key of 300)
COMPARISONS = {
    "<=": ("le", "i <= pos", operator.le, (0, 300)),
    "<": ("lt", "i < pos", operator.lt, (1, 301)),
    ">=": ("ge", "i >= pos", operator.ge, (0, 300)),
    ">": ("gt", "i > pos", operator.gt, (-1, 299)),
}


@pytest.mark.parametrize("comparison", sorted(COMPARISONS))
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_a_mask_on_sorted_positions_skips_the_rows_a_block_never_reaches(comparison, order):
    """300 queries and keys make two blocks of keys; with ``pos`` sorted (ties included)
    the second block adds only to the rows whose condition it can meet (``_seen``), with
    ``pos`` shuffled to every row; both give torch's gradients."""
    name, cond, allowed, (lo, hi) = COMPARISONS[comparison]
    spec = (f"s = where({cond}, dot(q, k[i, :]) * scale, -inf)\nm = max(s)\n"
            f"d = sum(where({cond}, exp(s - m), 0))\n"
            f"o = sum(where({cond}, exp(s - m) * v[i, :], 0)) / d")
    op = rt.op(spec, name=f"scores_mask_{name}", scalars=("scale",), tune=False)
    g = torch.Generator().manual_seed(5)
    p = _problem(2, 300, 300, 4, seed=5)
    edges = torch.tensor([255, 255, 256, 256])  # ties on the blocks' edge keys
    pos = torch.cat([torch.randint(lo, hi, (296,), generator=g), edges]).sort().values.float()
    p["pos"] = (pos if order == "sorted" else pos[torch.randperm(300, generator=g)])[None]
    leaves = {n: p[n].clone().requires_grad_() for n in "qkv"} | {"scale": 0.5,
                                                                  "pos": p["pos"]}
    ranges, seen = [], torch_scores._seen
    with mock.patch.object(torch_scores, "_seen",
                           side_effect=lambda *a: ranges.append(seen(*a)) or ranges[-1]):
        op(*(leaves[n] for n in op.inputs))[op.outputs.index("o")].backward(p["do"])
    assert len(ranges) == 2
    assert any(r != slice(0, 300) for r in ranges) == (order == "sorted")
    ref = {n: p[n].double().requires_grad_() for n in "qkv"}
    s = ref["q"] @ ref["k"][:, 0].mT * 0.5
    keys = torch.arange(300, dtype=torch.float64)
    s = s.masked_fill(~allowed(keys[None, :], p["pos"].double()[0, :, None]), -math.inf)
    (torch.softmax(s, -1) @ ref["v"][:, 0]).backward(p["do"].double())
    assert_gradients_match({n: leaves[n].grad for n in "qkv"},
                           {n: ref[n].grad for n in "qkv"}, cond)
