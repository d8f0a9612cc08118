"""Fragments: the spec statements one lifted Relax value needs, with its inputs, in one row frame.

A lifted value lives on a *frame*: its row axes (every axis but the streamed last one).
Each input records its own row axes in that frame (1 where it is broadcast), which is
exactly what the kernel's array convention needs (``algebra/layout.py``).  Reshapes of
row axes move a fragment to a new frame; an input's pattern moves with it when every
merged or split block of axes is either wholly read or wholly broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod

import numpy as np

from algebra.dtypes import STORAGE


class Unliftable(Exception):
    """A Relax binding that has no spec form (the message says why)."""


def dtype_refusal(dtype: str) -> str:
    """Why a value of ``dtype`` (not a storage dtype) is not lifted.

    Examples
    --------
    >>> print(dtype_refusal("float64"))
    tensors of dtype float64: redfuser kernels read float32, bfloat16 or float16
    """
    *first, last = STORAGE
    return f"tensors of dtype {dtype}: redfuser kernels read {', '.join(first)} or {last}"


def computed(dtype: str) -> None:
    """Accept a value of ``dtype`` computed by a kernel, or say why not.  A model's
    bfloat16 or float16 arithmetic (llama's ``weight * hidden.to(bfloat16)`` between its
    norm and its projection, a matmul of bfloat16 operands) is computed in float32, and a
    cast between float dtypes inside the cascade is the identity: the kernel rounds only
    what it stores.  That is torch.compile's convention (Inductor upcasts low-precision
    arithmetic and does not emulate the casts between fused ops); the result is nearer the
    float64 value than the unfused graph's and within one rounding of it at the output.

    Examples
    --------
    >>> computed("bfloat16")
    >>> computed("int64")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    redfuser.relax.frag.Unliftable: tensors of dtype int64: redfuser kernels read ...
    """
    if dtype not in STORAGE:
        raise Unliftable(dtype_refusal(dtype))


@dataclass(frozen=True, eq=False)
class Input:
    """One kernel input: a Relax expression read as a stream ``x[i]`` or a parameter ``x``.

    ``prep`` names a small Relax op applied before the call: ``("T",)`` swaps the last two
    axes, ``("float",)`` casts to float32 (an index, or a boolean condition as 0/1).
    """

    source: object
    kind: str  # "stream" | "param"
    vector: bool  # carries the feature axis D
    rows: tuple[int, ...]  # own row axes in the fragment's frame, 1 where broadcast
    prep: tuple = ()
    dtype: str = "float32"  # its storage dtype (``algebra.dtypes``): the kernel converts it

    def ref(self, name: str) -> str:
        """How the spec reads it."""
        if self.kind == "stream":
            return f"{name}[i, :]" if self.vector else f"{name}[i]"
        return f"{name}[:]" if self.vector else name


@dataclass(frozen=True)
class Stmt:
    """One spec statement ``name = text``; ``kind``: let (per element), red (holds a
    reduction: a result) or epi (arithmetic on per-row results: an epilogue)."""

    seq: int
    name: str
    text: str
    kind: str
    deps: frozenset[str]  # statements it reads
    op: str  # the Relax binding it comes from, for the report ("softmax lv9")
    absorbed: tuple[str, ...] = ()  # reductions of a chain it stands for ("max lv105")


@dataclass(frozen=True, eq=False)
class Frag:
    """Statements (closed under dependence) and inputs of a value, in one frame."""

    frame: tuple[int, ...]
    n: int
    d: int | None = None
    stmts: dict[str, Stmt] = field(default_factory=dict)
    inputs: dict[str, Input] = field(default_factory=dict)
    dots: frozenset = frozenset()  # inlined matmuls (Relax vars) among the statements

    @property
    def reduces(self) -> bool:
        return any(s.kind != "let" for s in self.stmts.values())

    def with_stmt(self, stmt: Stmt) -> Frag:
        return replace(self, stmts={**self.stmts, stmt.name: stmt})


def offsets(rows: tuple[int, ...], frame: tuple[int, ...]) -> np.ndarray:
    """For every row of ``frame``, the row of the input (own axes ``rows``) it reads."""
    out = np.zeros(frame, dtype=np.int64)
    step = 1
    for axis in reversed(range(len(frame))):
        if rows[axis] > 1:
            shape = [1] * len(frame)
            shape[axis] = frame[axis]
            out = out + np.arange(frame[axis]).reshape(shape) * step
            step *= rows[axis]
    return out


def rows_of(table: np.ndarray) -> tuple[int, ...] | None:
    """The own-axes pattern that reads ``table``, or None when no pattern does."""
    rows = tuple(size if size > 1 and bool((np.diff(table, axis=a) != 0).any()) else 1
                 for a, size in enumerate(table.shape))
    return rows if np.array_equal(offsets(rows, table.shape), table) else None


def move_rows(rows: tuple[int, ...], old: tuple[int, ...], new: tuple[int, ...]):
    """An input's pattern after its frame is reshaped (same row count) or broadcast.

    Examples
    --------
    >>> move_rows((2, 1), (2, 16), (1, 2, 16))  # K of 2 heads, shared by 16 queries
    (1, 2, 1)
    >>> move_rows((1, 16), (4, 16), (2, 2, 16))  # broadcast over a split axis
    (1, 1, 16)
    >>> move_rows((2, 1), (2, 4), (8,)) is None  # merging a read and a broadcast axis
    True
    """
    table = offsets(rows, old)
    if prod(old) == prod(new):
        return rows_of(table.reshape(new))
    if len(new) < len(old):
        return None
    padded = table.reshape((1,) * (len(new) - len(old)) + old)
    try:
        return rows_of(np.broadcast_to(padded, new))
    except ValueError:
        return None


def reframe(frag: Frag, frame: tuple[int, ...]) -> Frag:
    """``frag`` on ``frame``: a reshape of its rows, or (without reductions) a broadcast."""
    frame = tuple(frame)
    if frame == frag.frame:
        return frag
    if prod(frame) != prod(frag.frame) and frag.reduces:
        raise Unliftable(f"rows {frag.frame} broadcast to {frame}: the reductions would be "
                         "repeated per broadcast row")
    inputs = {}
    for name, inp in frag.inputs.items():
        rows = move_rows(inp.rows, frag.frame, frame)
        if rows is None:
            raise Unliftable(f"rows {frag.frame} -> {frame} split an input that is broadcast "
                             "on part of the merged axes")
        inputs[name] = replace(inp, rows=rows)
    return replace(frag, frame=frame, inputs=inputs)


def fit(frag: Frag, frame: tuple[int, ...]) -> Frag:
    """``frag`` on ``frame``, or on its own frame when that has as many rows and one of its
    inputs cannot be read on ``frame`` (grouped-query K/V: rows (B, Hkv, 1, 1) of the frame
    (B, Hkv, G, L), where the Relax value is (B, H, L)): both frames order the rows alike,
    so the value is the same; ``merge`` then picks the frame every fragment reads on."""
    try:
        return reframe(frag, frame)
    except Unliftable:
        if prod(frag.frame) != prod(frame):
            raise
        return frag


def _on_common_frame(frags: list[Frag], frame: tuple[int, ...]) -> tuple[tuple, list | None]:
    """(frame, ``frags`` on it): ``frame``, else the first frame of a fragment with as many
    rows on which every fragment can be read; (``frame``, None) when none can."""
    frame = tuple(frame)
    for candidate in dict.fromkeys([frame, *(f.frame for f in frags)]):
        if prod(candidate) == prod(frame):
            try:
                return candidate, [reframe(f, candidate) for f in frags]
            except Unliftable:
                continue
    return frame, None


def merge(frags: list[Frag], frame: tuple[int, ...], n: int) -> Frag:
    """One fragment holding all of ``frags`` on ``frame`` (stream length ``n``), or on a
    frame with as many rows that reads them all (``fit``)."""
    frame, on_frame = _on_common_frame(frags, frame)
    stmts, inputs, d, dots = {}, {}, None, frozenset()
    for k, f in enumerate(frags):
        dots |= f.dots
        if f.n not in (0, n):  # 0: parameters only, read on any stream
            raise Unliftable(f"stream lengths {f.n} and {n} differ")
        if f.d is not None and d is not None and f.d != d:
            raise Unliftable(f"two feature lengths ({d} and {f.d}) in one kernel")
        d = f.d if f.d is not None else d
        f = on_frame[k] if on_frame else reframe(f, frame)  # the latter raises the reason
        for name, inp in f.inputs.items():
            if name in inputs and inputs[name].rows != inp.rows:
                raise Unliftable(f"input {name} read with rows {inputs[name].rows} and "
                                 f"{inp.rows}")
            inputs[name] = inp
        stmts.update(f.stmts)
    return Frag(tuple(frame), n, d, stmts, inputs, dots)


def closure(stmts: dict[str, Stmt], names) -> list[Stmt]:
    """The statements ``names`` need, in definition order."""
    seen, todo = set(), [n for n in names if n in stmts]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(d for d in stmts[name].deps if d in stmts)
    return sorted((stmts[n] for n in seen), key=lambda s: s.seq)
