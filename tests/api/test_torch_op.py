"""redfuser.torch.op: a compiled cascade as a torch custom op, eager, under
torch.compile(fullgraph=True) and torch.export (static and symbolic sizes), zero-copy,
every result compared with the float64 oracle."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import redfuser
import redfuser.torch as rt
from algebra.library import example_inputs
from tests.support import KERNEL_TOL, assert_indices_equal, assert_matches

RTOL = ATOL = KERNEL_TOL
CASES = {  # library rule -> the parameters passed as Python floats
    "softmax": (), "attention": ("scale",), "moe_routing": (), "rmsnorm_gemm": ("eps",),
}


def _tensors(inputs: dict, scalars) -> dict:
    return {k: float(v) if k in scalars else torch.from_numpy(np.asarray(v, np.float32))
            for k, v in inputs.items()}


def _check(name: str, outs: tuple, inputs: dict):
    op = rt.op(name)
    ref = redfuser.reference(name, inputs)
    # the raw torch op returns what its backward saves after the declared outputs
    # (rmsnorm_gemm's hidden r_sum)
    for out_name, got in zip(op.outputs, outs[:len(op.outputs)], strict=True):
        if got.dtype == torch.int64:
            assert_indices_equal(got.numpy(), ref[out_name], out_name)
        else:
            assert_matches(got.numpy(), ref[out_name], RTOL, ATOL, out_name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_call_matches_the_oracle(name):
    op = rt.op(name, scalars=CASES[name], tune=False)
    inputs = example_inputs(name, n=48, rows=(2, 3), d=16, seed=1)
    args = _tensors(inputs, CASES[name])
    outs = getattr(torch.ops.redfuser, name)(*(args[k] for k in op.inputs))
    _check(name, outs, inputs)
    fake = rt.output_specs(op.kernel.rule, args)  # the fake implementation's answer
    assert [(tuple(o.shape), o.dtype) for o in outs[:len(op.outputs)]] == [
        fake[n] for n in op.outputs]


@pytest.mark.parametrize("requires_grad", [False, True])  # True: detached, still no copy
def test_inputs_and_outputs_reach_the_kernel_without_a_copy(requires_grad):
    op = rt.op("attention", scalars=("scale",), tune=False)
    args = _tensors(example_inputs("attention", n=32, rows=(2, 3), d=16), ("scale",))
    args = {k: v.requires_grad_(requires_grad) if isinstance(v, torch.Tensor) else v
            for k, v in args.items()}
    op(*(args[k] for k in op.inputs))  # the first call works out the signature's plan
    handed = []  # the addresses the compiled function is given
    for key, plan in op.kernel._calls.items():  # (the kernel may be shared with other tests)
        op.kernel._calls[key] = dataclasses.replace(plan, func=lambda *a, f=plan.func: (
            handed.extend(map(_address, a)), f(*a)))
    outs = op(*(args[k] for k in op.inputs))
    tensors = [args[k] for k in op.inputs if isinstance(args[k], torch.Tensor)]
    assert {t.data_ptr() for t in tensors} | {o.data_ptr() for o in outs} <= set(handed)


def _address(arg) -> int:
    """Where a kernel argument's data starts: a torch tensor, a numpy array or a TVM tensor."""
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    if isinstance(arg, np.ndarray):
        return arg.ctypes.data
    return torch.from_dlpack(arg).data_ptr()


def test_torch_compile_fullgraph_traces_the_op_and_follows_new_lengths(monkeypatch):
    op = rt.op("softmax", tune=False)
    sizes = []  # the kinds of size the fake implementation was traced with
    original = rt.output_specs
    monkeypatch.setattr(rt, "output_specs", lambda rule, inputs: sizes.extend(
        type(s) for v in inputs.values() for s in v.shape) or original(rule, inputs))

    def model(x):
        m, d, y = torch.ops.redfuser.softmax(x * 2.0)
        return y + 1.0, m

    compiled = torch.compile(model, fullgraph=True)
    for n in (40, 56):  # the second length makes dynamo trace with a symbolic size
        x = torch.from_numpy(example_inputs("softmax", n=n, rows=(3,), seed=n)["x"])
        y, m = compiled(x)
        ref = redfuser.reference("softmax", {"x": (2.0 * x).numpy()})
        assert_matches(y.numpy() - 1.0, ref["y"], RTOL, ATOL, "y")
        assert_matches(m.numpy(), ref["m"], RTOL, ATOL, "m")
    assert torch.SymInt in sizes and op.kernel.rule.name == "softmax"


class _Router(torch.nn.Module):
    def forward(self, x):
        m, d, p, e = torch.ops.redfuser.moe_routing(x)
        return p / p.sum(-1, keepdim=True), e


def test_torch_export_with_a_symbolic_row_count():
    rt.op("moe_routing", tune=False)
    rows = torch.export.Dim("rows", min=2, max=4096)
    x = torch.from_numpy(example_inputs("moe_routing", n=32, rows=(5,), seed=2)["x"])
    program = torch.export.export(_Router(), (x,), dynamic_shapes={"x": {0: rows}})
    (p_node, e_node), = [n.args[0] for n in program.graph.nodes if n.op == "output"]
    for node in (p_node, e_node):  # the fake implementation kept the row count symbolic
        rows_out, k = node.meta["val"].shape
        assert isinstance(rows_out, torch.SymInt) and k == 8
    for r in (5, 9):
        xr = torch.from_numpy(example_inputs("moe_routing", n=32, rows=(r,), seed=r)["x"])
        p, e = program.module()(xr)
        ref = redfuser.reference("moe_routing", {"x": xr.numpy()})
        assert_matches(p.numpy(), ref["p"] / ref["p"].sum(-1, keepdims=True), RTOL, ATOL, "p")
        assert_indices_equal(e.numpy(), ref["e"], "e")


def test_bad_registrations_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="needs a name"):
        rt.op("m = max(x[i]); d = sum(exp(x[i] - m))")
    with pytest.raises(ValueError, match=r"scalars \['tau'\] are not parameters"):
        rt.op("m = max(x[i]); d = sum(exp(x[i] - m))", name="lse_stats", scalars=("tau",))
    rt.op("m = max(x[i]); d = sum(exp(x[i] - m))", name="lse_stats2")
    with pytest.raises(ValueError, match="already registered for another spec"):
        rt.op("m = max(x[i])", name="lse_stats2")
    with pytest.raises(ValueError, match="Python identifier"):
        rt.op("softmax", name="soft max")
