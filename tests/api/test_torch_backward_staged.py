"""Training through staged ops (``mad``, ``relu_sum``, ``threshold_mass``: two passes, the
second reading the first's finals): ``loss.backward()`` gives torch's autograd of a float64
torch reference (the backward is the whole cascade's: ``algebra.stages_backward``).

Rows put elements exactly on each kink, as torch defines the derivative there: x at mad's
mean (abs'(0) = 0), an element at relu_sum's max - t (relu'(0) = 0), probabilities exactly
threshold_mass's t (the select's branch; no gradient through its condition); and ties in the
max (torch's ``max(dim)`` sends the gradient to the first maximum, the forward's argmax),
-inf tails where the op is defined there, N = 1.  Tolerance as tests/api/
test_torch_backward.py's: float32 kernels, 2e-5 of the largest gradient plus 2e-5 absolute.
"""

from __future__ import annotations

import math

import pytest
import torch

import redfuser.torch as rt
from algebra import derive
from tests.support.gradients import assert_gradients_match, op_gradients


def _mad(x):
    return (x - x.mean(-1, keepdim=True)).abs().mean(-1)


def _relu_sum(x, t):
    t = t[..., None] if isinstance(t, torch.Tensor) and t.dim() else t  # each row's own
    return torch.relu(x - x.max(-1, keepdim=True).values + t).sum(-1)


def _threshold_mass(x, t):
    p = torch.softmax(x, -1)
    return torch.where(p >= t, p, torch.zeros_like(p)).sum(-1)


def _mad_rows(n: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(4, n, generator=g)
    if n > 1:  # n odd: x[1, n // 2] is the mean exactly (0); row 2: every x at the mean
        x[1] = torch.arange(n, dtype=torch.float32) - (n - 1) / 2
        x[2] = 1.5
    return x


def _relu_rows(n: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(4, n, generator=g) * 2
    if n > 2:  # a tie in the max, an element at max - t exactly (t = 1), a -inf tail
        x[1, [1, 4]] = x[1].max() + 1.0
        x[2] = x[2].clamp(max=1.5)
        x[2, [0, 3]] = torch.tensor([3.0, 2.0])
        x[3, -2:] = -math.inf
    return x


def _mass_rows(n: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(4, n, generator=g) * 3
    if n > 2:  # every probability exactly t = 1/n; a tie in the max; a -inf tail
        x[1] = 0.0
        x[2, :2] = x[2].max() + 1.0
        x[3, -2:] = -math.inf
    return x


# op -> (its differentiated output, the float64 torch reference, the rows of x, t or None)
CASES = {
    "mad": ("mad", _mad, _mad_rows, None),
    "relu_sum": ("s", _relu_sum, _relu_rows, 1.0),
    "threshold_mass": ("mass", _threshold_mass, _mass_rows, "1/n"),
}


def _inputs(name: str, n: int) -> dict:
    _, _, rows, t = CASES[name]
    x = rows(n, torch.Generator().manual_seed(n))
    return {"x": x} if t is None else {"x": x, "t": 1.0 / n if t == "1/n" else t}


def _torch_gradients(name: str, inputs: dict, upstream: torch.Tensor) -> dict:
    """torch's autograd of the float64 reference, per tensor input."""
    leaves = {k: v.double().requires_grad_() if isinstance(v, torch.Tensor) else v
              for k, v in inputs.items()}
    CASES[name][1](*leaves.values()).backward(upstream.double())
    return {k: v.grad for k, v in leaves.items() if isinstance(v, torch.Tensor)}


def _op_gradients(name: str, inputs: dict, upstream: torch.Tensor, compiled=False) -> dict:
    """The op's gradients; a name per schema (t a float or a tensor), as one name is one op
    for every test module."""
    scalars = tuple(k for k, v in inputs.items() if isinstance(v, float))
    schema = "" if len(inputs) == 1 else "_float_t" if scalars else "_tensor_t"
    op = rt.op(name, name=name + schema, scalars=scalars, tune=False)
    return op_gradients(op, CASES[name][0], inputs, upstream, compiled)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("n", [9, 1])
def test_staged_gradients_match_torch_autograd_of_the_float64_reference(name, n):
    inputs = _inputs(name, n)
    upstream = torch.randn(4, generator=torch.Generator().manual_seed(1))
    got = _op_gradients(name, inputs, upstream)
    assert_gradients_match(got, _torch_gradients(name, inputs, upstream), name)
    if name == "mad" and n > 1:  # at the kinks: abs'(0) = 0, so the mean's term alone
        assert got["x"][2].abs().max() == 0 and torch.isfinite(got["x"]).all()


def test_a_learned_threshold_gets_its_gradient_summed_over_the_rows():
    """relu_sum's t as a tensor that requires grad (one for every row, or each row's own):
    dt = sum over the row where x - m + t > 0 of ds, summed over the rows that share t."""
    x = _relu_rows(9, torch.Generator().manual_seed(2))
    upstream = torch.randn(4, generator=torch.Generator().manual_seed(3))
    for t in (torch.tensor(0.75), torch.tensor([0.5, 1.0, 1.0, 2.0])):
        inputs = {"x": x, "t": t}
        assert_gradients_match(_op_gradients("relu_sum", inputs, upstream),
                                _torch_gradients("relu_sum", inputs, upstream), "relu_sum")


def test_no_gradient_flows_through_a_select_condition():
    """threshold_mass reads t only in the condition p >= t: its backward differentiates x
    branch by branch, and t's gradient is 0 (torch's convention: a condition passes
    nothing), so a training step with a learned t runs instead of failing."""
    op = rt.op("threshold_mass", name="threshold_mass_tensor_t", tune=False)
    b = derive("threshold_mass").backward()
    assert "only through a condition" in b.zero["t"] and "t" not in b.gradients
    assert ("d loss / d t = 0 at N = 2", True) in b.proofs
    assert "gradient of t: 0, " in str(b)
    x = _mass_rows(9, torch.Generator().manual_seed(4)).requires_grad_()
    t = torch.tensor(0.05, requires_grad=True)
    upstream = torch.randn(4, generator=torch.Generator().manual_seed(6))
    (op(x, t)[op.outputs.index("mass")] * upstream).sum().backward()
    assert t.grad is not None and t.grad.shape == t.shape and float(t.grad) == 0.0
    x64 = x.detach().double().requires_grad_()
    (_threshold_mass(x64, 0.05) * upstream.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2e-5, atol=2e-5)


def test_a_per_row_scalar_the_outputs_do_not_depend_on_gets_a_zero_gradient():
    """softmax is shift-invariant: a learned per-row shift of every score has gradient 0
    (proven: its adjoint simplifies to 0), also under torch.compile; the scores' own
    gradient is torch's."""
    spec = "m = max(x[i] + a)\nd = sum(exp(x[i] + a - m))\ny[i] = exp(x[i] + a - m) / d"
    b = derive(spec).backward()
    assert "a" in b.zero and "x" in b.gradients and b.proven
    assert ("d loss / d a = 0 at N = 3", True) in b.proofs
    op = rt.op(spec, name="shifted_softmax", tune=False)
    g = torch.Generator().manual_seed(7)
    upstream = torch.randn(3, 6, generator=g)
    for compiled in (False, True):
        x = torch.randn(3, 6, generator=g).requires_grad_()
        a = torch.randn(3, generator=g).requires_grad_()
        fn = torch.compile(op, fullgraph=True) if compiled else op
        (fn(x, a)[op.outputs.index("y")] * upstream).sum().backward()
        assert torch.equal(a.grad, torch.zeros(3))
        x64 = x.detach().double().requires_grad_()
        (torch.softmax(x64, -1) * upstream.double()).sum().backward()
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2e-5, atol=2e-5)


def test_staged_gradients_under_torch_compile_fullgraph():
    """relu_sum: a staged forward that also returns the argmax its backward reads."""
    inputs = _inputs("relu_sum", 9)
    upstream = torch.randn(4, generator=torch.Generator().manual_seed(5))
    assert_gradients_match(_op_gradients("relu_sum", inputs, upstream, compiled=True),
                            _torch_gradients("relu_sum", inputs, upstream), "relu_sum")


def _float64(g: torch.Generator, *shape, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)


# op (registered under its own name, t a learned tensor) -> float64 inputs
GRADCHECK = {
    "mad": lambda g: {"x": _float64(g, 2, 5)},
    "relu_sum": lambda g: {"x": _float64(g, 2, 5), "t": torch.tensor(
        0.8, dtype=torch.float64, requires_grad=True)},
    "threshold_mass": lambda g: {"x": _float64(g, 2, 5), "t": torch.tensor(
        0.15, dtype=torch.float64, requires_grad=True)},  # its gradient 0: no p is near t
}


@pytest.mark.parametrize("name", sorted(GRADCHECK))
def test_gradcheck_on_float64_kernels(name):
    """float64 tensors run float64 kernels for the staged forward and the backward cascades
    alike: the forward equals torch's float64 reference to 1e-12, and gradcheck checks the
    derived gradients against finite differences of it."""
    inputs = GRADCHECK[name](torch.Generator().manual_seed(6))
    op = rt.op(name, name=f"{name}_gradcheck", tune=False)
    index = op.outputs.index(CASES[name][0])
    args = tuple(inputs[n] for n in op.inputs)
    got = op(*args)[index]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, CASES[name][1](*(inputs[n] for n in inputs)),
                               rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *a: op(*a)[index], args)


def test_a_users_staged_rule_is_an_op_that_differentiates():
    """A user's spec derived with passes="auto" (no one-pass rule: relu's kink sits at the
    final mean) made an op: dx and the learned p against torch's autograd."""
    rule = derive("mu = sum(x[i]) / N\nv = sum(relu(x[i] - mu + p))", passes="auto")
    op = rt.op(rule, name="relu_above_mean", tune=False)
    g = torch.Generator().manual_seed(8)
    inputs = {"x": torch.randn(3, 10, generator=g), "p": torch.tensor([0.0, 0.3, -0.2])}
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    upstream = torch.randn(3, generator=g)
    op(*(leaves[k] for k in op.inputs))[op.outputs.index("v")].backward(upstream)
    ref = {k: v.double().requires_grad_() for k, v in inputs.items()}
    torch.relu(ref["x"] - ref["x"].mean(-1, keepdim=True) + ref["p"][:, None]).sum(-1) \
        .backward(upstream.double())
    assert_gradients_match({k: v.grad for k, v in leaves.items()},
                            {k: v.grad for k, v in ref.items()}, "relu_above_mean")


@pytest.mark.parametrize("n", [7, 1])
def test_a_user_cascade_whose_kinks_nest_trains(n):
    """w = sum(relu(x - v)) where v = sum(relu(x - mean)) itself (three passes): its proven
    backward gives torch's gradients, relu'(0) = 0 at a mean element (row 1, n odd)."""
    spec = "mu = sum(x[i]) / N\nv = sum(relu(x[i] - mu))\nw = sum(relu(x[i] - v))"
    op = rt.op(derive(spec, passes="auto"), name="nested_kinks", tune=False)
    x = torch.randn(4, n, generator=torch.Generator().manual_seed(n)) * 2
    x[1] = torch.arange(n, dtype=torch.float32) - (n - 1) / 2
    upstream = torch.randn(4, generator=torch.Generator().manual_seed(2))
    wide = x.double().requires_grad_()
    v = torch.relu(wide - wide.mean(-1, keepdim=True)).sum(-1, keepdim=True)
    torch.relu(wide - v).sum(-1).backward(upstream.double())
    assert_gradients_match(op_gradients(op, "w", {"x": x}, upstream), {"x": wide.grad},
                           "nested_kinks")
