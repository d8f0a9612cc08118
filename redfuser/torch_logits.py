"""The backward through the logits (``algebra.backward_logits``) run with torch's GEMMs.

``linear_cross_entropy``'s dh and dw are ``ds @ w`` and ``ds.T @ h``, where ``ds`` is the
derived, proven gradient of the loss with respect to each logit.  The vocabulary is taken
in blocks: each block's logits are recomputed by one GEMM, ``ds`` is computed from them
by the block map's kernel (``ThroughLogits.block``: one pass, no temporaries), and two
GEMMs take it into dh and to the block's dw.  A block holds as many logits as h has
elements, in two buffers every block reuses, so the step's memory stays that of h, w and
their gradients, never rows x V; dh's blocks add in a fixed order, so two runs give the
same bits.
Registered as its own op (``<name>_backward_logits``, with a fake), so
``torch.compile`` traces it as one call whatever the number of blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from algebra.backward_logits import ThroughLogits
from algebra.cascade import POSITION, N

from .kernel import Kernel, compile


@dataclass(frozen=True)
class LogitsBackward:
    """``of`` run as the op ``op``: (h, w, then ``of.reads`` less the position, then whether
    dh and dw are wanted) -> (dh, dw), an empty tensor for one not wanted."""

    of: ThroughLogits
    op: object
    gradients: tuple[str, str]  # the names of h's and w's gradients

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.of.row, self.of.shared, *_per_row(self.of))

    def applies(self, values: dict, needed: set[str]) -> bool:
        """Every needed gradient is dh or dw, and w is one head every row shares."""
        w = values[self.of.shared]
        return needed <= set(self.gradients) and math.prod(w.shape[:-2]) == 1

    def run(self, values: dict, needed: set[str]) -> dict:
        args = [torch.as_tensor(values[n]) for n in self.inputs]
        dh, dw = self.op(*args, self.gradients[0] in needed, self.gradients[1] in needed)
        return {g: t for g, t in zip(self.gradients, (dh, dw), strict=True) if g in needed}


def logits_backward(of: ThroughLogits, name: str, gradients: tuple[str, str],
                    namespace: str, **options) -> LogitsBackward:
    """Register ``<name>_backward_logits`` for ``of`` (module docstring); ``options`` go to
    ``redfuser.compile`` for the block map's kernel."""
    reads = _per_row(of)
    block = compile(of.block, **{**options, "dynamic": True})  # every block width, one build

    def real(h, w, *rest):
        *values, want_h, want_w = rest
        return _blocks(block, of, dict(zip(reads, values, strict=True)), h, w, want_h,
                       want_w)

    def fake(h, w, *rest):
        want_h, want_w = rest[-2:]
        return (torch.empty_like(h) if want_h else h.new_empty(0),
                torch.empty_like(w) if want_w else w.new_empty(0))

    schema = "(Tensor {}, Tensor {}, {}bool want_h, bool want_w) -> (Tensor, Tensor)".format(
        of.row, of.shared, "".join(f"Tensor {n}, " for n in reads))
    op = torch.library.custom_op(f"{namespace}::{name}_backward_logits", real,
                                 mutates_args=(), schema=schema)
    op.register_fake(fake)
    return LogitsBackward(of, op, gradients)


def _per_row(of: ThroughLogits) -> tuple[str, ...]:
    """What ``ds`` reads per row (or as a scalar): not the position and N, which are the
    vocabulary's."""
    return tuple(n for n in of.reads if n not in (POSITION.name, N.name))


def _blocks(block: Kernel, of: ThroughLogits, values: dict, h: torch.Tensor,
            w: torch.Tensor, want_h: bool, want_w: bool) -> tuple[torch.Tensor, ...]:
    """dh and dw over blocks of the vocabulary (the stream), in float32 at least (the
    kernels' compute dtype; float64 in float64), returned in h's and w's
    dtypes as torch's autograd returns gradients.  Blocks of the stream, not of the rows:
    each block's dw rows are written once by a GEMM over every row (k = rows), and dh
    gathers the blocks' ``ds @ w`` as the row kernel sums the stream; chunks of rows would
    instead add into all of dw (V x D) once per chunk."""
    d, acc = h.shape[-1], torch.promote_types(h.dtype, torch.float32)
    rows, hs, ws = h.shape[:-1], h.reshape(-1, d).to(acc), w.reshape(-1, d)
    count, vocab = hs.shape[0], ws.shape[0]
    per_row = {n: v.to(acc).expand(rows).reshape(-1) if v.dim() else v.to(acc)
               for n, v in values.items()}
    dh = torch.zeros(count, d, dtype=acc) if want_h else None
    dw = torch.empty(vocab, d, dtype=acc) if want_w else None
    step = max(1, min(d, vocab))  # a block's logits (rows x step): as many as h has elements
    logits, grads = torch.empty(count * step, dtype=acc), torch.empty(count * step, dtype=acc)
    c = block.rule.cascade
    reads = [v.name for v in (*c.streams, *c.params)]  # vocab only where ds reads N
    for start in range(0, vocab, step):
        wb = ws[start:start + step].to(acc)
        s = logits[:count * len(wb)].view(count, len(wb))
        g = grads[:count * len(wb)].view(count, len(wb))
        torch.mm(hs, wb.T, out=s)
        given = per_row | {of.logits: s, of.first: float(start), of.vocab: float(vocab)}
        block(**{n: given[n] for n in reads}, out={block.rule.cascade.outputs[0]: g})
        if dh is not None:
            dh.addmm_(g, wb)
        if dw is not None:
            torch.mm(g.T, hs, out=dw[start:start + len(wb)])
    return (dh.to(h.dtype).reshape(h.shape) if dh is not None else h.new_empty(0),
            dw.to(w.dtype).reshape(w.shape) if dw is not None else w.new_empty(0))
