"""The backward through the scores (``algebra.backward_scores``) of a loss on an LM head's
logits: which cascades read their inputs only through ``dot(h, w[i, :])``, and the terms
the engine finds (the statistics of the loss included)."""

from __future__ import annotations

import pytest

from algebra import derive
from algebra.backward_scores import through_scores

STATISTICS = ("s = dot(h, w[i, :])\nm = max(s)\nlse = log(sum(exp(s - m))) + m\n"
              "nll = lse - (1 - ls) * sum(where(i == label, s, 0)) - ls * sum(s) / N\n"
              "loss = where(label >= 0, nll + zc * lse**2, 0)\npred = argmax(s)")


@pytest.mark.parametrize("spec", ["linear_cross_entropy", STATISTICS])
def test_a_loss_on_the_logits_runs_through_them(spec):
    t = through_scores(derive(spec).backward())
    assert list(t.scores.values()) == [("h", "w")]
    vectors = {x.gradient: (x.vector, x.rows) for x in t.terms}
    # dh sums a coefficient times w over the vocabulary; dw one times h over the rows
    assert vectors["dh"] == ("w", True) and vectors["dw"] == ("h", False)
    assert all(v == ("", True) for g, v in vectors.items() if g not in ("dh", "dw"))
    assert "h" not in t.reads and "w" not in t.reads
    assert t.masks == ()  # i == label: the other positions' coefficients are not 0


@pytest.mark.parametrize("spec", [
    "softmax",  # no dot product
    "s = dot(h, w[i, :])\nm = max(s)\nr = sum(exp(s - m) * dot(h, h))",  # h outside a score
    "r = sum(exp(dot(u[i, :], w[i, :])))",  # a dot of two streams: no per-row vector
])
def test_a_cascade_reading_more_than_the_scores_does_not(spec):
    assert through_scores(derive(spec).backward()) is None
