"""Emitter steps for the outputs: the second pass that writes the per-element ones, the
values the statistics pass stashed for them (``algebra.stash``: finished with one
multiply), and the store of a per-row result into its buffer's dtype (a feature-vector
result rounded once, as a per-element output is); mixed into ``emitter.Emitter``."""

from __future__ import annotations

import sympy as sp

from algebra.cascade import INDEX
from algebra.dtypes import COMPUTE
from algebra.functions import Dot
from algebra.stash import tile_anchor

from ..tvm.ir import T, tirx
from .geometry import is_streamed
from .registers import States, working
from .signature import I64
from .texpr import stored

STASHED = sp.Symbol("stash@value")  # a stashed output's value at its element ("@": never a
# user's name)


class OutputSteps:
    # Per-row results --------------------------------------------------------------------
    def store_result(self, buf, value, index: list, lanes: int = 1):
        """``buf[index] = value`` for a per-row result in the compute dtype (int64: an
        index): stored as ``buf`` holds it, a feature-vector result in ``geo.out_dtype``
        rounded once to nearest even (``signature.stored_results``), with the target's
        instruction for a whole vector where ``lanes`` > 1 is the width of the loop
        vectorized around it."""
        if buf.dtype in (self.geo.compute, I64):
            T.buffer_store(buf, value, index)
            return
        T.buffer_store(buf, stored(value, buf.dtype, self._narrowing(lanes)), index)

    def _narrowing(self, lanes: int) -> str | None:
        """The target's instruction that rounds ``lanes`` computed values to
        ``geo.out_dtype`` at once (``Emitter.narrowing``; None: none, or one lane); those
        instructions take float32 vectors, so a float64 kernel rounds portably."""
        if lanes == 1 or self.geo.compute != COMPUTE.name:
            return None
        return self.narrowing(self.geo.out_dtype, lanes)

    def slot_lanes(self, width: int) -> int:
        """The width of the vector loop ``slots(width)`` opens (1: none)."""
        vector = self.slot_simd
        return vector if width > 1 and vector > 1 and width % vector == 0 else 1

    # Stashed per-element outputs (``algebra.stash``) ----------------------------------
    def stash_into(self, outs: dict, end: int, rows: dict | None = None):
        """The statistics pass writes each stashable output's basis value into ``outs[name]``
        for elements [0, ``end``) (the caller folds them all at one set of anchors), or into
        ``rows[name]``, a compute-dtype row buffer (1, N, 1) of the thread, where the output's own
        dtype would round the value before its last multiply."""
        for name, s in self.rule.stashes.items():
            if outs[name].shape[2] == 1:  # a scalar basis value fills a scalar output
                comp = self.rule.components[s.component]
                place = (rows[name], 0) if rows else (outs[name], None)
                self.stashed.setdefault(id(comp), []).append((s.column, *place))
                self.stash_reads[name] = place
        self.stash_end = end if self.stashed else 0

    def keep_stash_anchors(self, st: States):
        """Bind the anchors the stashed values were written at (lane 0's working anchors,
        before anything folded later moves them)."""
        comps = [c for c in self.rule.components if id(c) in self.stashed]
        self.stash_anchors = {tile_anchor(a, self.rule.cascade): T.bind(st.get(working(a.name), 0))
                              for c in comps for a in c.anchors}

    def _per_row(self, expr: sp.Expr, r, varying: frozenset = frozenset(), known=None):
        """``expr`` with its largest element-invariant parts replaced by symbols bound to
        their per-row values (mapped in the returned lookup); ``varying``: more names that
        change with the element, ``known``: more per-row values."""
        per_element = {INDEX} | self.vec | set(self.scores) | set(varying) | {
            k for k, g in self.geo.inputs.items() if is_streamed(g.length)}
        (out,), values = self._hoist([expr], per_element, self.base_lookup(r, extra=known),
                                     per_slot=False)
        return out, values

    def elementwise(self, r, outs: dict, start=0, step: int = 1):
        """Per-element outputs for elements start, start + step, ... (CUDA threads stride);
        with ``simd`` > 1 (step 1) the element loop is vectorized in ``simd``-wide chunks.
        Parts of an output that do not depend on the element (``1/d`` of softmax) are
        computed once per row."""
        for name, expr in self.rule.cascade.elementwise.items():
            first = 0
            if name in self.stash_reads:  # finish the stashed values: one multiply each
                self._outputs(r, outs[name], STASHED * self.rule.stashes[name].factor, 0,
                              self.stash_end, {STASHED: self.stash_reads[name]},
                              self.stash_anchors)
                first = self.stash_end
            self._outputs(r, outs[name], expr, first, self.geo.n, {}, {}, start, step)

    def _outputs(self, r, buf, expr, lo: int, hi: int, reads: dict, known: dict,
                 start=0, step: int = 1):
        """buf[r, i] = expr for elements lo <= i < hi (start, start + step, ... with CUDA's
        strided threads); ``reads``: symbols standing for a buffer's value at the element
        (symbol -> (buffer, its row: None for ``r``)), ``known``: symbols with per-row values."""
        expr, hoisted = self._per_row(expr, r, frozenset(s.name for s in reads), known)
        width, dots = buf.shape[2], sorted(expr.atoms(Dot), key=str)

        def store(i, slot, lanes: int = 1):
            values = {s: b[r if row is None else row, i, slot] for s, (b, row) in reads.items()}
            values |= {d: T.bind(self._dot(d, r, i)) for d in dots}  # a loop over D each
            look = self.base_lookup(r, i, slot, {**hoisted, **values})
            # per-element outputs are stored as ``geo.out_dtype``
            T.buffer_store(buf, stored(self.expr(expr, look), buf.dtype,
                                       self._narrowing(lanes)), [r, i, slot])

        vector = 1 if dots else self.simd  # a dot's own loop cannot sit in a vector lane
        if vector > 1 and width == 1 and step == 1 and (not self.geo.static or
                                                        hi - lo >= vector):
            full = lo + (hi - lo) // vector * vector
            with T.serial(0, (full - lo) // vector) as c:
                with T.vectorized(0, vector) as lane:
                    store(lo + c * vector + lane, 0, vector)
            with T.serial(full, hi) as i:
                store(i, 0)
            return
        count = hi - lo if step == 1 else tirx.ceildiv(hi - start, step)
        with T.serial(0, count) as c:
            i = lo + c if step == 1 else start + c * step
            if width > 1 and vector > 1:
                with T.vectorized(0, width) as slot:
                    store(i, slot)
            else:
                with self.slots(width) as slot:
                    store(i, slot)
