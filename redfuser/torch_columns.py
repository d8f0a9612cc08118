"""Laying a backward's values out for its other orientation (``Backward.columns``).

A gradient summed over the rows (attention's dk and dv, rmsnorm_gemm's dw) runs as a
cascade whose stream is the forward's rows.  The forward's rows have a shape ``R``
(attention: heads x queries); a shared stream (k: heads x 1 x keys x D) keeps some row axes
(heads) and is shared along the others (queries).  The other orientation's rows are the
kept axes and the shared stream's positions (heads x keys); its stream is the shared row
axes, flattened (queries).  So:

- a shared stream is a per-row parameter as it is (its size-1 axes dropped);
- a per-row value (q, do, m, d, delta, scale, pos) is broadcast to ``R``, its kept axes
  moved first, then an axis of 1 (the keys'), then the shared axes flattened;
- a stream each row holds its own of (rmsnorm_gemm's x) is transposed the same way, its
  positions in place of the axis of 1;
- ``at`` is the position of each shared-stream row, ``n_stream`` the forward's N.

Where the column cascade's mask compares a sorted stream with a per-row value (causal
attention's ``at <= pos[i]``), ``Ranged`` runs it as a range of the stream
(``algebra.backward_sorted``), so the kernel skips the blocks of queries a key never sees.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import sympy as sp
import torch

from algebra import Backward
from algebra.backward_sorted import SortedColumns
from algebra.backward_vectors import vector_results


def column_values(derived: Backward, values: dict, names: tuple[str, ...],
                  rows: tuple[int, ...]) -> dict:
    """The column cascade's inputs ``names``, from the backward's ``values`` and the
    forward's row shape ``rows``."""
    c = derived.forward
    shared = [s.name for s in c.streams if s.name in c.vector_inputs]
    lead = _lead(values[shared[0]], rows)
    for s in shared[1:]:
        if _lead(values[s], rows) != lead:
            raise NotImplementedError(f"{shared[0]} and {s} are shared by different rows")
    kept, along = kept_axes(values[shared[0]], rows)
    sizes, width = tuple(rows[a] for a in kept), math.prod(rows[a] for a in along)
    n, last = values[shared[0]].shape[-2], len(rows)
    vectors = set(c.vector_inputs) | {u for o, u in derived.upstream.items()
                                      if o in vector_results(c)}
    # per-element values each row holds its own of: streams, and a selection's selector
    # (a max's subgradient that is not only a stabiliser: an attention sink's m)
    own = ({s.name for s in c.streams} - set(shared)) | {s.selector for s in
                                                          derived.selections}
    role = {r: p for p, r in derived.column_params.items()}
    out = {}
    for name in names:
        if name in shared:
            out[name] = values[name].reshape(*sizes, n, values[name].shape[-1])
        elif name == role.get("position"):
            out[name] = torch.arange(n, dtype=torch.float32)
        elif name == role.get("length"):
            out[name] = torch.tensor(float(n))
        else:
            v = torch.as_tensor(values[name], dtype=torch.float32)
            if name in vectors:  # rows x D -> kept x 1 x shared rows x D
                v = v.expand(*rows, v.shape[-1]).permute(*kept, *along, last)
                out[name] = v.reshape(*sizes, 1, width, v.shape[-1])
            elif name in own:  # rows x N -> kept x N x shared rows
                v = v.expand(*rows, n).permute(*kept, last, *along)
                out[name] = v.reshape(*sizes, n, width)
            else:  # rows -> kept x 1 x shared rows
                out[name] = v.expand(*rows).permute(*kept, *along).reshape(*sizes, 1, width)
    return out


def column_gradient(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The other orientation's gradient ``t`` in the shape of its shared stream (..., N, D).
    Where the column cascade reads nothing per position (``dv = sum(do[i, :] * r[i])``: no
    value of the forward's stream), ``t`` has one position for all N, and each gets it."""
    if math.prod(shape) == 0:
        return t.new_zeros(shape)
    lead, n, d = math.prod(shape[:-2]), shape[-2], shape[-1]
    return t.reshape(lead, -1, d).expand(lead, n, d).reshape(shape)


def kept_axes(stream: torch.Tensor, rows: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """(the forward's row axes a shared stream keeps, those it is shared along)."""
    lead = _lead(stream, rows)
    return (tuple(a for a in range(len(rows)) if lead[a] != 1),
            tuple(a for a in range(len(rows)) if lead[a] == 1))


def _lead(stream: torch.Tensor, rows: tuple[int, ...]) -> tuple[int, ...]:
    """A shared stream's row axes, aligned to the forward's rows (missing ones are 1)."""
    lead = tuple(stream.shape[:-2])
    return (1,) * (len(rows) - len(lead)) + lead


@dataclass(frozen=True)
class Ranged:
    """The column cascade ``general`` run as ``of.spec`` (``ranged``) where ``of.stream``
    does not decrease along any row, chosen at run time: the body of a custom op with
    ``general``'s schema (``redfuser.torch``), so a compiled backward makes the choice
    on the data too."""

    of: SortedColumns
    ranged: object  # redfuser.torch.CascadeOp of ``of.spec``
    general: object  # redfuser.torch.CascadeOp of the column cascade

    def __call__(self, *args):
        laid = dict(zip(self.general.inputs, args, strict=True))
        picked = self.arguments(laid)
        if picked is None:
            return self.general.torch_op(*args)
        return self.ranged.torch_op(*picked.values())

    def arguments(self, laid: dict) -> dict | None:
        """``ranged``'s arguments from the general cascade's: each bound a ``searchsorted``
        of the stream per row; None where the stream decreases somewhere (or holds a NaN),
        where only the general cascade is right."""
        stream = laid[self.of.stream]  # kept x 1 x (the forward's rows)
        if not non_decreasing(stream):
            return None
        bounds = {b.name: _bound(b, stream[..., 0, :], laid) for b in self.of.bounds}
        return {n: bounds[n] if n in bounds else laid[n] for n in self.ranged.inputs}


def non_decreasing(t: torch.Tensor) -> bool:
    """Does ``t`` not decrease along its last axis anywhere (False with a NaN: a
    comparison with NaN is false)?"""
    return bool((t[..., 1:] >= t[..., :-1]).all())


def per_row_value(e: sp.Expr, values: dict) -> torch.Tensor:
    """``e``, an arithmetic expression of per-row values, on the tensors ``values``."""
    args, f = _lambdified(e)
    return torch.as_tensor(f(*(values[a] for a in args)))


@functools.cache
def _lambdified(e: sp.Expr) -> tuple[tuple[str, ...], object]:
    """``e``'s arguments and its Python function, made once per expression (lambdify
    writes and compiles source: not once per backward call)."""
    args = sorted(e.free_symbols, key=lambda s: s.name)
    return tuple(a.name for a in args), sp.lambdify(args, e)


def _bound(b, stream: torch.Tensor, laid: dict) -> torch.Tensor:
    """``b``'s parameter for each row: where the index starts (``>=``) or stops (``<``)
    meeting its condition.  A NaN value meets no condition: an empty range."""
    value = per_row_value(b.value, laid).to(stream.dtype)
    value = torch.broadcast_to(value, torch.broadcast_shapes(value.shape,
                                                             (*stream.shape[:-1], 1)))
    seq = stream.expand(*value.shape[:-1], stream.shape[-1]).contiguous()
    at = torch.searchsorted(seq, value.contiguous(), side=b.side).to(stream.dtype)
    empty = stream.shape[-1] if b.op == ">=" else 0
    return torch.where(value.isnan(), torch.full_like(at, empty), at)
