"""Training through redfuser ops: ``loss.backward()`` gives torch's gradients.

Each library op's gradients (from its derived, proven backward: ``algebra.backward``) are
compared with torch's own autograd of a float64 torch reference, eager and under
``torch.compile(fullgraph=True)``, on rows with -inf entries, a fully masked row, N = 1 and
ties in the max.  Tolerance: the kernels compute in float32 with float32 inputs, so the
gradients carry a few float32 roundings relative to their scale (measured ~1e-7); 2e-5 of
the gradient's largest magnitude, plus the same absolute, leaves room.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import redfuser.torch as rt
from algebra import derive, reference
from tests.support.gradients import TOL, assert_gradients_match, op_gradients

EPS = 1e-5


def _layernorm(x, g, b, eps):  # written out: g and b may be each row's own
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps) * g + b


def _rmsnorm(x, g, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


# op -> (its differentiated output, the float64 torch reference of that output, inputs:
# name -> a maker (rows, n, generator) of a float32 tensor or a float)
CASES = {
    "softmax": ("y", lambda x: torch.softmax(x, -1), {"x": "logits"}),
    "log_softmax": ("y", lambda x: torch.log_softmax(x, -1), {"x": "logits"}),
    "logsumexp": ("lse", lambda x: torch.logsumexp(x, -1), {"x": "logits"}),
    "cross_entropy": ("loss", lambda x, t: torch.logsumexp(x, -1) - (x * t).sum(-1),
                      {"x": "logits", "t": "soft_target"}),
    "layernorm": ("y", _layernorm, {"x": "normal", "g": "weight", "b": "weight", "eps": EPS}),
    "rmsnorm": ("y", _rmsnorm, {"x": "normal", "g": "weight", "eps": EPS}),
    "l2_normalize": ("y", lambda x: x / x.norm(dim=-1, keepdim=True), {"x": "normal"}),
    "variance": ("var", lambda x: x.var(-1, unbiased=False), {"x": "normal"}),
    "rmsnorm_gemm": ("y", lambda x, eps, w: _rmsnorm(x, torch.ones_like(x), eps) @ w,
                     {"x": "normal", "eps": EPS, "w": "matrix"}),
    # its max is differentiated at its selection (the adjoint's 0 is not proven symbolically)
    "softmax_entropy": ("h", lambda x, t: torch.distributions.Categorical(
        logits=x / t).entropy(), {"x": "normal", "T": 0.7}),
    # a product (its log-derivative): g = exp(mean(x)), what the spec's g equals
    "geometric_mean": ("g", lambda x: torch.exp(x.mean(-1)), {"x": "normal"}),
}


def _make(kind, rows: int, n: int, g: torch.Generator):
    if not isinstance(kind, str):
        return kind
    if kind == "weight":  # shared by the rows: its gradient sums over them
        return torch.rand(n, generator=g) + 0.5
    if kind == "matrix":  # a GEMM's weight, N x 6 (rmsnorm_gemm: dw in the other orientation)
        return torch.randn(n, 6, generator=g) / math.sqrt(n)
    if kind == "soft_target":
        return torch.softmax(torch.randn(rows, n, generator=g), -1)
    x = torch.randn(rows, n, generator=g) * (3.0 if kind == "logits" else 1.0)
    if kind == "logits" and n > 2:  # a masked tail, a fully masked row, a tie in the max
        x[0, -2:] = -math.inf
        x[1] = -math.inf if rows > 3 else x[1]
        x[2, :2] = x[2].max() + 1.0
    return x


def _inputs(name: str, rows: int, n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: _make(kind, rows, n, g) for k, kind in CASES[name][2].items()}


def _torch_gradients(name: str, inputs: dict, upstream: torch.Tensor) -> dict:
    """torch's autograd of the float64 reference, per tensor input."""
    out_name, fn, _ = CASES[name]
    leaves = {k: v.double().requires_grad_() if isinstance(v, torch.Tensor) else v
              for k, v in inputs.items()}
    fn(*leaves.values()).backward(upstream.double())
    return {k: v.grad for k, v in leaves.items() if isinstance(v, torch.Tensor)}


def _op_gradients(name: str, inputs: dict, upstream: torch.Tensor, compiled: bool) -> dict:
    op = rt.op(name, scalars=tuple(k for k, v in inputs.items() if isinstance(v, float)),
               tune=False)
    return op_gradients(op, CASES[name][0], inputs, upstream, compiled)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("rows,n", [(5, 37), (3, 1)])
def test_eager_gradients_match_torch_autograd_of_the_float64_reference(name, rows, n):
    inputs = _inputs(name, rows, n, seed=rows * n)
    out = CASES[name][1](*(v.double() if isinstance(v, torch.Tensor) else v
                           for v in inputs.values()))
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    assert_gradients_match(_op_gradients(name, inputs, upstream, compiled=False),
                            _torch_gradients(name, inputs, upstream), name)


@pytest.mark.parametrize("name", ["softmax", "layernorm", "cross_entropy", "rmsnorm_gemm",
                                  "geometric_mean"])
def test_gradients_under_torch_compile_fullgraph(name):
    inputs = _inputs(name, 4, 24, seed=7)
    out = CASES[name][1](*(v.double() if isinstance(v, torch.Tensor) else v
                           for v in inputs.values()))
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    assert_gradients_match(_op_gradients(name, inputs, upstream, compiled=True),
                            _torch_gradients(name, inputs, upstream), name)


def test_statistics_are_not_differentiable_outputs():
    """softmax's m and d are what the backward reads, not values it differentiates: torch
    sees them as it sees indices (no gradient), so a loss on them fails loudly."""
    m, d, y = rt.op("softmax", tune=False)(torch.randn(2, 8, requires_grad=True))
    assert y.requires_grad and not m.requires_grad and not d.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        d.sum().backward()


def test_a_hidden_saved_sum_is_returned_after_the_declared_outputs():
    """log_softmax's backward reads lse_sum, which the spec does not name: the op's forward
    runs the cascade with it named and returns it last; the CascadeOp drops it."""
    op = rt.op("log_softmax", tune=False)
    x = torch.randn(3, 10)
    assert len(op(x)) == len(op.outputs) == 3
    *_, lse_sum = torch.ops.redfuser.log_softmax(x)
    m = x.amax(-1)
    torch.testing.assert_close(lse_sum, torch.exp(x - m[:, None]).sum(-1))


def _attention_reference(q, k, v, scale, causal: bool):
    """torch's float64 attention: softmax(q k^T * scale, masked above the diagonal) v."""
    s = q @ k[:, 0].transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v[:, 0]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", ["attention", "causal_attention"])
@pytest.mark.parametrize("length", [6, 1])
def test_attention_gradients_match_torch_autograd(name, length, compiled):
    """dq, dk, dv of (causal) attention: the rows' kernel for dq, the other orientation's
    for dk and dv (queries as the stream), against torch's autograd in float64; causal rows
    see 1 to L keys (the first query sees only itself)."""
    g = torch.Generator().manual_seed(length)
    heads, d, scale = 2, 4, 0.5
    q, k, v = (torch.randn(*shape, generator=g) for shape in
               ((heads, length, d), (heads, 1, length, d), (heads, 1, length, d)))
    inputs = {"q": q, "k": k, "v": v, "scale": scale}
    if name == "causal_attention":
        inputs["pos"] = torch.arange(length, dtype=torch.float32).reshape(1, length)
    op = rt.op(name, scalars=("scale",), tune=False)
    leaves = {n: t.clone().requires_grad_() if n in "qkv" else t for n, t in inputs.items()}

    def model(*args):
        return op(*args)[op.outputs.index("o")]

    run = torch.compile(model, fullgraph=True) if compiled else model
    upstream = torch.randn(heads, length, d, generator=g)
    run(*(leaves[n] for n in op.inputs)).backward(upstream)
    ref = {n: inputs[n].double().requires_grad_() for n in "qkv"}
    _attention_reference(ref["q"], ref["k"], ref["v"], scale,
                         name == "causal_attention").backward(upstream.double())
    assert_gradients_match({n: leaves[n].grad for n in "qkv"},
                            {n: ref[n].grad for n in "qkv"}, name)


# linear_cross_entropy with the statistics users ask fused kernels for, as lines of the spec:
# label smoothing ls, z-loss zc * lse**2, ignored rows (label < 0), the argmax for accuracy
LCE_STATISTICS = ("s = dot(h, w[i, :])\nm = max(s)\nlse = log(sum(exp(s - m))) + m\n"
                  "nll = lse - (1 - ls) * sum(where(i == label, s, 0)) - ls * sum(s) / N\n"
                  "loss = where(label >= 0, nll + zc * lse**2, 0)\npred = argmax(s)")


def _lce_reference(h, w, label, ls: float, zc: float):
    """torch's float64 loss of the spec above (plain cross-entropy at ls = zc = 0)."""
    logits = h @ w.T
    lse = torch.logsumexp(logits, -1)
    picked = logits.gather(-1, label.clamp(min=0)[:, None])[:, 0]
    nll = lse - (1 - ls) * picked - ls * logits.mean(-1)
    return torch.where(label >= 0, nll + zc * lse ** 2, torch.zeros_like(nll)), logits


@pytest.mark.parametrize("statistics", [False, True])
def test_linear_cross_entropy_gradients_match_torch_autograd(statistics):
    """dh (the rows' orientation) and dw (the vocabulary rows' kernel, the batch rows as its
    stream) against torch's autograd of F.cross_entropy(h @ w.T) in float64; with the
    statistics, a row with an ignored label gets no gradient and pred is torch's argmax."""
    g = torch.Generator().manual_seed(3)
    rows, vocab, d = 6, 50, 8
    h, w = torch.randn(rows, d, generator=g), torch.randn(vocab, d, generator=g) / 3
    label = torch.randint(0, vocab, (rows,), generator=g)
    ls, zc = (0.1, 1e-2) if statistics else (0.0, 0.0)
    if statistics:
        label[2] = -100  # an ignored row
        op = rt.op(LCE_STATISTICS, name="lce_statistics", scalars=("ls", "zc"), tune=False)
    else:
        op = rt.op("linear_cross_entropy", tune=False)
    leaves = {"h": h.clone().requires_grad_(), "w": w.clone().requires_grad_(),
              "label": label.float(), "ls": ls, "zc": zc}
    out = dict(zip(op.outputs, op(*(leaves[n] for n in op.inputs)), strict=True))
    upstream = torch.randn(rows, generator=g)
    out["loss"].backward(upstream)
    ref = {"h": h.double().requires_grad_(), "w": w.double().requires_grad_()}
    loss, logits = _lce_reference(ref["h"], ref["w"], label, ls, zc)
    loss.backward(upstream.double())
    torch.testing.assert_close(out["loss"].double(), loss, rtol=1e-5, atol=1e-5)
    assert_gradients_match({n: leaves[n].grad for n in "hw"}, {n: ref[n].grad for n in "hw"},
                            "linear_cross_entropy")
    if statistics:
        assert (leaves["h"].grad[2] == 0).all()
        assert out["pred"].long().tolist() == logits.argmax(-1).tolist()


def test_an_op_with_one_output_returns_it_and_differentiates():
    """torch's schema makes a lone output a bare Tensor: the op still reads as a tuple and
    its backward runs (a one-output backward cascade, linear_cross_entropy's dh, hit this)."""
    op = rt.op("r = sum(x[i] * x[i])", name="sum_of_squares", tune=False)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    (r,) = op(x)
    upstream = torch.tensor([1.0, -2.0, 0.5])
    r.backward(upstream)
    torch.testing.assert_close(r, (x * x).sum(-1).detach())
    torch.testing.assert_close(x.grad, 2 * x.detach() * upstream[:, None])


def test_compile_caches_are_keyed_by_the_derived_backwards():
    """A graph torch.compile cached on disk with another version's backward (other
    arguments) must never be reused: registering a differentiable op changes the cache key
    tag, after the user's own tag."""
    before = torch.compiler.config.cache_key_tag
    rt.op("r = sum(exp(x[i]) * x[i])", name="tagged_sum", tune=False)
    after = torch.compiler.config.cache_key_tag
    assert after != before and after.startswith(rt._USER_TAG + "redfuser-")


@pytest.mark.parametrize("compiled", [False, True])
def test_selection_gradients_go_to_the_elements_the_forward_selected(compiled):
    """moe_routing's top-8 router probabilities and greedy_token's largest probability:
    the gradient reaches the selected logits directly and every logit through the softmax
    (torch's subgradient of topk / max(dim): to the returned indices).  Rows without ties
    match torch.topk / torch.max themselves; a row of ties (four equal logits, more than
    the 2 a top-2 of them keeps) matches torch's autograd of the probabilities gathered at
    the indices the op returned, and those are the lowest (ours; torch.topk's order among
    equal values is its implementation's)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 24, generator=g) * 2
    x[3, :] = -1.0
    x[3, [5, 9, 2, 17]] = 3.0  # a tie in the top of the last row
    moe, greedy = rt.op("moe_routing", tune=False), rt.op("greedy_token", tune=False)
    for op, out, k in ((moe, "p", 8), (greedy, "p", 1)):
        index = op.outputs.index(out)
        run = (torch.compile(lambda t, op=op, i=index: op(t)[i], fullgraph=True) if compiled
               else (lambda t, op=op, i=index: op(t)[i]))
        leaf = x.clone().requires_grad_()
        values = run(leaf)
        upstream = torch.randn(values.shape, generator=g)
        values.backward(upstream)
        picked = op(x)[-1].long()  # e (argtopk) and token (argmax), both saved by the op
        ref = x.double().requires_grad_()
        prob = torch.softmax(ref, -1)
        if k == 1:
            want_index = prob.max(-1).indices
            torch.testing.assert_close(picked, want_index)  # torch's first maximum
            prob.gather(-1, want_index[:, None])[:, 0].backward(upstream.double())
        else:
            torch.testing.assert_close(picked[:3], prob[:3].topk(k).indices)
            assert picked[3, :4].tolist() == [2, 5, 9, 17]  # ties: the lowest index first
            (prob.gather(-1, picked) * upstream.double()).sum().backward()
        torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=TOL, atol=TOL)


def _float64(g: torch.Generator, *shape, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)


# op (registered under its own name, scalars as tensors so that they get gradients too) ->
# its inputs in float64: float64 kernels
GRADCHECK = {
    "softmax": lambda g: {"x": _float64(g, 2, 5)},
    "log_softmax": lambda g: {"x": _float64(g, 2, 5)},
    "cross_entropy": lambda g: {"x": _float64(g, 2, 5),
                                "t": torch.softmax(_float64(g, 2, 5, grad=False), -1)},
    "layernorm": lambda g: {"x": _float64(g, 2, 5), "eps": torch.tensor(0.1, dtype=torch.float64,
                                                                         requires_grad=True),
                            "g": _float64(g, 5), "b": _float64(g, 5)},
    "rmsnorm": lambda g: {"x": _float64(g, 2, 5), "eps": torch.tensor(
        0.1, dtype=torch.float64, requires_grad=True), "g": _float64(g, 5)},
    "moe_routing": lambda g: {"x": _float64(g, 2, 9)},
    "rmsnorm_gemm": lambda g: {"x": _float64(g, 2, 5), "eps": torch.tensor(
        0.1, dtype=torch.float64, requires_grad=True), "w": _float64(g, 5, 3)},
    "softmax_entropy": lambda g: {"x": _float64(g, 2, 5), "T": torch.tensor(
        0.7, dtype=torch.float64, requires_grad=True)},
    "geometric_mean": lambda g: {"x": _float64(g, 2, 5)},
    "attention": lambda g: {"q": _float64(g, 2, 3, 2), "k": _float64(g, 2, 1, 3, 2),
                            "scale": torch.tensor(0.5, dtype=torch.float64,
                                                  requires_grad=True),
                            "v": _float64(g, 2, 1, 3, 2)},
    "linear_cross_entropy": lambda g: {
        "h": _float64(g, 3, 2), "w": _float64(g, 7, 2),
        "label": torch.tensor([0.0, 6.0, 3.0], dtype=torch.float64)},
}


@pytest.mark.parametrize("name", sorted(GRADCHECK))
def test_gradcheck_on_float64_kernels(name):
    """float64 tensors run float64 kernels, forward and the derived backward cascades
    alike: the forward equals the float64 oracle (``redfuser.reference``, the multi-pass
    definition, code the derivation never sees) to 1e-12, and torch.autograd.gradcheck
    checks each derived gradient (learned scalars included: eps, T, scale) against finite
    differences of it."""
    inputs = GRADCHECK[name](torch.Generator().manual_seed(5))
    op = rt.op(name, name=f"{name}_gradcheck", tune=False)
    differentiated = {"softmax": "y", "log_softmax": "y", "layernorm": "y", "rmsnorm": "y",
                      "rmsnorm_gemm": "y",
                      "moe_routing": "p", "softmax_entropy": "h", "attention": "o",
                      "geometric_mean": "g"}.get(
        name, "loss")
    index = op.outputs.index(differentiated)
    args = tuple(inputs[n] for n in op.inputs)
    got = op(*args)[index]
    want = reference(derive(name).cascade, {n: v.detach().numpy() if isinstance(
        v, torch.Tensor) else v for n, v in inputs.items()})[differentiated]
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.detach().numpy().reshape(np.shape(want)), want,
                               rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *a: op(*a)[index], args)


@pytest.mark.parametrize("g_shape", [(24,), (1, 1, 24), (2, 3, 24)])
def test_gradients_of_inputs_the_rows_share_are_summed_over_them_deterministically(g_shape):
    """g of shape (N,) (or (1, 1, N)): dg and db come from one column cascade over the rows
    (``algebra.backward_shared``), twice the same bits; g each row's own: per element."""
    gen = torch.Generator().manual_seed(3)
    inputs = {"x": torch.randn(2, 3, 24, generator=gen),
              "g": torch.rand(g_shape, generator=gen) + 0.5,
              "b": torch.rand(24, generator=gen) + 0.5, "eps": EPS}
    upstream = torch.randn(2, 3, 24, generator=gen)
    runs = [_op_gradients("layernorm", inputs, upstream, compiled=False) for _ in range(2)]
    assert_gradients_match(runs[0], _torch_gradients("layernorm", inputs, upstream),
                            "layernorm")
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert runs[0]["g"].shape == g_shape


# a user's product of positive factors (its log-derivative): op name -> (its spec, the
# float64 torch reference); inputs: a stream x of 3 x 9, t a learned scalar where read
PRODUCTS = {
    "softplus_product": ("p = prod(1 + exp(x[i]))", lambda x: (1 + torch.exp(x)).prod(-1)),
    "scaled_product": ("p = prod(exp(x[i] * t))", lambda x, t: torch.exp(x * t).prod(-1)),
}


@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_products_of_positive_factors_match_torch_autograd(name):
    """dx (and dt, summed over the rows for a scalar t) of a product against torch's
    autograd of the float64 reference; float64 kernels through gradcheck."""
    spec, reference = PRODUCTS[name]
    g = torch.Generator().manual_seed(4)
    inputs = {"x": torch.randn(3, 9, generator=g) / 2, "t": torch.tensor(0.7)}
    op = rt.op(spec, name=name, tune=False)
    leaves = {n: inputs[n].clone().requires_grad_() for n in op.inputs}
    upstream = torch.randn(3, generator=g)
    op(*leaves.values())[0].backward(upstream)
    ref = {n: inputs[n].double().requires_grad_() for n in op.inputs}
    reference(*ref.values()).backward(upstream.double())
    assert_gradients_match({n: v.grad for n, v in leaves.items()},
                            {n: v.grad for n, v in ref.items()}, name)
    args = tuple(v.detach().double().requires_grad_() for v in ref.values())
    assert torch.autograd.gradcheck(lambda *a: op(*a)[0], args)


def test_a_product_whose_factor_can_be_zero_refuses_its_backward_by_name():
    """prod(x): x / factor is not the derivative at a zero factor; the op's backward raises
    with the reason instead of returning a NaN there."""
    op = rt.op("p = prod(x[i])", name="plain_product", tune=False)
    x = torch.tensor([[2.0, 0.0, 3.0]], requires_grad=True)
    (p,) = op(x)
    torch.testing.assert_close(p.detach(), torch.tensor([0.0]))
    with pytest.raises(NotImplementedError, match=r"redfuser\.plain_product: p = prod\(x\[i\]\): "
                                                  "a factor can be 0"):
        p.sum().backward()


@pytest.mark.parametrize("spec, reference", [
    ("r = sum(x[i]) / N", lambda x: x.mean(-1)),  # dx = dr / N: a value per row
    ("m = sum(x[i]) / N\nr = sum(x[i] - m)", lambda x: (x - x.mean(-1, keepdim=True)).sum(-1)),
])
def test_a_stream_gradient_that_reads_no_stream_is_broadcast_along_the_row(spec, reference):
    """A map with no stream argument (a mean's dr / N; the constant 0) gives one value per
    row: the op broadcasts it to the stream's shape (it failed in sum_to_size)."""
    op = rt.op(spec, name=f"row_constant_{spec.count(chr(10))}", tune=False)
    x = torch.randn(4, 2, 7, generator=torch.Generator().manual_seed(6))
    leaf, ref = x.clone().requires_grad_(), x.double().requires_grad_()
    upstream = torch.randn(4, 2, generator=torch.Generator().manual_seed(7))
    op(leaf)[op.outputs.index("r")].backward(upstream)
    reference(ref).backward(upstream.double())
    assert_gradients_match({"x": leaf.grad}, {"x": ref.grad}, spec)
