"""redfuser.torch.op with symbolic sizes that must be equal (torch.compile's recompile,
torch.export's shared Dims) and with tensors that require grad, each result compared with
a float64 torch reference."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
    statically_known_true,
)

import redfuser
import redfuser.torch as rt
from tests.support import KERNEL_TOL

TOL = KERNEL_TOL
# attention with v spelled v[i]: the layout reads v as (*rows, N, D) by comparing sizes
ATTENTION_V_UNDECLARED = ("s = dot(q, k[i, :]) * scale; m = max(s); d = sum(exp(s - m)); "
                          "o = sum(exp(s - m) * v[i]) / d")
ZERO_PRODUCT = "p = prod(x[i])"  # a factor can be 0: its backward is refused by name


def _attention64(q, k, v, scale):
    """o of attention over q (H, L, D), k and v (H, 1, N, D), in float64."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    return torch.softmax(q @ k[:, 0].transpose(-1, -2) * scale, -1) @ v[:, 0]


def _symbolic(**tensors) -> tuple[ShapeEnv, dict]:
    """Fake tensors whose every size is a symbol of its own, as dynamo's recompile makes them."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    return env, {k: mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim())) if isinstance(t, torch.Tensor) else t
        for k, t in tensors.items()}


def _equal(a, b) -> bool:
    return statically_known_true(a == b)


@pytest.mark.parametrize("spec", ["attention", ATTENTION_V_UNDECLARED])
def test_fake_shapes_take_the_inputs_symbols_and_tie_the_equal_ones(spec):
    env, f = _symbolic(q=torch.zeros(2, 3, 16), k=torch.zeros(2, 1, 40, 16), scale=0.1,
                       v=torch.zeros(2, 1, 40, 16))
    specs = rt.output_specs(redfuser.derive(spec), f)
    (m, _), (d, _), (o, _) = specs.values()
    q, k, v = f["q"].shape, f["k"].shape, f["v"].shape
    assert all(isinstance(s, torch.SymInt) for s in o)
    assert len(m) == len(d) == 2 and all(map(_equal, m, q[:2])) and all(map(_equal, d, q[:2]))
    assert len(o) == 3 and all(map(_equal, o, q))
    # k's and v's heads and D are now known to be q's, and k's N v's
    assert _equal(k[0], q[0]) and _equal(v[0], q[0]) and _equal(k[3], q[2])
    assert _equal(v[3], q[2]) and _equal(v[2], k[2])
    # the ranks decide how v is read: N and D stay free of each other (export needs that)
    assert not statically_known_true(v[3] != k[2])


def test_a_reading_decided_by_sizes_is_guarded():
    """v (N, D) next to q (L, D): read as (N, D) because (N,) does not fit, which holds only
    while D != N (at D == N the call reads it as (N,)): the graph must not be reused there."""
    env, f = _symbolic(q=torch.zeros(3, 16), k=torch.zeros(40, 16), scale=0.1,
                       v=torch.zeros(40, 16))
    *_, (o, _) = rt.output_specs(redfuser.derive(ATTENTION_V_UNDECLARED), f).values()
    assert len(o) == 2 and _equal(o[0], f["q"].shape[0]) and _equal(o[1], f["q"].shape[1])
    assert statically_known_true(f["v"].shape[1] != f["v"].shape[0])


def test_torch_compile_follows_every_axis_to_new_sizes():
    attention = rt.op("attention", scalars=("scale",), tune=False)
    compiled = torch.compile(attention, fullgraph=True)
    for h, L, n, D in ((3, 4, 24, 16), (2, 3, 40, 8)):  # the second traces every size symbolic
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(*s, generator=g) for s in ((h, L, D), (h, 1, n, D), (h, 1, n, D)))
        o = compiled(q, k, 0.125, v)[2]
        assert o.shape == (h, L, D)
        torch.testing.assert_close(o.double(), _attention64(q, k, v, 0.125), rtol=TOL, atol=TOL)


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.ops.redfuser.attention(q, k, 0.125, v)[2]


def test_torch_export_with_heads_and_d_shared_by_q_k_v():
    rt.op("attention", scalars=("scale",), tune=False)
    H, D = torch.export.Dim("H", max=64), torch.export.Dim("D", max=256)
    args = (torch.randn(2, 3, 16), torch.randn(2, 1, 40, 16), torch.randn(2, 1, 40, 16))
    program = torch.export.export(_Attention(), args, dynamic_shapes={
        "q": {0: H, 2: D}, "k": {0: H, 3: D}, "v": {0: H, 3: D}})
    for h, d in ((3, 8), (5, 24)):
        g = torch.Generator().manual_seed(d)
        q, k, v = (torch.randn(*s, generator=g) for s in ((h, 3, d), (h, 1, 40, d), (h, 1, 40, d)))
        o = program.module()(q, k, v)
        torch.testing.assert_close(o.double(), _attention64(q, k, v, 0.125), rtol=TOL, atol=TOL)


def test_requires_grad_computes_and_a_refused_backward_names_the_op_and_why():
    """A product whose factors can be 0 has no derived backward: the backward raises with
    the reason (``algebra.backward_products.ZERO_FACTOR``) instead of leaving x without a
    gradient."""
    rt.op(ZERO_PRODUCT, name="zero_product", tune=False)
    x = (torch.rand(4, 64) + 0.5).requires_grad_()
    g = torch.ops.redfuser.zero_product(x)
    torch.testing.assert_close(g.double(), x.detach().double().prod(-1), rtol=TOL, atol=TOL)
    assert g.requires_grad and g.grad_fn is not None  # a graph, not silently cut
    with pytest.raises(NotImplementedError,
                       match=r"redfuser\.zero_product: p = prod\(x\[i\]\): a factor can be 0"):
        g.sum().backward()
    assert x.grad is None


def test_a_staged_rule_is_an_op_that_differentiates():
    """A staged library rule (two passes) made an op: its forward is the oracle's (it used to
    fail with AttributeError: the op built its kernel from the StagedRule itself), and its
    backward is the whole cascade's (more in tests/api/test_torch_backward_staged.py)."""
    rt.op("relu_sum", tune=False)
    x = torch.randn(3, 50, requires_grad=True)
    t = torch.full((3,), 1.0)
    s = torch.ops.redfuser.relu_sum(x, t)[1]  # then m_at, the argmax the backward reads
    want = redfuser.reference("relu_sum", {"x": x.detach().double().numpy(), "t": t.numpy()})
    torch.testing.assert_close(s.double(), torch.from_numpy(want["s"]), rtol=TOL, atol=TOL)
    s.sum().backward()
    ref = x.detach().double().requires_grad_()
    torch.relu(ref - ref.max(-1, keepdim=True).values + 1.0).sum().backward()
    torch.testing.assert_close(x.grad.double(), ref.grad, rtol=TOL, atol=TOL)


def test_requires_grad_under_torch_compile():
    rt.op(ZERO_PRODUCT, name="zero_product", tune=False)
    lin = torch.nn.Linear(16, 16)  # parameters: every forward builds a graph

    def model(x):
        return torch.ops.redfuser.zero_product(lin(x))

    x = torch.randn(3, 16)
    g = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(g.double(), lin(x).detach().double().prod(-1),
                               rtol=TOL, atol=TOL)
    with pytest.raises(NotImplementedError, match=r"redfuser\.zero_product: .*a factor can be 0"):
        g.sum().backward()


def test_a_kernel_copies_a_misaligned_tensor_that_requires_grad():
    """redfuser.compile's call path with its plan made: a misaligned tensor goes through
    redfuser.tvm.runtime.from_dlpack's aligned copy, where torch's DLPack export refused a tensor
    that requires grad (BufferError)."""
    kernel = redfuser.compile("softmax", tune=False)
    kernel(x=torch.zeros(4, 64))  # the plan for (4, 64) float32 tensors
    x = torch.randn(4 * 64 + 1, requires_grad=True)[1:].view(4, 64)  # 4 bytes off alignment
    y = kernel(x=x)["y"]
    torch.testing.assert_close(y.double(), torch.softmax(x.detach().double(), -1),
                               rtol=TOL, atol=TOL)
