"""The backward through the logits (``algebra.backward_logits``): which cascades read
their inputs only through ``dot(h, w[i, :])``, and the logits' gradient the engine proves."""

from __future__ import annotations

import pytest

from algebra import derive
from algebra.backward_logits import through_logits

STATISTICS = ("s = dot(h, w[i, :])\nm = max(s)\nlse = log(sum(exp(s - m))) + m\n"
              "nll = lse - (1 - ls) * sum(where(i == label, s, 0)) - ls * sum(s) / N\n"
              "loss = where(label >= 0, nll + zc * lse**2, 0)\npred = argmax(s)")


@pytest.mark.parametrize("spec", ["linear_cross_entropy", STATISTICS])
def test_a_loss_on_the_logits_runs_through_them(spec):
    t = through_logits(derive(spec).backward())
    assert (t.row, t.shared) == ("h", "w") and t.backward.proven
    assert set(t.reads) <= {"dloss", "i", "label", "lse", "lse_sum", "m", "N", "ls", "zc"}
    assert "h" not in t.reads and "w" not in t.reads


@pytest.mark.parametrize("spec", [
    "softmax",  # no dot product
    "attention",  # v is read outside the scores
    "s = dot(h, w[i, :])\nm = max(s)\nr = sum(exp(s - m) * dot(h, h))",  # two dots
    "r = sum(exp(dot(u[i, :], w[i, :])))",  # a dot of two streams: no per-row vector
])
def test_a_cascade_reading_more_than_the_logits_does_not(spec):
    assert through_logits(derive(spec).backward()) is None
