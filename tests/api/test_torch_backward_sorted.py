"""Masks on a sorted stream in the other orientation (``algebra.backward_sorted``): dk and dv
of attention masked by a comparison of the key's position with each query's ``pos`` run
as a range of the queries where ``pos`` does not decrease, and as the general cascade where
it does; both against torch's autograd of the float64 reference
(tests/support/gradients.py), with every comparison of ``SIDES``, ties in ``pos`` and keys
no query sees.  The attention here adds a bias per key to its scores (ALiBi's, a relative
position's): without it, its backward runs through the scores
(``tests/api/test_torch_backward_scores.py``), not through these kernels."""

from __future__ import annotations

import math
import operator
from unittest import mock

import pytest
import torch

import redfuser.torch as rt
from algebra import derive
from algebra.backward_sorted import SIDES, sorted_columns
from redfuser import torch_columns
from tests.support.gradients import assert_gradients_match

HEADS, LENGTH, D = 2, 13, 4
# comparison -> (its op's name, the attention spec's condition on key i, the allowed (key,
# pos) pairs, a sorted pos with ties and gaps under which every query sees a key)
MASKS = {
    "<=": ("le", "i <= pos", operator.le, [0, 0, 1, 3, 3, 3, 4, 8, 9, 9, 10, 12, 12]),
    "<": ("lt", "i < pos", operator.lt, [1, 1, 2, 3, 3, 6, 7, 7, 7, 9, 11, 12, 13]),
    ">=": ("ge", "i >= pos", operator.ge, [0, 0, 1, 3, 3, 3, 4, 8, 9, 9, 10, 12, 12]),
    ">": ("gt", "i > pos", operator.gt, [-1, 0, 0, 3, 3, 4, 4, 5, 8, 8, 10, 11, 11]),
}


def _spec(cond: str) -> str:
    return (f"s = where({cond}, dot(q, k[i, :]) * scale + b[i], -inf)\nm = max(s)\n"
            f"d = sum(where({cond}, exp(s - m), 0))\n"
            f"o = sum(where({cond}, exp(s - m) * v[i, :], 0)) / d")


def _gradients(op, allowed, pos: torch.Tensor, seed: int) -> tuple[dict, dict, bool]:
    """The op's dq, dk, dv and the float64 reference's, and whether the range ran."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g) for s in
               ((HEADS, LENGTH, D), (HEADS, 1, LENGTH, D), (HEADS, 1, LENGTH, D)))
    upstream = torch.randn(HEADS, LENGTH, D, generator=g)
    bias = torch.randn(LENGTH, generator=g)
    values = {"q": q, "k": k, "v": v, "scale": 0.5, "pos": pos.reshape(1, LENGTH), "b": bias}
    leaves = {n: t.clone().requires_grad_() if n in "qkv" else t for n, t in values.items()}
    with mock.patch.object(torch_columns, "_bound", side_effect=torch_columns._bound) as spy:
        op(*(leaves[n] for n in op.inputs))[op.outputs.index("o")].backward(upstream)
    ref = {n: values[n].double().requires_grad_() for n in "qkv"}
    s = ref["q"] @ ref["k"][:, 0].mT * 0.5 + bias.double()
    keys = torch.arange(LENGTH, dtype=torch.float64)
    s = s.masked_fill(~allowed(keys[None, :], pos.double()[:, None]), -math.inf)
    (torch.softmax(s, -1) @ ref["v"][:, 0]).backward(upstream.double())
    return ({n: leaves[n].grad for n in "qkv"}, {n: ref[n].grad for n in "qkv"},
            spy.called)


@pytest.mark.parametrize("comparison", sorted(SIDES))
def test_each_comparison_runs_as_a_range_of_sorted_positions(comparison):
    name, cond, allowed, pos = MASKS[comparison]
    op = rt.op(_spec(cond), name=f"sorted_mask_{name}", scalars=("scale",), tune=False)
    got, want, ranged = _gradients(op, allowed, torch.tensor(pos, dtype=torch.float32), 1)
    assert ranged, "sorted positions took the general cascade"
    assert_gradients_match(got, want, cond)


@pytest.mark.parametrize("pos", [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],  # every causal mask torch builds
    [12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12],  # one tie: every key seen
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 100],  # keys 1 to 12 seen by the last query only
])
def test_causal_attention_ranges_match_torch_autograd(pos):
    op = rt.op(_spec("i <= pos"), name="sorted_mask_le", scalars=("scale",), tune=False)
    got, want, ranged = _gradients(op, operator.le, torch.tensor(pos, dtype=torch.float32), 2)
    assert ranged
    assert_gradients_match(got, want, "causal_attention")


@pytest.mark.parametrize("pos", [
    [12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0],  # queries in reverse
    [0, 1, 2, 3, 4, 5, 3, 7, 8, 9, 10, 11, 12],  # one step back
])
def test_unsorted_positions_take_the_general_cascade(pos):
    op = rt.op(_spec("i <= pos"), name="sorted_mask_le", scalars=("scale",), tune=False)
    got, want, ranged = _gradients(op, operator.le, torch.tensor(pos, dtype=torch.float32), 3)
    assert not ranged, "a decreasing stream ran as a range"
    assert_gradients_match(got, want, "causal_attention")


def test_a_compiled_backward_chooses_on_the_data():
    """Under torch.compile the choice is made inside one op, at run time: the same
    compiled graph takes sorted and unsorted positions, each to its cascade."""
    op = rt.op(_spec("i <= pos"), name="sorted_mask_le", scalars=("scale",), tune=False)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(*s, generator=g).requires_grad_() for s in
               ((HEADS, LENGTH, D), (HEADS, 1, LENGTH, D), (HEADS, 1, LENGTH, D)))
    run = torch.compile(lambda *a: op(*a)[op.outputs.index("o")], fullgraph=True)
    for pos, want in ((torch.arange(LENGTH), True), (torch.arange(LENGTH).flip(0), False)):
        values = {"q": q, "k": k, "v": v, "scale": 0.5, "pos": pos.float().reshape(1, -1),
                  "b": torch.zeros(LENGTH)}
        with mock.patch.object(torch_columns, "_bound",
                               side_effect=torch_columns._bound) as spy:
            run(*(values[n] for n in op.inputs)).sum().backward()
        assert spy.called == want


def test_only_conditions_on_one_scalar_stream_are_rewritten():
    assert sorted_columns(derive("attention").backward()) is None  # no mask
    two = ("s = where(i <= pos, dot(q, k[i, :]), -inf)\nm = max(s)\n"
           "d = sum(where(i <= pos, exp(s - m), 0))\n"
           "o = sum(where(i >= lo, exp(s - m) * v[i, :], 0)) / d")
    assert sorted_columns(derive(two).backward()) is None  # pos and lo: two streams
