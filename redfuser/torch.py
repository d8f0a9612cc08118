"""redfuser kernels as PyTorch custom operators (``torch.library.custom_op``).

``op(spec_or_rule)`` compiles a cascade (``redfuser.compile``) and registers it as the
operator ``torch.ops.redfuser.<name>``: tensors in, a tuple of tensors out (the rule's
outputs in spec order), so it can sit in any model.  The real implementation is the
Kernel's call path, which hands contiguous float32 tensors to TVM through DLPack without a
copy and writes the outputs straight into tensors torch allocated.  The fake
implementation (``register_fake``) computes every output's shape and dtype from the rule's
layout, the same rule the call path uses, without running anything, so the operator traces
under ``torch.compile(fullgraph=True)`` and ``torch.export``, with static or symbolic sizes:
an output's sizes are the inputs' own, and sizes the layout needs equal (q's, k's and v's
D) become torch guards or export constraints.

Tensors that require grad are read as they are (detached, no copy).  No op has a backward
yet (``backward_rule``): its outputs carry a graph whose backward raises
``NotImplementedError`` naming the op, so a training step fails clearly instead of
silently leaving the op's inputs without gradients.

Import this module explicitly (``import redfuser.torch``): it loads torch, which
``import redfuser`` does not.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw, has_guarding_hint

from algebra import FusionRule, derive
from algebra.layout import Layout, resolve, vector_results

from .call import user_shape
from .kernel import Kernel
from .lowering import geometry, signature

NAMESPACE = "redfuser"
TORCH_DTYPES = {"float32": torch.float32, "int32": torch.int32, "int64": torch.int64}
_REGISTERED: dict[str, CascadeOp] = {}


@dataclass(frozen=True)
class CascadeOp:
    """A registered operator: ``op(*tensors)`` returns the rule's outputs as a tuple.

    ``inputs``: the argument names in order (as they first appear in the spec);
    ``outputs``: the result names; ``torch_op``: the ``torch.ops.redfuser.<name>`` overload.
    """

    name: str
    kernel: Kernel
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    torch_op: object

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, ...]:
        return self.torch_op(*args, **kwargs)


def op(spec_or_rule: FusionRule | str, name: str | None = None,
       scalars: tuple[str, ...] = (), **options) -> CascadeOp:
    """Register the compiled cascade as the torch custom op ``torch.ops.redfuser.<name>``.

    ``name`` defaults to the library rule's name (required for an inline spec); parameters
    listed in ``scalars`` are Python floats in the schema, every other input a tensor (a
    0-d tensor for a scalar is fine).  ``options`` go to ``redfuser.compile``.  Registering
    the same name again returns the existing op when the spec is the same, else raises.

    Examples
    --------
    >>> import torch, redfuser.torch
    >>> softmax = redfuser.torch.op("softmax")
    >>> softmax.inputs, softmax.outputs
    (('x',), ('m', 'd', 'y'))
    >>> m, d, y = torch.ops.redfuser.softmax(torch.zeros(2, 4))
    >>> y.tolist()
    [[0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]]
    """
    rule = spec_or_rule if isinstance(spec_or_rule, FusionRule) else derive(spec_or_rule)
    name = _op_name(rule, name)
    if name in _REGISTERED:
        return _existing(_REGISTERED[name], rule)
    kernel = Kernel(rule, **options)
    inputs = _input_order(rule)
    unknown = sorted(set(scalars) - {p.name for p in rule.cascade.params})
    if unknown:
        raise ValueError(f"scalars {unknown} are not parameters of the spec; its parameters "
                         f"are {[p.name for p in rule.cascade.params]}")
    schema = _schema(rule, inputs, set(scalars))
    torch_op = _register(name, kernel, inputs, schema)
    _REGISTERED[name] = CascadeOp(name, kernel, inputs, tuple(rule.outputs), torch_op)
    return _REGISTERED[name]


def _op_name(rule: FusionRule, name: str | None) -> str:
    name = name or rule.name
    if not name:
        raise ValueError("an inline spec needs a name: redfuser.torch.op(spec, name='...')")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"op name {name!r} must be a Python identifier")
    return name


def _existing(registered: CascadeOp, rule: FusionRule) -> CascadeOp:
    if registered.kernel.rule.cascade.text != rule.cascade.text:
        raise ValueError(f"torch.ops.{NAMESPACE}.{registered.name} is already registered "
                         "for another spec; pass another name")
    return registered


def _input_order(rule: FusionRule) -> tuple[str, ...]:
    """Streams and parameters in the order the spec first spells them (attention: q, k,
    scale, v), which is the order a reader of the spec expects the arguments in."""
    names = {s.name for s in rule.cascade.streams} | {p.name for p in rule.cascade.params}
    tokens = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", rule.cascade.text)
    return tuple(dict.fromkeys(t for t in tokens if t in names))


def _schema(rule: FusionRule, inputs: tuple[str, ...], scalars: set[str]) -> str:
    args = ", ".join(f"{'float' if n in scalars else 'Tensor'} {n}" for n in inputs)
    outs = ", ".join("Tensor" for _ in rule.outputs)
    return f"({args}) -> ({outs})"


def _register(name: str, kernel: Kernel, inputs: tuple[str, ...], schema: str):
    outputs = kernel.rule.outputs

    def real(*args):
        # Detached views, no copy: DLPack refuses to export a tensor that requires grad,
        # and the kernel only reads it; the autograd layer (``_register_autograd``), not
        # this function, links the outputs to the inputs.
        values = {n: v.detach() if isinstance(v, torch.Tensor) else v
                  for n, v in zip(inputs, args, strict=True)}
        out = {n: torch.empty(shape, dtype=dtype)
               for n, (shape, dtype) in output_specs(kernel.rule, values).items()}
        kernel(**values, out=out)  # TVM writes these tensors in place
        return tuple(out[n] for n in outputs)

    def fake(*args):
        values = dict(zip(inputs, args, strict=True))
        device = next(v.device for v in values.values() if isinstance(v, torch.Tensor))
        return tuple(torch.empty(shape, dtype=dtype, device=device)
                     for shape, dtype in output_specs(kernel.rule, values).values())

    torch_op = torch.library.custom_op(f"{NAMESPACE}::{name}", real, mutates_args=(),
                                       schema=schema)
    torch_op.register_fake(fake)
    _register_autograd(torch_op, name, kernel.rule)
    return torch_op


# Autograd ---------------------------------------------------------------------------------
def backward_rule(rule: FusionRule) -> Callable | None:
    """The backward of the op computing ``rule``, or None where it has none.

    A backward is ``backward(ctx, *grads)`` (one gradient per output) returning one
    gradient per op input (None for a float), reading ``ctx.saved_tensors``: the tensor
    inputs in argument order, then the outputs (``_save_for_backward``).  No rule has one
    yet: this is the one place where derived backward rules plug in; an op without one
    gets a backward that raises (``_no_backward``).
    """
    return None


def _register_autograd(torch_op, name: str, rule: FusionRule) -> None:
    backward = backward_rule(rule) or partial(_no_backward, name)
    torch_op.register_autograd(backward, setup_context=_save_for_backward)


def _save_for_backward(ctx, inputs: tuple, output: tuple) -> None:
    ctx.tensor_inputs = tuple(isinstance(v, torch.Tensor) for v in inputs)
    ctx.save_for_backward(*(v for v in inputs if isinstance(v, torch.Tensor)), *output)


def _no_backward(name: str, ctx, *grads) -> tuple:
    """The backward of an op without a backward rule: gradients that raise when computed.

    Raising here directly would fail ``torch.compile`` on any input that requires grad
    (AOTAutograd traces the backward with the forward, before anything runs); the error
    is instead the real implementation of ``torch.ops.redfuser._no_backward``, which runs
    only when ``backward()`` does.  Outputs without a graph would let a training step
    silently skip this op's inputs, hence a graph at all.
    """
    saved = ctx.saved_tensors[:sum(ctx.tensor_inputs)]
    grads_in = iter(_refuse_backward(name, list(saved)))
    return tuple(next(grads_in) if tensor else None for tensor in ctx.tensor_inputs)


@torch.library.custom_op(f"{NAMESPACE}::_no_backward", mutates_args=())
def _refuse_backward(op: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Raise that ``torch.ops.redfuser.<op>`` has no backward (its fake gives the shapes)."""
    raise NotImplementedError(
        f"redfuser.{op}: torch.ops.{NAMESPACE}.{op} has no backward yet (redfuser ops are "
        "not differentiable): no gradient can flow through it to its inputs; pass it "
        "detached inputs (x.detach()) or call it under torch.no_grad() where none has to")


@_refuse_backward.register_fake
def _(op: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in inputs]


# Output shapes ----------------------------------------------------------------------------
def output_specs(rule: FusionRule, inputs: dict) -> dict[str, tuple[tuple, torch.dtype]]:
    """Every output's (shape, dtype) for tensors (real, fake or symbolic-sized) and numbers.

    The layout is resolved and checked as a call resolves it, on zero-strided stand-ins
    (no memory) of the inputs' sizes, a symbolic size at its value in the example torch
    traces; with symbolic sizes, the outputs' sizes are then taken from the inputs' own
    (``_symbolic``), so that they follow the inputs to other sizes.

    Examples
    --------
    >>> import redfuser
    >>> specs = output_specs(redfuser.derive("moe_routing"), {"x": torch.zeros(3, 16)})
    >>> [(n, shape, str(dtype)) for n, (shape, dtype) in specs.items()][2:]
    [('p', (3, 8), 'torch.float32'), ('e', (3, 8), 'torch.int64')]
    """
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else () for k, v in inputs.items()}
    stand_ins = {k: np.broadcast_to(np.float32(0), tuple(_hint(rule, k, s) for s in shapes[k]))
                 if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    layout = resolve(rule.cascade, stand_ins, dtype=np.float32)
    sig = signature(rule, geometry(rule, layout))
    if any(isinstance(s, torch.SymInt) for shape in shapes.values() for s in shape):
        layout = _symbolic(rule.cascade, layout, shapes)
    vector = vector_results(rule.cascade, layout.vector)  # as call.call_plan reads it
    return {a.name: (user_shape(rule, layout, a, vector), TORCH_DTYPES[a.dtype])
            for a in sig.outputs}


def _hint(rule: FusionRule, name: str, size) -> int:
    """A size's value in the example being traced (a static size is its own)."""
    if not has_guarding_hint(size):
        raise NotImplementedError(
            f"redfuser.{rule.name}: input '{name}' has a data-dependent size ({size}); the "
            "op's output shapes need the sizes torch knows when it traces")
    return guarding_hint_or_throw(size)


def _symbolic(cascade, layout: Layout, shapes: dict[str, tuple]) -> Layout:
    """``layout`` with its rows, N and D the inputs' own sizes (SymInts where symbolic).

    The sizes the layout needs equal (every stream's N, every vector input's D) are
    declared equal to torch with ``torch._check``, which makes each a guard (or, under
    ``torch.export``, a constraint on the declared dims) rather than a check of values;
    rows broadcast as torch broadcasts them.
    """
    streams = [s.name for s in cascade.streams]
    tails = {k: _tail(k, layout.vector, streams) for k in shapes}
    rows = torch.broadcast_shapes(*(s[:len(s) - tails[k]] for k, s in shapes.items()))
    n = _same("N", {s: shapes[s][len(shapes[s]) - tails[s]] for s in streams}, layout.n)
    d = _same("D", {k: shapes[k][-1] for k in sorted(layout.vector)}, layout.d)
    _keep_readings(cascade, layout, shapes, n)
    return dataclasses.replace(layout, rows=tuple(rows), n=n, d=d)


def _tail(name: str, vector, streams: list[str]) -> int:
    """How many trailing axes of an input are not row axes (as ``algebra.layout.resolve``
    counts them): N[, D] of a stream, D of a vector parameter, none of a scalar one."""
    if name in streams:
        return 2 if name in vector else 1
    return 1 if name in vector else 0


def _same(axis: str, sizes: dict[str, object], default):
    """The one size ``sizes`` (input -> its size of ``axis``) all have, declared to torch."""
    if not sizes:
        return default
    (first, size), *rest = sizes.items()
    for name, other in rest:
        torch._check(other == size, lambda name=name, other=other: (
            f"input '{name}' has {axis} = {other}, input '{first}' {axis} = {size}: "
            "they must be equal"))
    return size


def _keep_readings(cascade, layout: Layout, shapes: dict[str, tuple], n) -> None:
    """Guard the reading of every stream spelled ``x[i]`` where sizes could change it.

    ``algebra.layout`` reads such a stream as (*rows, N, D) or (*rows, N) by comparing its
    trailing sizes with N and D (``_reads_as_vector``); where both readings fit, the ranks
    decide.  The reading at the example's sizes (``layout.vector``) must hold at every size
    the traced graph is reused for, so the comparison that made it becomes a guard; where
    the ranks decide, none does (an export with N and D both dynamic must not be told that
    they differ).
    """
    streams = [s.name for s in cascade.streams]
    declared, params = cascade.vector_inputs, {p.name for p in cascade.params}
    other_rank = max((len(shapes[k]) - _tail(k, declared, streams) for k in shapes
                      if k in declared or k in params), default=0)
    d = next((shapes[k][-1] for k in sorted(declared)), None)  # D before the x[i] are read
    for s in streams:
        shape = shapes[s]
        if s in declared or len(shape) < 2:
            continue
        ranks_decide = other_rank > 0 and len(shape) - 1 > other_rank >= len(shape) - 2
        if s in layout.vector:
            if not ranks_decide:  # (*rows, N, D) because (*rows, N) does not fit
                torch._check(shape[-1] != n)
            d = shape[-1]
        elif ranks_decide:  # (*rows, N) because (*rows, N, D) does not fit
            torch._check(shape[-2] != n if d is None else (shape[-2] != n) | (shape[-1] != d))
