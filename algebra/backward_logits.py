"""A backward through the logits: a cascade that reads its inputs only through ``s[i] =
dot(h, w[i, :])``.

``linear_cross_entropy``'s loss reads the head ``w`` (the stream: one row per vocabulary
entry) and the hidden state ``h`` (a per-row vector) only through the logits ``s = h @ w.T``.
By the chain rule through that product, with ``ds[r, i] = d loss[r] / d s[r, i]``,

    dh[r, :] = sum_i ds[r, i] * w[i, :]        (ds @ w)
    dw[i, :] = sum_r ds[r, i] * h[r, :]        (ds.T @ h)

so the whole backward is ``ds`` and two GEMMs.  ``ds`` is the backward of the cascade
with the logits as its stream (the same reductions, ``dot(h, w[i, :])`` replaced by
``s[i]``: cross-entropy on logits), derived and proven by ``algebra.backward`` like any
other; the two products are the chain rule itself.  A caller runs it over chunks of rows
(``redfuser.torch_logits``): each chunk's logits are recomputed by a GEMM, ``ds`` replaces
them, and two GEMMs take them to ``dh`` and ``dw``, so the rows x V logits never exist,
and the step does three GEMMs where the fused kernels' dh and dw passes each recompute
the logits (four).

Examples
--------
>>> from algebra import derive
>>> t = through_logits(derive("linear_cross_entropy").backward())
>>> t.row, t.shared, t.logits
('h', 'w', 's')
>>> t.ds
where(Eq(i, label), -dloss + dloss*exp(-m + s)/lse_sum, dloss*exp(-m + s)/lse_sum)
>>> t.reads
('dloss', 'i', 'label', 'lse_sum', 'm')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy as sp

from .backward import Backward, backward
from .backward_text import written
from .cascade import POSITION, Cascade, N
from .errors import NoBackward
from .functions import Dot
from .names import fresh
from .spec import parse


@dataclass(frozen=True)
class ThroughLogits:
    """``row`` (h) and ``shared`` (w) read only through ``logits[i] = dot(h, w[i, :])``;
    ``ds`` the proven gradient of the loss with respect to each logit, reading the logit,
    the position, the upstream and the per-row values the forward saved (``reads``)."""

    row: str
    shared: str
    logits: str
    ds: sp.Expr
    backward: Backward  # of the cascade over the logits
    block: str  # ds as a map over one block of the vocabulary (``block_map``)
    first: str  # the block map's parameter: the block's first position
    vocab: str  # the block map's parameter: the vocabulary's length (the forward's N)

    @property
    def reads(self) -> tuple[str, ...]:
        """The names ``ds`` reads besides the logits, sorted."""
        return tuple(sorted(s.name for s in self.ds.free_symbols if s.name != self.logits))


# (why a cascade's backward does not run through its logits, test of the forward)
_REFUSALS = (
    ("it reads no dot product, or several", lambda c, dots: len(dots) != 1),
    ("the dot product is not of a per-row vector with a vector stream",
     lambda c, dots: not _roles(c, next(iter(dots)))),
    ("it has per-element outputs (their gradients are not the logits')",
     lambda c, dots: bool(c.elementwise)),
)


def through_logits(b: Backward) -> ThroughLogits | None:
    """The logits form of ``b`` (module docstring), or None where the forward reads its
    inputs otherwise too, or the logits' backward does not prove."""
    c = parse(b.forward_spec)  # every reduction named, as the forward saves them
    dots = {d for r in c.reductions for d in r.body.atoms(Dot)}
    if any(refused(c, dots) for _, refused in _REFUSALS):
        return None
    (dot,) = dots
    row, shared = _roles(c, dot)
    s = sp.Symbol(fresh("s", set(c.names)), real=True)
    logits = dataclasses.replace(
        c, streams=(s,), params=tuple(p for p in c.params if p.name != row.name),
        vector_inputs=frozenset(), reductions=tuple(
            dataclasses.replace(r, body=r.body.subs(dot, s)) for r in c.reductions))
    read = set().union(*(r.body.free_symbols for r in logits.reductions))
    if read & ({row} | set(c.streams)) or any(x.name in c.vector_inputs for x in read):
        return None  # h, w or another stream (attention's v) read outside the dot product
    try:
        lb = backward(parse(written(logits)), tuple(b.upstream))
    except NoBackward:
        return None
    if not lb.proven or s.name not in lb.gradients or not set(lb.saved) <= set(b.saved):
        return None
    return ThroughLogits(row.name, shared.name, s.name, lb.maps[lb.gradients[s.name][0]], lb,
                         *block_map(lb))


def block_map(lb: Backward) -> tuple[str, str, str]:
    """(spec, first, vocab): the logits' gradient map of ``lb`` over one block of the
    vocabulary, a kernel of its own whose ``i`` and ``N`` are the block's: the position is
    ``i + first`` and the vocabulary's length ``vocab``, two new parameters.  Nothing to
    prove: the same expression at the same values."""
    c = parse(lb.spec)
    taken = set(c.names)
    first = sp.Symbol(fresh("first", taken), integer=True, nonnegative=True)
    vocab = sp.Symbol(fresh("vocab", taken), integer=True, positive=True)
    shifted = {y: e.subs({POSITION: POSITION + first, N: vocab})
               for y, e in c.elementwise.items()}
    text = written(dataclasses.replace(c, params=(*c.params, first, vocab), elementwise=shifted))
    return text, first.name, vocab.name


def _roles(c: Cascade, dot: Dot) -> tuple[sp.Symbol, sp.Symbol] | None:
    """(the per-row vector, the vector stream) of ``dot``, in that order, or None."""
    streams, params = set(c.streams), set(c.params)
    for a, b in (dot.args, dot.args[::-1]):
        if (a in params and b in streams and a.name in c.vector_inputs
                and b.name in c.vector_inputs):
            return a, b
    return None
