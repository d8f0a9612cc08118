"""Output shapes of a redfuser torch op for real, fake and symbolic-sized tensors: what the
fake implementation (``register_fake``) returns, so that the op traces under
``torch.compile(fullgraph=True)`` and ``torch.export`` (``redfuser.torch``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw, has_guarding_hint

from algebra import FusionRule
from algebra.dtypes import ARRAYS, array_dtype, compute_of
from algebra.layout import Layout, resolve, vector_results

from .call import user_shape
from .lowering import geometry, signature

# every array dtype is torch's of the same name; indices are int64, int8 GEMMs' int32
TORCH_DTYPES = {name: getattr(torch, name) for name in (*ARRAYS, "int32", "int64")}


def output_specs(rule: FusionRule, inputs: dict) -> dict[str, tuple[tuple, torch.dtype]]:
    """Every output's (shape, dtype) for tensors (real, fake or symbolic-sized) and numbers,
    as the kernel's signature has them (float64 inputs: a float64 kernel's).

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
    stand_ins = {k: np.broadcast_to(np.zeros((), _numpy(v.dtype)),
                                    tuple(_hint(rule, k, s) for s in shapes[k]))
                 if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    kinds = [array_dtype(v.dtype) for v in stand_ins.values() if isinstance(v, np.ndarray)]
    wide = compute_of(kinds).numpy  # a number is a value in it, as ``Kernel._layout`` has it
    stand_ins = {k: np.asarray(v, wide) if isinstance(v, float) else v
                 for k, v in stand_ins.items()}
    layout = resolve(rule.cascade, stand_ins, dtype=wide, keep=frozenset(ARRAYS))
    sig = signature(rule, geometry(rule, layout))
    if any(isinstance(s, torch.SymInt) for shape in shapes.values() for s in shape):
        layout = _symbolic(rule.cascade, layout, shapes)
    vector = vector_results(rule.cascade, layout.vector)  # as call.call_plan reads it
    return {a.name: (user_shape(rule, layout, a, vector), TORCH_DTYPES[a.dtype])
            for a in sig.outputs}


def _numpy(dtype: torch.dtype) -> np.dtype:
    """The numpy stand-in of a tensor's dtype: its own where a kernel reads it, else
    float32 (the call then refuses it by name)."""
    kind = array_dtype(dtype)
    return kind.numpy if kind is not None else np.dtype(np.float32)


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
