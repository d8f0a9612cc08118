"""linear_cross_entropy's backward through its scores (``redfuser.torch_scores``: the
logits ``dot(h, w[i, :])``): dh and dw from the derived coefficients and three GEMMs over
blocks of the vocabulary, against torch's autograd of ``F.cross_entropy(h @ w.T)`` in
float64 (the tolerance of tests/support/gradients.py: float32 GEMMs and kernels)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import redfuser.torch as rt
from redfuser import torch_scores
from tests.support.gradients import assert_gradients_match

# (rows, vocab, d): a block is torch_scores.BLOCK vocabulary rows, so a vocabulary of two
# blocks and one more row makes three, the last of one
ROWS, VOCAB, D = 5, 2 * torch_scores.BLOCK + 1, 4


def _problem(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(ROWS, D, generator=g).to(dtype)
    w = (torch.randn(VOCAB, D, generator=g) * 2).to(dtype)
    label = torch.randint(0, VOCAB, (ROWS,), generator=g)
    label[0] = VOCAB - 1  # the label in the last, partial block
    return h, w, label, torch.randn(ROWS, generator=g)


def _torch_grads(h, w, label, upstream, want=("h", "w")):
    leaves = {"h": h.double().requires_grad_("h" in want),
              "w": w.double().requires_grad_("w" in want)}
    F.cross_entropy(leaves["h"] @ leaves["w"].T, label, reduction="none").backward(
        upstream.double())
    return {n: leaves[n].grad for n in want}


def _op_grads(h, w, label, upstream, want=("h", "w"), compiled=False):
    op = rt.op("linear_cross_entropy", tune=False)
    leaves = {"h": h.clone().requires_grad_("h" in want),
              "w": w.clone().requires_grad_("w" in want)}

    def loss(h, w, label):
        return op(h, w, label)[op.outputs.index("loss")]

    run = torch.compile(loss, fullgraph=True) if compiled else loss
    # the op's blocks, not ScoresBackward.run: a compiled backward calls the registered op
    # itself, and traces ScoresBackward.run only when AOTAutograd has no cached graph
    with mock.patch.object(torch_scores, "_blocks", side_effect=torch_scores._blocks) as spy:
        run(leaves["h"], leaves["w"], label.float()).backward(upstream)
    assert spy.called, "the backward did not run through the scores"
    return {n: leaves[n].grad for n in ("h", "w")}


@pytest.mark.parametrize("compiled", [False, True])
def test_gradients_through_the_scores_match_torch_autograd(compiled):
    h, w, label, upstream = _problem(1)
    got = _op_grads(h, w, label, upstream, compiled=compiled)
    assert_gradients_match(got, _torch_grads(h, w, label, upstream), "linear_cross_entropy")


def test_two_runs_give_identical_bits():
    """dh's blocks add in a fixed order; each block's dw is one GEMM."""
    h, w, label, upstream = _problem(2)
    first, second = (_op_grads(h, w, label, upstream) for _ in range(2))
    assert all(torch.equal(first[n], second[n]) for n in "hw")


@pytest.mark.parametrize("want", [("h",), ("w",)])
def test_only_the_needed_gradient_is_computed(want):
    h, w, label, upstream = _problem(3)
    got = _op_grads(h, w, label, upstream, want=want)
    assert {n for n, g in got.items() if g is not None} == set(want)
    assert_gradients_match({n: got[n] for n in want},
                           _torch_grads(h, w, label, upstream, want), "linear_cross_entropy")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_are_rounded_once(dtype):
    """bfloat16/float16 h and w: the GEMMs and ds run in float32, the gradients are rounded
    to the dtype once, as torch returns them: within two units in the last place of their
    scale of torch's float64 autograd (the rounding of ds's inputs, the loss's lse, adds
    less than one)."""
    h, w, label, upstream = _problem(4, dtype)
    got = _op_grads(h, w, label, upstream)
    want = _torch_grads(h, w, label, upstream)
    for n in "hw":
        assert got[n].dtype == dtype
        scale = want[n].abs().max()
        assert (got[n].double() - want[n]).abs().max() <= 2 * torch.finfo(dtype).eps * scale


def test_a_learned_scalar_of_the_loss_runs_through_the_scores_too():
    """A z-loss weight that requires grad: its gradient is a row's sum of one more
    coefficient of the same block map (dzc summed over the rows by the op's caller)."""
    spec = ("s = dot(h, w[i, :])\nm = max(s)\nlse = log(sum(exp(s - m))) + m\n"
            "loss = lse - sum(where(i == label, s, 0)) + zc * lse**2")
    op = rt.op(spec, name="lce_learned_zloss", tune=False)
    h, w, label, upstream = _problem(5)
    leaves = {"h": h.clone().requires_grad_(), "w": w.clone().requires_grad_(),
              "zc": torch.tensor(0.01, requires_grad=True), "label": label.float()}
    with mock.patch.object(torch_scores, "_blocks", side_effect=torch_scores._blocks) as spy:
        op(*(leaves[n] for n in op.inputs))[op.outputs.index("loss")].backward(upstream)
    assert spy.called
    ref = {n: leaves[n].detach().double().requires_grad_() for n in ("h", "w", "zc")}
    logits = ref["h"] @ ref["w"].T
    lse = torch.logsumexp(logits, -1)
    (F.cross_entropy(logits, label, reduction="none") + ref["zc"] * lse ** 2).backward(
        upstream.double())
    assert_gradients_match({n: leaves[n].grad for n in ref}, {n: ref[n].grad for n in ref},
                           "lce_learned_zloss")


@pytest.mark.parametrize("compiled", [False, True])
def test_learned_statistics_of_the_loss_run_through_the_scores(compiled):
    """Label smoothing ``ls`` (a row's sum of one more coefficient) and a z-loss weight
    ``zc`` (a map beside the scores) learned, with an ignored row and the argmax beside:
    every gradient against torch's float64 autograd, through the scores."""
    spec = ("s = dot(h, w[i, :])\nm = max(s)\nlse = log(sum(exp(s - m))) + m\n"
            "nll = lse - (1 - ls) * sum(where(i == label, s, 0)) - ls * sum(s) / N\n"
            "loss = where(label >= 0, nll + zc * lse**2, 0)\npred = argmax(s)")
    op = rt.op(spec, name="lce_learned_statistics", tune=False)
    h, w, label, upstream = _problem(6)
    label[1] = -100  # an ignored row
    leaves = {"h": h.clone().requires_grad_(), "w": w.clone().requires_grad_(),
              "ls": torch.tensor(0.1, requires_grad=True),
              "zc": torch.tensor(0.01, requires_grad=True), "label": label.float()}

    def loss(*args):
        return op(*args)[op.outputs.index("loss")]

    run = torch.compile(loss, fullgraph=True) if compiled else loss
    with mock.patch.object(torch_scores, "_blocks", side_effect=torch_scores._blocks) as spy:
        run(*(leaves[n] for n in op.inputs)).backward(upstream)
    assert spy.called
    ref = {n: leaves[n].detach().double().requires_grad_() for n in ("h", "w", "ls", "zc")}
    logits = ref["h"] @ ref["w"].T
    lse = torch.logsumexp(logits, -1)
    picked = logits.gather(-1, label.clamp(min=0)[:, None])[:, 0]
    nll = lse - (1 - ref["ls"]) * picked - ref["ls"] * logits.mean(-1)
    torch.where(label >= 0, nll + ref["zc"] * lse ** 2, torch.zeros_like(nll)).backward(
        upstream.double())
    assert_gradients_match({n: leaves[n].grad for n in ref}, {n: ref[n].grad for n in ref},
                           "lce_learned_statistics")
    assert (leaves["h"].grad[1] == 0).all()
