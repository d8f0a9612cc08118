"""The derived backward of a redfuser torch op, run with torch (``redfuser.torch``): the
backward cascade's kernel, the maps no kernel computes, the other orientation's kernel, and
what the backward reads that the forward does not return (FlashAttention's delta, a
selection's scattered upstream)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

import sympy as sp
import torch

from algebra import Backward
from algebra.backward_selections import Selection
from algebra.backward_shared import SharedSums
from algebra.backward_vectors import vector_results
from algebra.cascade import N

from .torch_columns import column_gradient, column_values


class CascadeOp(Protocol):
    """What a backward runs of ``redfuser.torch.CascadeOp`` (which imports this module)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __call__(self, *args) -> tuple: ...


class ScoresRun(Protocol):
    """What a backward runs of ``redfuser.torch_scores.ScoresBackward``."""

    inputs: tuple[str, ...]
    gradients: tuple[str, ...]

    def applies(self, values: dict, needed: set[str]) -> bool: ...

    def run(self, values: dict, needed: set[str]) -> dict: ...


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """dot over the feature axis; a per-row vector (stream axis 1) against a stream is a
    matrix product (rmsnorm_gemm's dot(dy, w[i, :]) = dy @ w.T), never a rows x N x D
    temporary."""
    if a.shape[-2] == 1 and b.shape[-2] != 1:
        return (a @ b.mT)[..., 0, :]
    if b.shape[-2] == 1 and a.shape[-2] != 1:
        return (b @ a.mT)[..., 0, :]
    return (a * b).sum(-1)


# torch's spelling of the functions a backward map may hold (``Backward.maps``)
TORCH_FUNCS = {"exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "Abs": torch.abs,
               "tanh": torch.tanh, "sign": torch.sign, "Where": torch.where, "Dot": _dot}


@dataclass(frozen=True)
class Shared:
    """The ops of ``algebra.backward_shared``: ``sums`` the gradients of inputs every row
    shares (one pass over the rows), ``rows`` the row-parallel backward without them (None
    where nothing is left)."""

    of: SharedSums
    sums: CascadeOp
    rows: CascadeOp | None

    def summed(self, derived: Backward, values: dict, needed: set[str]) -> set[str]:
        """The needed gradients to sum over the rows: all of ``of.gradients`` that are
        needed when each one's input is a single row every row shares (a LayerNorm weight
        of shape (N,)), else none (their per-element values come from the full backward)."""
        wanted = needed & set(self.of.gradients)
        inputs = {g: n for n, (g, _) in derived.gradients.items()}
        length = _length(derived, values)
        if math.prod(_rows(derived, values)) > 1 and all(
                values[inputs[g]].numel() == length for g in wanted):
            return wanted
        return set()

    def run(self, derived: Backward, values: dict) -> dict:
        """The summed gradients, each of shape (N,), from the backward's inputs: the
        forward's rows flattened into the column cascade's stream."""
        n, rows, streams = _length(derived, values), _rows(derived, values), derived.per_element
        args = []
        for name in self.sums.inputs:
            v = values[name]
            if name == self.of.length:
                v = torch.tensor(float(n))
            elif isinstance(v, torch.Tensor) and name in streams:
                v = v.expand(*rows, n).reshape(-1, n)
            elif isinstance(v, torch.Tensor):
                v = v.expand(rows).reshape(-1)
            args.append(v)
        return dict(zip(self.sums.outputs, self.sums(*args), strict=True))


@dataclass(frozen=True)
class Gradient:
    """An op's derived backward: the algebra's ``Backward`` and how it runs: the backward
    cascade's own op (``<name>_backward``; None where it has no sum, ``Backward.is_map``),
    torch's elementwise ops for the maps (``maps``: gradient name -> (function, its
    arguments as (name, the axis a per-row value gains in a per-element map: -1, -2 for a
    feature vector, None as it is)), made once at registration), and the other
    orientation's op (``<name>_backward_columns``)."""

    derived: Backward
    op: CascadeOp | None
    maps: dict = dataclasses.field(default_factory=dict)
    columns: CascadeOp | None = None  # gradients summed over the rows (``torch_columns``)
    shared: Shared | None = None  # gradients of inputs every row shares, summed over them
    scores: ScoresRun | None = None  # dq, dk, dv (dh, dw) through the scores (torch_scores)

    @staticmethod
    def maps_of(derived: Backward, maps: dict) -> dict:
        """Each of ``maps`` (the ones no kernel computes) as a torch function of its
        arguments, per element or per row."""
        streams = derived.per_element | {s.selector for s in derived.selections}
        vectors = set(derived.forward.vector_inputs) | {
            g for o, g in derived.upstream.items() if o in vector_results(derived.forward)}
        out = {}
        for name, expr in maps.items():
            args = sorted(expr.free_symbols, key=lambda s: s.name)
            per_row = not any(a.name in streams for a in args)  # no stream axis to add
            out[name] = (sp.lambdify(args, expr, modules=[TORCH_FUNCS]), tuple(
                (a.name, None if per_row or a.name in streams else
                 -2 if a.name in vectors else -1) for a in args))
        return out

    @property
    def reads(self) -> frozenset[str]:
        """The names of the backward's ops, maps, deltas and selections read: the forward's
        inputs and outputs among them are all it has to save (softmax: y and d, not x)."""
        ops = (self.op, self.columns, *((self.shared.sums, self.shared.rows) if self.shared
                                        else ()))
        names = {n for o in (*ops, self.scores) if o is not None for n in o.inputs}
        names |= {a for _, args in self.maps.values() for a, _ in args}
        names |= {o for _, o in self.derived.dots.values()}
        return frozenset(names | {n for s in self.derived.selections
                                  for n in (s.index, s.result)})

    def run(self, values: dict, needed: set[str]) -> dict:
        """Gradient name -> tensor, from the backward's inputs by name: the backward
        cascade's kernel (all of its outputs in its one pass), the ``needed`` maps, and the
        other orientation's kernel where a gradient needs it; through the scores
        (attention's dq, dk, dv; the LM head's dh, dw) where those and maps are all that
        is needed."""
        for delta, (up, o) in self.derived.dots.items():  # FlashAttention's rowsum(dO * O)
            # a per-row statistic: summed in float32 at least, as the kernels' sums are
            acc = torch.promote_types(values[o].dtype, torch.float32)
            values[delta] = (values[up].to(acc) * values[o].to(acc)).sum(-1)
        length = _length(self.derived, values)
        stream = values[self.derived.forward.streams[0].name]
        values[N.name] = torch.tensor(float(length), dtype=stream.dtype)  # maps read N
        if self.scores is not None:
            through = needed & set(self.scores.gradients)
            beside = needed - through  # maps of what is at hand (a z-loss weight's)
            if through and self._at_hand(beside, values) and self.scores.applies(
                    values, through):
                return self.scores.run(values, through) | self._mapped(values, beside, length)
        for s in self.derived.selections:
            values |= _selected(s, values, length)
        summed = self.shared.summed(self.derived, values, needed) if self.shared else set()
        out = {}
        # with summed gradients the row backward without them runs, where more is needed
        kernel = (self.shared.rows if needed - summed else None) if summed else self.op
        if kernel is not None:
            out = dict(zip(kernel.outputs, kernel(*(values[n] for n in kernel.inputs)),
                           strict=True))
        if summed:
            out |= self.shared.run(self.derived, values)
        out |= self._mapped(values, needed - summed, length)
        if self.columns is not None and needed & set(self.columns.outputs):
            laid = column_values(self.derived, values | out, self.columns.inputs,
                                 _rows(self.derived, values))
            of = {g: n for n, (g, _) in self.derived.gradients.items()}
            out |= {g: column_gradient(t, values[of[g]].shape) for g, t in
                    zip(self.columns.outputs, self.columns(*laid.values()), strict=True)}
        return out

    def _at_hand(self, names: set[str], values: dict) -> bool:
        """Every one of ``names`` is a map whose arguments are all in ``values`` (not a
        selection's, which only the kernels' path scatters)."""
        return all(n in self.maps and all(a in values for a, _ in self.maps[n][1])
                   for n in names)

    def _mapped(self, values: dict, names: set[str], length: int) -> dict:
        """The maps of ``names`` (those no kernel computes), by torch."""
        return _along_the_row(self.derived, {
            name: f(*(_per_element(values[a], axis) for a, axis in args))
            for name, (f, args) in self.maps.items() if name in names}, values, length)


def _selected(s: Selection, values: dict, length: int) -> dict:
    """A selection's per-element input: its upstream (or 1) scattered to the elements at
    the saved indices (distinct: a top-k never picks one twice), and ``dot(dp, p)``."""
    index = values[s.index].long()
    # no upstream: the selected value is read inside the cascade (not saved), its adjoint 1
    upstream = values[s.upstream] if s.upstream else torch.ones(index.shape)
    if s.k is None:
        index, upstream = index.unsqueeze(-1), upstream.unsqueeze(-1)
    zeros = upstream.new_zeros((*index.shape[:-1], length))
    out = {s.selector: zeros.scatter(-1, index, upstream)}
    if s.delta:
        out[s.delta] = (upstream * values[s.result]).sum(-1)
    return out


def _along_the_row(derived: Backward, maps: dict, values: dict, length: int) -> dict:
    """``maps`` with each scalar stream's gradient that reads no stream (a mean's
    dx = dr / N, geometric_mean's dx = dg * g_prod * exp(m) / N: a value per row, or a
    constant) broadcast along the row, to the stream's shape."""
    rows, streams = _rows(derived, values), derived.forward.streams
    grads = {derived.gradients[s.name][0] for s in streams if s.name in derived.gradients
             and s.name not in derived.forward.vector_inputs}
    out, stream = dict(maps), values[streams[0].name]
    for g in grads & set(maps):
        t = torch.as_tensor(maps[g], dtype=stream.dtype, device=stream.device)
        if tuple(t.shape) != (*rows, length):
            out[g] = t.expand(rows).unsqueeze(-1).expand(*rows, length)
    return out


def _length(derived: Backward, values: dict) -> int:
    """The forward's stream length N, from a stream input: its last axis, or the one
    before its features for a vector stream (an LM head's ``w[i, :]``: N the vocabulary,
    not D)."""
    name = derived.forward.streams[0].name
    return values[name].shape[-2 if name in derived.forward.vector_inputs else -1]


def _rows(derived: Backward, values: dict) -> tuple[int, ...]:
    """The forward's row shape, from an upstream gradient (less its feature or stream axis
    where the output has one)."""
    o, g = next(iter(derived.upstream.items()))
    shape, forward = tuple(values[g].shape), derived.forward
    per_element = o in forward.elementwise or o in vector_results(forward)
    return shape[:-1] if per_element else shape


def _per_element(value, axis: int | None):
    """A per-row value broadcast over the stream axis: a scalar per row gains it last, a
    feature vector before its features (a stream is as it is)."""
    if axis is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    return value.unsqueeze(axis)
