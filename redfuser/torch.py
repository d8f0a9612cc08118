"""redfuser kernels as PyTorch custom operators (``torch.library.custom_op``).

``op(spec_or_rule)`` compiles a cascade (``redfuser.compile``) and registers it as the
operator ``torch.ops.redfuser.<name>``: tensors in, a tuple of tensors out (the rule's
outputs in spec order), so it can sit in any model.  The real implementation is the
Kernel's call path, which hands contiguous float32 tensors to TVM through DLPack without a
copy and writes the outputs straight into tensors torch allocated.  The fake
implementation (``register_fake``) computes every output's shape and dtype from the rule's
layout, the same rule the call path uses, without running anything, so the operator traces
under ``torch.compile(fullgraph=True)`` and ``torch.export``, with static or symbolic sizes.

Import this module explicitly (``import redfuser.torch``): it loads torch, which
``import redfuser`` does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from algebra import FusionRule, derive
from algebra.layout import resolve, vector_results

from .call import _user_shape
from .kernel import Kernel
from .lowering import geometry, signature

NAMESPACE = "redfuser"
# Stand-in sizes for symbolic dimensions while the fake implementation resolves the layout
# (zero-strided numpy views: no memory).  Far above any static size a model uses, so an
# output size equal to a marker can only have come from that symbolic dimension.
MARKER_BASE = 1 << 20
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
        values = dict(zip(inputs, args, strict=True))
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
    return torch_op


def output_specs(rule: FusionRule, inputs: dict) -> dict[str, tuple[tuple, torch.dtype]]:
    """Every output's (shape, dtype) for tensors (real, fake or symbolic-sized) and numbers.

    Symbolic sizes are replaced by distinct marker sizes, the layout is resolved on
    zero-strided stand-ins exactly as a call resolves it, and output sizes equal to a
    marker are mapped back to their symbol.

    Examples
    --------
    >>> import redfuser
    >>> specs = output_specs(redfuser.derive("moe_routing"), {"x": torch.zeros(3, 16)})
    >>> [(n, shape, str(dtype)) for n, (shape, dtype) in specs.items()][2:]
    [('p', (3, 8), 'torch.float32'), ('e', (3, 8), 'torch.int64')]
    """
    markers: dict[object, int] = {}
    symbols: dict[int, object] = {}

    def size(s):
        if isinstance(s, torch.SymInt):
            key = s.node.expr
            if key not in markers:
                markers[key] = MARKER_BASE + len(markers)
                symbols[markers[key]] = s
            return markers[key]
        return int(s)

    stand_ins = {k: np.broadcast_to(np.float32(0), tuple(size(s) for s in v.shape))
                 if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    layout = resolve(rule.cascade, stand_ins, dtype=np.float32)
    sig = signature(rule, geometry(rule, layout))
    vector = vector_results(rule.cascade, layout.vector)  # as call.call_plan reads it
    return {a.name: (tuple(symbols.get(s, s) for s in _user_shape(rule, layout, a, vector)),
                     TORCH_DTYPES[a.dtype]) for a in sig.outputs}

