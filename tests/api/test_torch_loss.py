"""A per-row loss reduced over the rows with its gradients computed in the forward
(``redfuser.torch_loss``): the LM head's mean cross-entropy against torch's autograd of
``F.cross_entropy(h @ w.T, label)`` in float64, eager and compiled, with the loss's
upstream 1 (handed over as computed) and not; chunks of rows that do not divide the rows;
a learned softcap's gradient through the scores; and refusals by name.

Tolerance: tests/support/gradients.py's (float32 products and kernels).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from redfuser.torch_loss import reduced
from tests.support.gradients import assert_gradients_match

# rows x vocabulary x D: a chunk holds h.numel() // vocabulary = 2 rows, so 7 rows are four
# chunks, the last of one row
ROWS, VOCAB, D = 7, 40, 12
SOFTCAP = """s = c * tanh(dot(h, w[i, :]) / c)
m = max(s)
lse = log(sum(exp(s - m))) + m
loss = lse - sum(where(i == label, s, 0))"""


def _problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, D, generator=g), torch.randn(VOCAB, D, generator=g) / 2,
            torch.randint(0, VOCAB, (ROWS,), generator=g))


def _reference(h, w, label, reduction: str, upstream: float, c=None) -> tuple:
    leaves = {"h": h.double().requires_grad_(), "w": w.double().requires_grad_()}
    logits = leaves["h"] @ leaves["w"].T
    if c is not None:
        leaves["c"] = torch.tensor(c, dtype=torch.float64, requires_grad=True)
        logits = leaves["c"] * torch.tanh(logits / leaves["c"])
    loss = F.cross_entropy(logits, label, reduction=reduction)
    (loss * upstream).backward()
    return loss.detach(), {n: v.grad for n, v in leaves.items()}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("upstream", [1.0, -0.37])
def test_the_reduced_loss_and_its_gradients_match_torch_autograd(reduction, compiled,
                                                                 upstream):
    lce = reduced("linear_cross_entropy", reduction=reduction, tune=False)
    h, w, label = _problem(1)
    leaves = {"h": h.clone().requires_grad_(), "w": w.clone().requires_grad_()}
    run = torch.compile(lce, fullgraph=True) if compiled else lce
    loss = run(leaves["h"], leaves["w"], label.float())
    (loss * upstream).backward() if upstream != 1 else loss.backward()
    want_loss, want = _reference(h, w, label, reduction, upstream)
    assert loss.shape == () and loss.dtype == torch.float32
    torch.testing.assert_close(loss.detach().double(), want_loss, rtol=1e-6, atol=1e-6)
    assert_gradients_match({n: v.grad for n, v in leaves.items()}, want, "lce")


def test_two_runs_give_the_same_bits_and_no_grad_computes_the_loss_alone():
    """dw adds the chunks in a fixed order; under no_grad the op is asked for no gradient
    (it returns empty ones) and the loss is the same."""
    lce = reduced("linear_cross_entropy", reduction="sum", name="lce_bits", tune=False)
    h, w, label = _problem(2)
    grads = []
    for _ in range(2):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        lce(*leaves, label.float()).backward()
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    with torch.no_grad():
        out = lce.op(h, w, label.float(), True, True, False)  # what a grad step asks
        assert torch.equal(lce(h, w, label.float()), out[0])
        assert [t.numel() for t in lce.op(h, w, label.float(), False, False, False)[1:]] \
            == [0, 0, 0]


def test_a_learned_softcap_gets_its_gradient_through_the_scores():
    """The softcap's dc is a term with no vector: the rows' sums of its coefficient."""
    lce = reduced(SOFTCAP, name="lce_softcap", tune=False)
    assert lce.inputs == ("c", "h", "w", "label")
    h, w, label = _problem(3)
    c = torch.tensor(1.5, requires_grad=True)
    leaves = {"h": h.clone().requires_grad_(), "w": w.clone().requires_grad_(), "c": c}
    loss = lce(c, leaves["h"], leaves["w"], label.float())
    loss.backward()
    want_loss, want = _reference(h, w, label, "mean", 1.0, c=1.5)
    torch.testing.assert_close(loss.detach().double(), want_loss, rtol=1e-6, atol=1e-6)
    assert_gradients_match({n: v.grad for n, v in leaves.items()}, want, "softcap")


@pytest.mark.parametrize("spec, output, reduction, why", [
    ("softmax", "d", "mean", "does not run through one score"),
    ("attention", "o", "mean", "does not run through one score"),
    ("linear_cross_entropy", "lse_", "mean", "'lse_' is not an output"),
    ("linear_cross_entropy", "loss", "max", "reduction must be one of"),
])
def test_what_has_no_reduced_loss_is_refused_by_name(spec, output, reduction, why):
    with pytest.raises(ValueError, match=why):
        reduced(spec, output, reduction, tune=False)


def test_an_input_whose_gradient_is_not_through_the_scores_is_refused_by_name():
    """A learned z-loss weight's gradient is a map beside the scores (``dloss * lse**2``
    summed), which the forward does not compute: asking for it says so."""
    spec = SOFTCAP.replace("c * tanh(dot(h, w[i, :]) / c)", "dot(h, w[i, :])") \
        .replace("loss = lse", "loss = zc * lse * lse + lse")
    lce = reduced(spec, name="lce_zloss", tune=False)
    h, w, label = _problem(4)
    zc = torch.tensor(1e-4, requires_grad=True)
    args = {"h": h.requires_grad_(), "w": w, "label": label.float(), "zc": zc}
    with pytest.raises(ValueError, match="gradient of zc does not run through the scores"):
        lce(*(args[n] for n in lce.inputs))
    zc.requires_grad_(False)
    lce(*(args[n] for n in lce.inputs)).backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_bfloat16_inputs_get_bfloat16_gradients_computed_in_float32():
    """The products and kernels run in float32 (the loss is float32, a statistic); each
    gradient is the float32 one rounded once: within 2**-8 of the largest."""
    lce = reduced("linear_cross_entropy", name="lce_bf16", tune=False)
    h, w, label = (t.bfloat16() if t.is_floating_point() else t for t in _problem(5))
    leaves = {"h": h.clone().requires_grad_(), "w": w.clone().requires_grad_()}
    loss = lce(leaves["h"], leaves["w"], label.float())
    loss.backward()
    want_loss, want = _reference(h, w, label, "mean", 1.0)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.detach().double(), want_loss, rtol=1e-6, atol=1e-6)
    for n, g in want.items():
        assert leaves[n].grad.dtype == torch.bfloat16
        torch.testing.assert_close(leaves[n].grad.double(), g, rtol=0,
                                   atol=2 ** -8 * float(g.abs().max()))


def test_a_batch_of_sequences_is_its_tokens_as_rows():
    """h (batch, tokens, D) and a label per token: the rows are the tokens, h's gradient
    has h's shape, and a per-token learned softcap's gradient is per token."""
    lce = reduced(SOFTCAP, name="lce_tokens", tune=False)
    h, w, label = _problem(6)
    h3, label3 = h[:6].reshape(2, 3, D), label[:6].reshape(2, 3)
    c = torch.full((2, 3), 1.5, requires_grad=True)
    leaves = {"h": h3.clone().requires_grad_(), "w": w.clone().requires_grad_(), "c": c}
    lce(c, leaves["h"], leaves["w"], label3.float()).backward()
    ref = {"h": h3.double().requires_grad_(), "w": w.double().requires_grad_(),
           "c": c.detach().double().requires_grad_()}
    cap = ref["c"][..., None]
    logits = cap * torch.tanh(ref["h"] @ ref["w"].T / cap)
    F.cross_entropy(logits.reshape(6, VOCAB), label3.reshape(6)).backward()
    assert leaves["h"].grad.shape == (2, 3, D) and c.grad.shape == (2, 3)
    assert_gradients_match({n: v.grad for n, v in leaves.items()},
                           {n: v.grad for n, v in ref.items()}, "tokens")
