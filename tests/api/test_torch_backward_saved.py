"""A torch op whose backward reads a per-element output the forward saved instead of
recomputing it (``algebra.backward_saved``): softmax's backward op takes y, not x, and
trains from y as the forward stored it.  The float32 gradients, eager and under
``torch.compile(fullgraph=True)``, and gradcheck on the float64 path are
tests/api/test_torch_backward.py's (softmax among the library ops)."""

from __future__ import annotations

import pytest
import torch

import redfuser.torch as rt

ULPS = 2  # y, the upstream and dx each rounded to the dtype once: half a unit each at most

def test_softmaxs_backward_reads_its_saved_output_not_its_input():
    """The backward op takes y (the forward's output, saved by ctx) and d: not x and m, from
    which it would recompute exp(x - m)."""
    rt.op("softmax", tune=False)
    schema = torch.ops.redfuser.softmax_backward.default._schema
    assert [a.name for a in schema.arguments] == ["dy", "y", "d"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_softmax_trains_from_its_low_precision_y(dtype):
    """The backward reads y as the forward stored it (rounded to the dtype, as torch's own
    softmax backward does): dx within two units in the last place of its scale of torch's
    float64 autograd."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 256, generator=g) * 3).to(dtype).requires_grad_()
    y = rt.op("softmax", tune=False)(x)[2]
    up = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(up)
    wide = x.detach().double().requires_grad_()
    torch.softmax(wide, -1).backward(up.double())
    assert x.grad.dtype == dtype
    ulp = torch.finfo(dtype).eps
    assert (x.grad.double() - wide.grad).abs().max() <= ULPS * ulp * wide.grad.abs().max()
