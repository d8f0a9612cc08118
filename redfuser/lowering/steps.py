"""Emitter steps for selections (max/min/arg/top-k) and for finalize (settling re-anchored
states, the results of an empty stream); mixed into ``emitter.Emitter`` (kept apart to keep
each module readable)."""

from __future__ import annotations

import math
from contextlib import contextmanager

import sympy as sp

from algebra.cascade import LENGTH
from algebra.rule import empty_results
from algebra.state import INDEX_SENTINEL, primed

from ..tvm.ir import LEAVES, T, tirx
from .anchors import at
from .fastmath import abs_bits, float_bits, isfinite, isnan
from .registers import States, nan_mark, nan_marked
from .signature import I32, I64
from .texpr import compute_dtype, const


def all_of(conds):
    """The conjunction of ``conds`` (None for none)."""
    out = None
    for c in conds:
        out = c if out is None else tirx.And(out, c)
    return out


def any_of(conds):
    """The disjunction of ``conds`` (None for none)."""
    out = None
    for c in conds:
        out = c if out is None else tirx.Or(out, c)
    return out


class SelectSteps:
    def better(self, comp, v, j, sv, sj):
        """(v, j) ranks before (sv, sj): NaN first (NaN wins a selection, as np.max and
        np.argmax), then the better value, then the lower index; an empty slot (index
        sentinel) takes anything.  The same order as algebra.components.rank_order."""
        gt = (v > sv) if comp.direction > 0 else (v < sv)
        if j is None:  # a NaN v wins; a NaN sv stays (v > NaN is false): NaN is sticky
            return tirx.Or(isnan(v), gt)
        nan_v, nan_s = isnan(v), isnan(sv)
        lower = j < sj
        empty = sj == tirx.const(INDEX_SENTINEL, I64)
        by_nan = tirx.And(nan_v, tirx.Or(tirx.Not(nan_s), lower))
        by_value = tirx.And(tirx.Not(nan_s), tirx.Or(gt, tirx.And(v == sv, lower)))
        return tirx.Or(empty, tirx.Or(by_nan, by_value))

    def fold_best(self, st: States, comp, lane, v, slot):
        """A plain max/min: the target's own float max (one operation; it may drop a NaN,
        TVM compiles with NoNaNsFPMath) and the NaN mark, the largest |bits| folded (two
        integer operations; see ``registers``)."""
        name, mark = comp.state[0].symbol.name, nan_mark(comp.state[0].symbol.name)
        v = v if isinstance(v, LEAVES) else T.bind(v)
        st.set(name, lane, _pick(comp)(st.get(name, lane, slot), v), slot)
        st.set(mark, lane, tirx.max(st.get(mark, lane, slot), abs_bits(v)), slot)

    def _before_last(self, comp, v, j, sv, sj):
        """(v, j) ranks before the list's last entry (sv, sj), for an element folded after
        every element already in the list (a pass over increasing indices): a tie then never
        wins, so the test is an empty slot, or a NaN or better value against a non-NaN one."""
        gt = (v > sv) if comp.direction > 0 else (v < sv)
        empty = sj == tirx.const(INDEX_SENTINEL, I64)
        return tirx.Or(empty, tirx.And(tirx.Not(isnan(sv)), tirx.Or(isnan(v), gt)))

    def keep_better(self, st: States, comp, lane, v, j, slot):
        """An argmax/argmin step at ``slot``: (v, j) replaces the lane's (value, index) where
        it ranks before them (``better``)."""
        vname, jname = names_of(comp)
        sv, sj = T.bind(st.get(vname, lane, slot)), T.bind(st.get(jname, lane, slot))
        b = self.better(comp, v, j, sv, sj)  # not let-bound: TVM cannot bind boolx16
        st.set(vname, lane, tirx.Select(b, v, sv), slot)
        st.set(jname, lane, tirx.Select(b, j, sj), slot)

    def insert_k(self, st, comp, lane, v, j, vname, jname, ascending: bool):
        """Insert (v, j) into a sorted top-k list.  Most elements do not rank before the last
        slot and are refused by that one test; for the rest, the slots that rank before the
        element form a prefix (the list is sorted), so every slot t at once keeps its entry,
        takes the element, or takes slot t - 1's: no loop-carried dependence, no branch.
        ``ascending``: j is above every index in the list (``_before_last``)."""
        k, last = comp.k, comp.k - 1
        v = v if isinstance(v, LEAVES) else T.bind(v)
        j = (j if isinstance(j, LEAVES) else T.bind(j)) if jname else None

        def old(name, t):
            return st.get(name, lane, t) if name else None

        first = self._before_last if ascending and jname else self.better  # the cheap test
        with T.If(first(comp, v, j, old(vname, last), old(jname, last))), T.Then():
            new = {n: T.alloc_buffer((k,), I64 if n == jname else self.geo.compute,
                                     scope=self.scratch)
                   for n in (vname, jname) if n}
            # serial loops: TVM's vectorizer miscompiles this one (every slot got the element)
            # and CUDA has no vector of 8 int64s; LLVM's SLP vectorizer takes them as they are
            with T.serial(0, k) as t:
                prev = tirx.max(t - 1, 0)
                for name, mine in ((vname, v), (jname, j)):
                    if name is None:
                        continue
                    # conditions inline: TVM cannot let-bind a vector of booleans
                    keep = self.better(comp, old(vname, t), old(jname, t), v, j)
                    came = tirx.Or(t == 0, self.better(comp, old(vname, prev),
                                                        old(jname, prev), v, j))
                    T.buffer_store(new[name], tirx.Select(keep, old(name, t), tirx.Select(
                        came, mine, old(name, prev))), [t])
            with T.serial(0, k) as t:
                for name, buf in new.items():
                    st.set(name, lane, buf[t], t)

    def mark_nans(self, st: States):
        """Finalize of the plain max/min states: NaN where a NaN was folded (NaN wins a
        selection, as in np.max)."""
        inf = float_bits(self.geo.compute)
        for name in nan_marked(self.rule):
            with self.slots(st.widths[name]) as slot:
                st.set(name, 0, tirx.Select(st.get(nan_mark(name), 0, slot) > inf.of(inf.inf),
                                            const(float("nan")), st.get(name, 0, slot)), slot)

    def reselect(self, st: States, comp, r):
        """Finalize of an anchored selection (``SelectComponent.reselect``): where a final
        anchor is not finite, or a ``flat_factors`` entry of dF/du is 0 or not finite
        there, F(g, a) is flat or NaN in g (exp(x - NaN), (inf - inf)**3, 0 * -inf),
        so the selection is made again over the body itself, element by element (a second
        pass, only in such rows).  The value state becomes the core g at the elements
        chosen (F of it is the body there: the reference's value) where an anchored
        selection reads it, the index state their indices."""
        names = [a.name for a in comp.anchors]
        true = self.running(st, 0, r, names)
        flat = T.alloc_buffer((1,), I32, scope=self.scratch)
        T.buffer_store(flat, tirx.const(0, I32), [0])
        for a in names:
            with T.serial(0, self.geo.width(a)) as slot:  # serial: an or over the slots
                T.buffer_store(flat, tirx.bitwise_or(flat[0], tirx.Select(
                    isfinite(true[a](slot)), tirx.const(0, I32), tirx.const(1, I32))), [0])
        for factor in comp.flat_factors:  # F flat at a finite anchor: 0 * -inf is NaN
            width = max(self.geo.width(v.name) for v in factor.free_symbols)
            with T.serial(0, width) as slot:
                f = T.bind(self.expr(factor, self.base_lookup(r, None, slot, at(true, slot))))
                sharp = tirx.And(isfinite(f), f != const(0))
                T.buffer_store(flat, tirx.bitwise_or(flat[0], tirx.Select(
                    sharp, tirx.const(0, I32), tirx.const(1, I32))), [0])
        vname, jname = names_of(comp)
        width = st.widths[vname]
        with T.If(flat[0] != tirx.const(0, I32)), T.Then():
            best = _List(width, self.scratch, comp.direction, self.geo.compute)  # its own

            def body(i, slot):
                look = self.base_lookup(r, i, slot, {**self.dots(r, i), **at(true, slot)})
                return self.expr(comp.reduction.body, look), tirx.Cast(I64, i)

            with T.serial(0, self.geo.n) as i:
                if comp.k == 1:
                    with self.slots(width) as slot:
                        v, j = body(i, slot)
                        sv, sj = T.bind(best.get("v", 0, slot)), T.bind(best.get("j", 0, slot))
                        b = self.better(comp, v, j, sv, sj)
                        best.set("v", 0, tirx.Select(b, v, sv), slot)
                        best.set("j", 0, tirx.Select(b, j, sj), slot)
                else:
                    self.insert_k(best, comp, 0, *body(i, 0), "v", "j", ascending=True)
            with T.serial(0, width) as t:  # serial: the core is read at chosen elements
                j, slot = best.get("j", 0, t), t if comp.k == 1 else 0
                look = self.base_lookup(r, j, slot, {**self.dots(r, j), **at(true, slot)})
                if self._value_reselected(comp):
                    st.set(vname, 0, self.expr(comp.core, look), t)
                if jname:
                    st.set(jname, 0, j, t)

    def _value_reselected(self, comp) -> bool:
        """Whether the value state of ``comp`` is read as an anchored selection's result:
        its own, or a value selection's it stands in for (``emitter.folded``); an unanchored
        one (``m = max(x)`` read from ``argmax(x - m)``) keeps its value."""
        vname = comp.state[0].symbol.name
        readers = [c for c in self.rule.components if len(c.state) == 1 and (
            c is comp or self.aliases.get(c.state[0].symbol.name) == vname)]
        return any(c.anchors for c in readers)

    def recompute(self, st: States, comp, r):
        """Where a final anchor or a state of the re-anchored sum ``comp`` is not finite,
        its value (its first column) is folded again from the row as written, at the final
        anchors (a second pass, only in such rows).  The one-pass algebra is exact over
        the reals; IEEE infinities in its columns or anchors cancel otherwise than the
        element-wise terms do: inf - inf in a power sum where (inf - r)**3 is inf, and
        r * sum(x) where sum(r * x) at r = inf is NaN over elements of both signs."""
        names = [a.name for a in comp.anchors]
        true = self.running(st, 0, r, names)
        free = [g for g in range(len(comp.columns)) if not comp.counts(g)]  # not the count
        cols = [comp.columns[g].name for g in free]
        wild = T.alloc_buffer((1,), I32, scope=self.scratch)
        T.buffer_store(wild, tirx.const(0, I32), [0])
        for values in [{a: true[a] for a in names},
                       {c: (lambda slot, c=c: st.get(c, 0, slot)) for c in cols}]:
            for name, value in values.items():
                width = self.geo.width(name) if name in names else st.widths[name]
                with T.serial(0, width) as slot:  # serial: an or over the slots
                    T.buffer_store(wild, tirx.bitwise_or(wild[0], tirx.Select(
                        isfinite(value(slot)), tirx.const(0, I32), tirx.const(1, I32))), [0])
        total = cols[0]
        with T.If(wild[0] != tirx.const(0, I32)), T.Then():
            with self.slots(st.widths[total]) as slot:
                st.set(total, 0, const(0), slot)
            with T.serial(0, self.geo.n) as i:
                dots = self.dots(r, i)
                with self.slots(st.widths[total]) as slot:
                    # the column's own basis, not the body: an anchor-only factor of the
                    # body (o = sum(v * r0): r0) is applied at finalize, after this
                    term = self.expr(comp.basis[free[0]],
                                     self.base_lookup(r, i, slot, {**dots, **at(true, slot)}))
                    st.set(total, 0, st.get(total, 0, slot) + term, slot)


class _List:
    """A selection's values and indices in registers of their own (``States``' interface),
    every slot empty at first: the index sentinel (an empty slot takes anything) and the
    worst value, so that an empty slot never ranks before an element either (``better``
    compares the values first: an empty 0 kept a later -inf out of a top-k list)."""

    def __init__(self, width: int, scope: str, direction: int, dtype: str):
        self.widths = {"v": width, "j": width}
        self.bufs = {"v": T.alloc_buffer((1, width), dtype, scope=scope),
                     "j": T.alloc_buffer((1, width), I64, scope=scope)}
        with T.serial(0, width) as t:
            T.buffer_store(self.bufs["v"], const(-math.inf * direction), [0, t])
            T.buffer_store(self.bufs["j"], tirx.const(INDEX_SENTINEL, I64), [0, t])

    def get(self, name, lane, slot=0):
        return self.bufs[name][lane, slot]

    def set(self, name, lane, value, slot=0):
        T.buffer_store(self.bufs[name], value, [lane, slot])


def names_of(comp) -> tuple[str, str | None]:
    """A selection's value state and its index state (None for value-only)."""
    return comp.state[0].symbol.name, comp.state[1].symbol.name if len(comp.state) > 1 else None


def _pick(comp):
    return tirx.max if comp.direction > 0 else tirx.min


class SettleSteps:
    def _finalize_empty(self, r, results: dict):
        """An empty stream (N = 0, known when the kernel is built): every reduction is its
        law's identity and the epilogues follow (``algebra.rule.empty_results``), as in the
        reference; no state is read (a settle at an empty max's -inf would give inf * 0)."""
        identities, epilogues = empty_results(self.rule.cascade)
        # N is 0 (opaque: a symbolic N known to be 0 on this branch would be folded into
        # a division by a constant 0, which TVM's analyzer refuses)
        values = {LENGTH: opaque(0.0), **{k: opaque(v) for k, v in identities.items()}}
        for name, (buf, width) in results.items():
            expr = epilogues.get(name, sp.Symbol(name))
            with self.slots(width) as slot:
                look = self.base_lookup(r, None, slot, values)
                # an arg-reduction of nothing has no index (a call refuses it; a Relax
                # module with a symbolic N of 0 gets "no index", not int64(-inf))
                value = tirx.const(INDEX_SENTINEL, I64) if buf.dtype == I64 else \
                    self.expr(expr, look)
                # rounded portably: TVM's vectorizer left a vector instruction's operand
                # scalar here (values read from cells), which LLVM refuses
                self.store_result(buf, value, [r, slot])

    def settle(self, st: States, comp, r):
        """Move lane 0 of ``comp`` from its working anchors to the true ones with IEEE
        products (exp(-inf - -inf) = NaN as in the reference); where the shift is infinite
        and every column is finite, the highest power of it meeting a non-zero state
        dominates (``components.settle``)."""
        names = [a.name for a in comp.anchors]
        held_at, true_at = self.held(st, 0, names), self.running(st, 0, r, names)
        degree = comp.compiled("degree", comp.shift_degrees)
        cols = [c.name for c in comp.columns]
        # a branch, not a Select: where the anchors did not move (the common case) the
        # settling products and their exp are not computed at all (a NaN anchor always
        # settles: TVM lowers not(held == true) to an ordered !=, false at NaN).
        # Feature-vector anchors move slot by slot: a Select per slot instead.
        per_row = all(self._row_anchor(a) for a in names)
        with _unless_settled(at(held_at, 0), at(true_at, 0), per_row), \
                self.slots(max(st.widths.get(c, 1) for c in cols)) as slot:
            held, true = at(held_at, slot), at(true_at, slot)
            finite = all_of([isfinite(true[a]) for a in names])
            same = all_of([held[a] == true[a] for a in names])
            look = self.state_lookup(st, 0, r, slot, {
                **held, **{primed(a).name: true[a.name] for a in comp.anchors}})
            values = {}
            for g, name in enumerate(cols):
                terms = [(degree[(g, h)], T.bind(self.expr(comp.matrix[g, h], look) *
                                                 st.get(col, 0, slot)), st.get(col, 0, slot))
                         for h, col in enumerate(cols) if comp.matrix[g, h] != 0]
                if not comp.counts(g) and terms:
                    # (an unmoved anchor is finite: the held one is a working value)
                    values[name] = T.bind(tirx.Select(finite, _total(terms), _dominant(terms)))
            for name, v in values.items():
                st.set(name, 0, v if per_row else tirx.Select(same, st.get(name, 0, slot), v),
                       slot)


@contextmanager
def _unless_settled(held: dict, true: dict, branch: bool):
    """The body only where some anchor moved or is not finite (``branch``), else always."""
    if not branch:
        yield
        return
    moved = tirx.Not(all_of([held[a] == true[a] for a in held]))
    with T.If(tirx.Or(moved, tirx.Not(all_of([isfinite(v) for v in true.values()])))), \
            T.Then():
        yield



def opaque(value: float):
    """``value`` read back from a local cell: TVM's simplifier folds constants (and lets of
    constants) and stops with "Divide by zero" on x / N at N = 0, where IEEE gives inf or
    NaN; it does not track a buffer's contents."""
    cell = T.alloc_buffer((1,), compute_dtype(), scope="local")
    T.buffer_store(cell, const(value), [0])
    return cell[0]


def _total(terms):
    out = terms[0][1]
    for _, t, _ in terms[1:]:
        out = out + t
    return out


def _dominant(terms):
    """Sum of the terms of the highest shift degree among those with a non-zero state
    (degree <= 0: all of them, IEEE)."""
    top = tirx.const(-1, "int32")
    for d, _, s in terms:
        top = tirx.max(top, tirx.Select(s != const(0), tirx.const(d, "int32"),
                                         tirx.const(-1, "int32")))
    top = T.bind(top)
    picked = [tirx.Select(tirx.Or(top <= tirx.const(0, "int32"),
                                  tirx.And(s != const(0), top == tirx.const(d, "int32"))),
                          t, const(0)) for d, t, s in terms]
    # a state that is not finite: the IEEE sum of every term (``components._wild``)
    wild = any_of([tirx.Not(isfinite(s)) for _, _, s in terms])
    return tirx.Select(wild, _total(terms), _total([(0, p, None) for p in picked]))
