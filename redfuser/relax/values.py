"""The values the Relax lifter works with, and the interface the op table sees of it.

``ops.py`` (the table: one handler per Relax op) reads and builds these values through
``Lifting``; ``lift.py`` (the walker over a dataflow block) implements ``Lifting`` and
calls the table.  Kept apart so that data flows one way: values <- ops <- lift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from ..tvm.graph import relax
from .frag import Frag, Stmt, Unliftable

MAX_TERMS = 4  # additive terms kept apart for distributing a matmul's sum over them


@dataclass(frozen=True, eq=False)
class Node:
    """A lifted Relax value.

    ``kind``: elem (per element of the stream), row (one value per row), vec (a per-row
    feature vector, a matmul result), topk / index (k values or indices per row), tuple
    (topk's pair, in ``fields``).  ``terms`` split an elem into additive parts; ``dots``
    are the inlined matmuls (Relax vars) it reads through lets.  ``perm``: the kernel
    holds an elem value with its axes permuted (a reduction over a middle axis), so only
    the splice reads it, putting the axes back.
    """

    kind: str
    frag: Frag
    text: str
    deps: frozenset[str]
    shape: tuple[int, ...]
    terms: tuple = ()
    dots: frozenset = frozenset()
    fields: tuple = ()
    perm: tuple = ()  # computed with the value's axes in this order (reduced axes last)


@dataclass(frozen=True)
class Operand:
    """An operand as the spec reads it: text, statements read, fragment (None: literal)."""

    text: str
    deps: frozenset[str] = frozenset()
    frag: Frag | None = None
    terms: tuple = ()
    dots: frozenset = frozenset()

    def term_list(self) -> tuple:
        return self.terms or ((self.text, self.deps),)


@dataclass(frozen=True, eq=False)
class Ext:
    """A value computed outside the kernel: a Relax expression, maybe with a prep op."""

    source: object
    shape: tuple[int, ...]
    dtype: str  # of the value the cascade reads: a storage dtype (``frag.computed``)
    prep: tuple = ()
    storage: str = "float32"  # of ``source``: a bfloat16 one cast to float32 is read as it is


def static_shape(ty) -> tuple[int, ...]:
    """The integer shape of a tensor type; symbolic dimensions raise Unliftable."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise Unliftable(f"not a tensor of known rank ({ty})")
    dims = []
    for v in ty.shape.values:
        if not hasattr(v, "value"):
            raise Unliftable(f"symbolic dimension {v} in {ty}: only static shapes are fused")
        dims.append(int(v.value))
    return tuple(dims)


def shape_of(ty) -> tuple:
    """The shape of a tensor type: ints where static, TIR expressions of the function's
    shape variables where symbolic (``symbolic.py``'s rewrite reads these)."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise Unliftable(f"not a tensor of known rank ({ty})")
    return tuple(int(v.value) if hasattr(v, "value") else v for v in ty.shape.values)


def literal(value: float) -> str:
    if math.isnan(value):
        raise Unliftable("a NaN constant")
    if math.isinf(value):
        return "inf" if value > 0 else "(-inf)"
    return repr(value) if value >= 0 else f"({value!r})"


def pad_shape(shape: tuple, rank: int, out: tuple) -> tuple:
    """``shape`` left-padded with 1s to ``rank`` axes, checked to broadcast to ``out``."""
    if len(shape) > rank:
        raise Unliftable(f"{shape} has more axes than {out}")
    shape = (1,) * (rank - len(shape)) + tuple(shape)
    if any(s not in (1, o) for s, o in zip(shape, out, strict=True)):
        raise Unliftable(f"{shape} does not broadcast to {out}")
    return shape


class Lifting(Protocol):
    """What an op handler may use of the walker (``lift.Lifter``)."""

    current: object  # the Relax var being lifted
    materialise: frozenset  # matmuls to keep as they are
    nodes: dict  # Relax var -> Node
    values: dict  # every bound var of the function -> its value
    absorbed: set  # (consumer var, operand var): reads that die with the fused kernel
    quiet: set  # vars whose failure to lift is not reported (a chain a handler absorbed)

    def stmt(self, text: str, kind: str, deps, op: str, absorbed: tuple = ()) -> Stmt: ...
    def input(self, ext: Ext, kind: str, vector: bool, rows: tuple, frame, n, d=None): ...
    def node(self, expr) -> Node | None: ...
    def scalar(self, expr) -> float | None: ...
    def ext(self, expr) -> Ext: ...
    def visible(self, expr) -> bool: ...
    def elem(self, expr, out: tuple) -> Operand: ...
    def row(self, expr, out: tuple, keepdims: bool) -> Operand: ...
    def feature(self, expr, out: tuple) -> Operand: ...
    def combine(self, operands: list[Operand], frame) -> Frag: ...
