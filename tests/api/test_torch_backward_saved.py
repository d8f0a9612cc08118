"""A torch op whose backward reads a per-element output the forward saved instead of
recomputing it (``algebra.backward_saved``): softmax's backward op takes y, not x, and
trains from y as the forward stored it.  The float32 gradients, eager and under
``torch.compile(fullgraph=True)``, and gradcheck on float64 kernels are
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


def _packed(op, *args) -> list[torch.Tensor]:
    """The tensors the autograd graph saves for ``op(*args)``'s backward."""
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                  lambda t: t):
        outputs = op(*args)
    return packed, outputs


def test_the_forward_saves_only_what_the_backward_reads():
    """softmax saves d and y (its backward's reads), not x: a model that drops x after the
    softmax does not keep it alive for the backward; layernorm saves x, its statistics and
    g, not b (whose gradient is dy summed) nor y."""
    x = torch.randn(4, 64, requires_grad=True)
    packed, (_, d, y) = _packed(rt.op("softmax", tune=False), x)
    assert {t.data_ptr() for t in packed} == {d.data_ptr(), y.data_ptr()}
    g, b = torch.ones(64, requires_grad=True), torch.zeros(64, requires_grad=True)
    packed, (mean, var, y) = _packed(rt.op("layernorm", scalars=("eps",), tune=False),
                                     x, 1e-5, g, b)
    assert {t.data_ptr() for t in packed} == {x.data_ptr(), mean.data_ptr(),
                                              var.data_ptr(), g.data_ptr()}
    y.sum().backward()  # b's gradient from shapes alone: dy summed over the rows
    assert torch.equal(b.grad, torch.full((64,), 4.0))
