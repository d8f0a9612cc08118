"""The training bench's steps at a tiny scale (``redfuser.tools.train_bench.case``): every
implementation of the LM head's rows runs a step and reports a time and a peak, and the
mean-loss row's redfuser step leaves the gradients torch's mean loss gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from redfuser.tools import train_bench

SCALE = 1e-4  # element counts x 1e-4: h 41 x 20, w 320 x 20


@pytest.mark.parametrize("workload", [w for w in train_bench.WORKLOADS if "linear_ce" in w])
@pytest.mark.parametrize("impl", ["redfuser", "torch"])
def test_a_step_runs_and_is_timed(workload, impl):
    got = train_bench.case(workload, impl, SCALE, repeat=1)
    assert got["ms"] > 0 and got["peak_mb"] >= 0


def test_the_mean_loss_step_gives_torchs_gradients():
    (workload,) = train_bench.MEAN_LOSS
    op, out, spec = train_bench.WORKLOADS[workload]
    inputs = train_bench._inputs(torch, spec, SCALE)
    train_bench._step_fn(torch, "redfuser", op, out, inputs, mean=True)()
    h, w = (inputs[n].detach().double().requires_grad_() for n in ("h", "w"))
    F.cross_entropy(h @ w.T, inputs["label"].long()).backward()
    for got, want in ((inputs["h"].grad, h.grad), (inputs["w"].grad, w.grad)):
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
