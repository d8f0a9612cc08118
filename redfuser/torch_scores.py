"""The backward through the scores (``algebra.backward_scores``) run with torch's matrix
products: attention's dq, dk and dv as FlashAttention computes them, every coefficient
the engine's.

The positions (keys) are taken in blocks.  For each block, each score (``dot(q, k[i, :])``,
``dot(do, v[i, :])``) is one batched product (rows x block), the block map's kernel
(``ThroughScores.block``: one pass, written into buffers every block reuses) turns them into
the coefficients, and one more product per gradient takes each coefficient into the rows'
gradient (``C @ k``: dq, added block after block in a fixed order) or into the block's rows
of a shared stream's (``C.T @ q``: dk, dv, written once).  Two runs give the same bits.
Where a mask's per-row side does not decrease along the rows (a causal mask's query
positions), a block adds only to the rows it can reach (``_seen``).  Products run in
float32 at least; a bfloat16 stream is converted a block at a time.
Registered as its own op (``<name>_backward_scores``, with a fake), so ``torch.compile``
traces it as one call whatever the number of blocks.

Layout: the forward's rows ``R`` (heads x queries) against a shared stream (heads x 1 x
keys x D) are its kept axes (heads, K of them) and the axes the stream is shared along
(queries, W), as in ``redfuser.torch_columns``: products are batched over the kept axes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from algebra.backward_scores import ThroughScores
from algebra.backward_sorted import SIDES

from .kernel import Kernel, compile
from .torch_columns import kept_axes, non_decreasing, per_row_value

# the least number of positions a block holds: narrower blocks make the products too thin
# to run at speed (the same five products in torch alone, attention 8 x 1024 x 1024 D64 on
# a 2-core Xeon: 26-27 ms with blocks of 256 or 512 keys, 29 with 128, 33 with one of 1024)
BLOCK = 256


@dataclass(frozen=True)
class ScoresBackward:
    """``of`` run as the op ``op``: (``inputs``, then whether each of ``gradients`` is
    wanted) -> the gradients, an empty tensor for one not wanted."""

    of: ThroughScores
    op: object
    inputs: tuple[str, ...]
    gradients: tuple[str, ...]

    def applies(self, values: dict, needed: set[str]) -> bool:
        """Every needed gradient is one of ``gradients``, and the shared streams have
        the same leading axes and positions."""
        # a list, not a set: under torch.compile the sizes may be symbolic (unhashable)
        shapes = [tuple(values[s].shape[:-1]) for _, s in self.of.scores.values()]
        return needed <= set(self.gradients) and all(s == shapes[0] for s in shapes)

    def run(self, values: dict, needed: set[str]) -> dict:
        args = [torch.as_tensor(values[n]) for n in self.inputs]
        wanted = [g in needed for g in self.gradients]
        got = self.op(*args, *wanted)
        return {g: t for g, t, w in zip(self.gradients, got, wanted, strict=True) if w}


@dataclass(frozen=True)
class _Roles:
    """The inputs of ``of`` by role, and the input each gradient is of."""

    row_vectors: tuple[str, ...]  # q, do: per-row vectors
    shared: tuple[str, ...]  # k, v: the streams the rows share
    of_input: dict[str, str]  # gradient -> its input

    @staticmethod
    def of(of: ThroughScores, inputs_of: dict[str, str]) -> _Roles | None:
        rows = {a for a, _ in of.scores.values()} | {t.vector for t in of.terms
                                                     if t.vector and not t.rows}
        shared = {s for _, s in of.scores.values()} | {t.vector for t in of.terms
                                                       if t.vector and t.rows}
        home = {t.gradient: rows if t.rows and t.vector else shared if t.vector
                else set(of.reads) for t in of.terms}
        if rows & shared or any(inputs_of.get(g) not in h for g, h in home.items()):
            return None
        return _Roles(tuple(sorted(rows)), tuple(sorted(shared)),
                      {g: inputs_of[g] for g in home})


def scores_backward(of: ThroughScores, inputs_of: dict[str, str], name: str,
                    namespace: str, **options) -> ScoresBackward | None:
    """Register ``<name>_backward_scores`` for ``of`` (module docstring), ``inputs_of``
    each gradient's input; None where a gradient is not of a vector its terms take the
    place of (the rows' gradient of a per-row vector, the block's of a shared stream) or
    of a per-row scalar.  ``options`` go to ``redfuser.compile`` for the block map."""
    roles = _Roles.of(of, inputs_of)
    if roles is None:
        return None
    inputs = (*roles.row_vectors, *roles.shared, *of.reads)
    gradients = tuple(dict.fromkeys(t.gradient for t in of.terms))

    @functools.cache
    def block(coefficients: tuple[str, ...]) -> Kernel:
        """The block map computing these coefficients only (a learned scale's too where
        it is wanted): every block width, one build."""
        return compile(of.block_of(coefficients), **{**options, "dynamic": True})

    def real(*args):
        values = dict(zip(inputs, args[:len(inputs)], strict=True))
        wanted = {g for g, w in zip(gradients, args[len(inputs):], strict=True) if w}
        got = _blocks(block, of, roles, values, wanted)
        return tuple(got[g] if g in got else args[0].new_empty(0) for g in gradients)

    def fake(*args):
        values = dict(zip(inputs, args[:len(inputs)], strict=True))
        return tuple(args[0].new_empty(_shape(of, roles, values, g) if w else 0)
                     for g, w in zip(gradients, args[len(inputs):], strict=True))

    params = "".join(f"Tensor x{i}, " for i in range(len(inputs)))
    wants = ", ".join(f"bool want{i}" for i in range(len(gradients)))
    schema = f"({params}{wants}) -> ({', '.join('Tensor' for _ in gradients)})"
    op = torch.library.custom_op(f"{namespace}::{name}_backward_scores", real,
                                 mutates_args=(), schema=schema)
    op.register_fake(fake)
    return ScoresBackward(of, op, inputs, gradients)


def _shape(of: ThroughScores, roles: _Roles, values: dict, gradient: str) -> tuple:
    """A gradient's shape as ``_blocks`` returns it: a shared stream's own; a per-row
    vector's or scalar's over every row (the op's caller sums it to the input's)."""
    term = next(t for t in of.terms if t.gradient == gradient)
    x = values[roles.of_input[gradient]]
    if term.vector and not term.rows:
        return tuple(x.shape)
    rows = torch.broadcast_shapes(*(values[n].shape[:-1] for n in roles.row_vectors))
    return (*rows, x.shape[-1]) if term.vector else tuple(rows)


def _blocks(block, of: ThroughScores, roles: _Roles, values: dict,
            wanted: set[str]) -> dict:
    """The wanted gradients over blocks of the positions (module docstring), computed in
    float32 at least (float64 in float64), returned in their inputs' dtypes (a per-row
    scalar's per row: the op's caller sums it to the input's shape)."""
    first = values[roles.row_vectors[0]]
    rows = tuple(torch.broadcast_shapes(*(values[n].shape[:-1] for n in roles.row_vectors)))
    acc = torch.promote_types(first.dtype, torch.float32)
    lay = _Layout.of(values[roles.shared[0]], rows)
    terms = [t for t in of.terms if t.gradient in wanted]
    vec = {n: lay.laid(values[n].to(acc), vector=True) for n in roles.row_vectors}
    streams = {n: values[n].reshape(lay.k, *values[n].shape[-2:]) for n in roles.shared}
    grads = {t.gradient: first.new_zeros((lay.k, lay.w), dtype=acc) if not t.vector else
             torch.zeros_like(vec[roles.of_input[t.gradient]] if t.rows
                              else streams[roles.of_input[t.gradient]], dtype=acc)
             for t in terms}
    run = _Run(of, terms, vec, streams, {n: lay.laid(values[n].to(acc)) for n in of.reads},
               acc, grads)
    n, d = run.streams[roles.shared[0]].shape[-2:]
    step = min(n, max(d, BLOCK))
    # the scores and coefficients of a block, in buffers every block reuses
    buffers = {x: torch.empty(lay.k * lay.w * step, dtype=acc)
               for x in (*of.scores, *(t.coefficient for t in run.terms))}
    kernel = block(tuple(c for c in of.lines if c in {t.coefficient for t in run.terms}))
    masks = _sorted_masks(of, run.per_row)
    for start in range(0, n, step):
        part = slice(start, min(n, start + step))
        seen = _seen(masks, part, lay.w)
        if seen.start < seen.stop:
            run.block(kernel, buffers, part, seen, n)
    shared = {t.gradient for t in run.terms if t.vector and not t.rows}
    like = {g: values[roles.of_input[g]] for g in grads}
    return {g: (v.reshape(like[g].shape) if g in shared else lay.back(v)).to(like[g].dtype)
            for g, v in grads.items()}


@dataclass(frozen=True)
class _Run:
    """One call's laid-out values (``_Layout``: k x w rows) and its gradients."""

    of: ThroughScores
    terms: list
    vec: dict  # per-row vectors, k x w x D
    streams: dict  # shared streams, k x N x D, in their own dtype
    per_row: dict  # per-row scalars, k x w (or 0-d)
    acc: torch.dtype  # the compute dtype
    grads: dict

    def block(self, kernel: Kernel, buffers: dict, part: slice, seen: slice, n: int) -> None:
        """The positions ``part`` for the rows ``seen``: the scores, the coefficients,
        and each term's product into its gradient."""
        k, w = len(next(iter(self.vec.values()))), seen.stop - seen.start  # kept, rows
        laid = {x: b[:k * w * (part.stop - part.start)].view(k, w, -1)
                for x, b in buffers.items()}
        vec = {a: v[:, seen] for a, v in self.vec.items()}
        # the shared streams in their dtype, a block at a time in the compute dtype: a
        # bfloat16 vocabulary head is never copied whole to float32
        streams = {b: v[:, part].to(self.acc) for b, v in self.streams.items()}
        for s, (a, b) in self.of.scores.items():
            torch.bmm(vec[a], streams[b].mT, out=laid[s])
        # the kernel reads compact arrays: a slice of the rows is one when k > 1
        given = {r: v[:, seen].contiguous() if v.dim() else v for r, v in self.per_row.items()}
        given |= laid | {self.of.first: float(part.start), self.of.length: float(n)}
        c = kernel.rule.cascade
        kernel(**{r.name: given[r.name] for r in (*c.streams, *c.params)},
               out={t.coefficient: laid[t.coefficient] for t in self.terms})
        for t in self.terms:
            g, u, x = self.grads[t.gradient], t.vector, laid[t.coefficient]
            if t.rows and u:
                g[:, seen].baddbmm_(x, streams[u])
            elif t.rows:
                g[:, seen] += x.sum(-1)
            else:
                g[:, part] = torch.bmm(x.mT, vec[u])


def _sorted_masks(of: ThroughScores, per_row: dict) -> list[tuple[str, torch.Tensor]]:
    """Each mask ``i op e`` of ``of`` with ``e`` per row (k x w) where ``e`` does not
    decrease along the rows of every k (a causal mask's query positions): a block of
    keys then adds only to a range of the rows (``_seen``).  A NaN fails the check."""
    values = [(op, per_row_value(e, per_row)) for op, e in of.masks]
    return [(op, v.contiguous()) for op, v in values if v.dim() == 2 and non_decreasing(v)]


def _seen(masks: list, part: slice, w: int) -> slice:
    """The rows that the keys ``part`` can add to, over every k: a mask ``i op e[r]`` read
    with the rows as the sorted stream is ``SIDES``' ``at op e[r]``, a range of the rows
    from (``>=``) the first key's bound or up to (``<``) the last key's."""
    lo, hi = 0, w
    for op, e in masks:
        index_op, side = SIDES[op]
        at = float(part.start if index_op == ">=" else part.stop - 1)
        count = torch.searchsorted(e, torch.full((len(e), 1), at, dtype=e.dtype), side=side)
        if index_op == ">=":
            lo = max(lo, int(count.min()))
        else:
            hi = min(hi, int(count.max()))
    return slice(lo, hi)


@dataclass(frozen=True)
class _Layout:
    """The forward's rows as (kept axes, shared axes) = (k, w) (module docstring)."""

    rows: tuple[int, ...]
    kept: tuple[int, ...]
    along: tuple[int, ...]

    @staticmethod
    def of(stream: torch.Tensor, rows: tuple[int, ...]) -> _Layout:
        kept, along = kept_axes(stream, rows)
        return _Layout(rows, kept, along)

    @property
    def k(self) -> int:
        return math.prod(self.rows[a] for a in self.kept)

    @property
    def w(self) -> int:
        return math.prod(self.rows[a] for a in self.along)

    def laid(self, t: torch.Tensor, vector: bool = False) -> torch.Tensor:
        """A per-row value (a scalar, or a ``vector`` last) as (k, w[, D]); 0-d as it is."""
        if t.dim() == 0:
            return t
        tail = tuple(t.shape[-1:]) if vector else ()
        t = t.expand(*self.rows, *tail).permute(*self.kept, *self.along,
                                                *range(len(self.rows), len(self.rows) +
                                                       len(tail)))
        return t.reshape(self.k, self.w, *tail)

    def back(self, t: torch.Tensor) -> torch.Tensor:
        """A per-row gradient laid (k, w[, D]) with the rows' axes back in order."""
        order = (*self.kept, *self.along)
        t = t.reshape(*(self.rows[a] for a in order), *t.shape[2:])
        return t.permute(*(order.index(a) for a in range(len(self.rows))),
                         *range(len(self.rows), t.dim()))
