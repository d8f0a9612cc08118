"""Gradients of inputs every row shares, summed over the rows in one column cascade.

A LayerNorm weight ``g`` of shape (N,) is read by every row: its gradient is the sum over
the rows of the per-element gradient the backward derived and proved (LayerNorm's
``dg[i] = dy[i] * (x[i] - mean) / sqrt(var + eps)``), by the chain rule through the
broadcast.  Written out per element and summed afterwards, that is one more rows x N array
written and read again.  Where the per-element gradient is a map of what the forward
already holds (its inputs, its upstream, what it saved: no sum the backward computes), it
is instead a cascade in the other orientation: the rows are its stream and the forward's
stream positions its feature axis,

    dg = sum(dy[i, :] * (x[i, :] - mean[i]) / sqrt(eps + var[i]))

one pass over the rows, contiguous (the forward's rows x N arrays are read as they are),
whose partial sums are merged in a fixed order.  The row-parallel backward then runs
without those gradients.  Nothing new is proven: the sum over the rows is the broadcast's
chain rule, the summands are the proven gradients.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy as sp

from .backward import Backward
from .backward_text import written
from .cascade import LENGTH, POSITION, Cascade
from .errors import NoBackward
from .functions import Dot
from .names import fresh
from .printing import spec_text
from .spec import parse


@dataclass(frozen=True)
class SharedSums:
    """The gradients a backward can sum over the rows of inputs the rows share.

    ``gradients``: those gradients; ``sums``: the column cascade computing them (its
    stream the forward's rows, ``length`` the parameter holding the forward's N);
    ``rows``: the row-parallel backward without them ("" where nothing is left)."""

    gradients: tuple[str, ...]
    sums: str
    rows: str
    length: str


def shared_sums(b: Backward, scalars: tuple[str, ...] = ()) -> SharedSums | None:
    """The column cascade of ``b``'s per-element gradients that are maps of the forward's
    values (module docstring), or None where there is none; ``scalars``: the forward's
    parameters passed as Python numbers (every other per-row value is a row's own).

    Examples
    --------
    >>> from algebra import derive
    >>> s = shared_sums(derive("rmsnorm").backward(), scalars=("eps",))
    >>> s.gradients, s.sums
    (('dg',), 'dg = sum(dy[i, :]*x[i, :]/r[i])')
    """
    c, streams, per_element = b.forward, {s.name for s in b.forward.streams}, b.per_element
    per_row = set(b.saved) | {p.name for p in c.params} - set(scalars) | {
        g for o, g in b.upstream.items() if o not in c.elementwise}
    stream_grads = {g for n, (g, _) in b.gradients.items() if n in streams}
    summed = {g: e for g, e in b.maps.items() if g in stream_grads and _summable(
        sp.sympify(e), per_element | per_row | set(scalars), c)}
    if not summed:
        return None
    length = fresh(f"{LENGTH.lower()}_stream", set(c.names) | per_element | per_row)

    def spell(s: sp.Symbol) -> str:
        if s.name == LENGTH:
            return length
        return f"{s.name}[i, :]" if s.name in per_element else \
            f"{s.name}[i]" if s.name in per_row else s.name

    sums = "\n".join(f"{g} = sum({spec_text(sp.sympify(e), spell, NoBackward)})"
                     for g, e in summed.items())
    return SharedSums(tuple(summed), sums, without(b.spec, set(summed) | scalar_gradients(
        b, scalars)), length)


def scalar_gradients(b: Backward, scalars: tuple[str, ...]) -> set[str]:
    """The gradients of parameters passed as Python numbers: nothing asks for them."""
    return {g for n, (g, _) in b.gradients.items() if n in scalars}


def _summable(e: sp.Expr, known: set[str], c: Cascade) -> bool:
    """A map of values the forward holds, read per element or per row (not the position,
    not a feature vector: their columns are not the forward's rows x N arrays)."""
    names = {s.name for s in e.free_symbols}
    return (names <= known | {LENGTH} and POSITION.name not in names
            and not names & set(c.vector_inputs) and not e.has(Dot))


def without(spec: str, dropped: set[str]) -> str:
    """``spec`` without the outputs ``dropped`` and the per-row lines only they read."""
    c = parse(spec)
    if not dropped & set(c.outputs):
        return spec
    kept = {y: e for y, e in c.elementwise.items() if y not in dropped}
    results = {r.name: r.body for r in c.reductions} | dict(c.epilogues)
    todo = [s.name for e in kept.values() for s in e.free_symbols]
    todo += [o for o in c.outputs if o in results and o not in dropped]
    wanted: set[str] = set()
    while todo:  # the results kept and every result they read
        name = todo.pop()
        if name in results and name not in wanted:
            wanted.add(name)
            todo += [s.name for s in results[name].free_symbols]
    if not kept and not wanted:
        return ""
    pruned = dataclasses.replace(
        c, reductions=tuple(r for r in c.reductions if r.name in wanted),
        epilogues={n: e for n, e in c.epilogues.items() if n in wanted}, elementwise=kept,
        outputs=tuple(o for o in c.outputs if o in wanted or o in kept))
    return written(pruned)
