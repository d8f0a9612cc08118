"""The torch-op backward tests' measure (tests/api/test_torch_backward*.py): an op's
gradients, eager or under ``torch.compile(fullgraph=True)``, against torch's autograd of
the float64 reference.  Tolerance: the kernels compute in float32 from float32 inputs, so
each gradient is within a few float32 roundings of the float64 one, relative to its
largest finite value (``TOL``); NaN where the reference is NaN."""

from __future__ import annotations

import torch

TOL = 2e-5


def op_gradients(op, output: str, inputs: dict, upstream: torch.Tensor,
                 compiled: bool = False) -> dict:
    """The gradients of ``inputs`` (tensors and Python scalars by name) through ``op``'s
    ``output`` given ``upstream``."""
    leaves = {k: v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v
              for k, v in inputs.items()}
    index = op.outputs.index(output)

    def model(*args):
        return op(*args)[index]

    run = torch.compile(model, fullgraph=True) if compiled else model
    run(*(leaves[k] for k in op.inputs)).backward(upstream)
    return {k: v.grad for k, v in leaves.items() if isinstance(v, torch.Tensor)}


def assert_gradients_match(got: dict, want: dict, name: str) -> None:
    """Every gradient of ``want`` is in ``got``, with the same NaNs and within ``TOL``."""
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        assert g is not None, f"{name}: no gradient of {k}"
        torch.testing.assert_close(torch.isnan(g), torch.isnan(w), msg=f"{name} d{k}: NaN")
        finite = torch.isfinite(w)
        scale = float(w[finite].abs().max()) if finite.any() else 1.0
        torch.testing.assert_close(g.double()[finite], w[finite], rtol=TOL,
                                   atol=TOL * (1 + scale), msg=f"{name} d{k}")
