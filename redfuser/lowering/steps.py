"""Emitter steps for selections (max/min/arg/top-k) and for finalize (settling re-anchored
states, the results of an empty stream); mixed into ``emitter.Emitter`` (kept apart to keep
each module readable)."""

from __future__ import annotations

import sympy as sp

from algebra.components import INDEX_SENTINEL, primed
from algebra.rule import empty_results

from ..tvm_adapter import LEAVES, T, tirx
from .fastmath import isfinite, isnan
from .registers import States
from .signature import F32, I64
from .texpr import const


def all_of(conds):
    """The conjunction of ``conds`` (None for none)."""
    out = None
    for c in conds:
        out = c if out is None else tirx.And(out, c)
    return out


class SelectSteps:
    def _better(self, comp, v, j, sv, sj):
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

    def _best(self, comp, a, b):
        """max (or min) that propagates NaN like np.maximum (LLVM's maxnum would drop it)."""
        a, b = (v if isinstance(v, LEAVES) else T.bind(v) for v in (a, b))
        return tirx.Select(self._better(comp, b, None, a, None), b, a)

    def _before_last(self, comp, v, j, sv, sj):
        """(v, j) ranks before the list's last entry (sv, sj), for an element folded after
        every element already in the list (a pass over increasing indices): a tie then never
        wins, so the test is an empty slot, or a NaN or better value against a non-NaN one."""
        gt = (v > sv) if comp.direction > 0 else (v < sv)
        empty = sj == tirx.const(INDEX_SENTINEL, I64)
        return tirx.Or(empty, tirx.And(tirx.Not(isnan(sv)), tirx.Or(isnan(v), gt)))

    def _select_insert(self, st, comp, lane, v, j, ascending: bool = False):
        vname = comp.state[0].symbol.name
        jname = comp.state[1].symbol.name if len(comp.state) > 1 else None
        if comp.k == 1 and jname is None:
            with self.slots(st.widths[vname]) as slot:
                st.set(vname, lane, self._best(comp, st.get(vname, lane, slot), v), slot)
            return
        if comp.k == 1:
            sv, sj = T.bind(st.get(vname, lane)), T.bind(st.get(jname, lane))
            b = self._better(comp, v, j, sv, sj)  # not let-bound: TVM cannot bind boolx16
            st.set(vname, lane, tirx.Select(b, v, sv))
            st.set(jname, lane, tirx.Select(b, j, sj))
            return
        self._insert_k(st, comp, lane, v, j, vname, jname, ascending)

    def _insert_k(self, st, comp, lane, v, j, vname, jname, ascending: bool):
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

        first = self._before_last if ascending and jname else self._better  # the cheap test
        with T.If(first(comp, v, j, old(vname, last), old(jname, last))), T.Then():
            new = {n: T.alloc_buffer((k,), I64 if n == jname else F32, scope=self.scratch)
                   for n in (vname, jname) if n}
            # serial loops: TVM's vectorizer miscompiles this one (every slot got the element)
            # and CUDA has no vector of 8 int64s; LLVM's SLP vectorizer takes them as they are
            with T.serial(0, k) as t:
                prev = tirx.max(t - 1, 0)
                for name, mine in ((vname, v), (jname, j)):
                    if name is None:
                        continue
                    # conditions inline: TVM cannot let-bind a vector of booleans
                    keep = self._better(comp, old(vname, t), old(jname, t), v, j)
                    came = tirx.Or(t == 0, self._better(comp, old(vname, prev),
                                                        old(jname, prev), v, j))
                    T.buffer_store(new[name], tirx.Select(keep, old(name, t), tirx.Select(
                        came, mine, old(name, prev))), [t])
            with T.serial(0, k) as t:
                for name, buf in new.items():
                    st.set(name, lane, buf[t], t)


class SettleSteps:
    def _finalize_empty(self, r, results: dict):
        """An empty stream (N = 0, known when the kernel is built): every reduction is its
        law's identity and the epilogues follow (``algebra.rule.empty_results``), as in the
        reference; no state is read (a settle at an empty max's -inf would give inf * 0)."""
        identities, epilogues = empty_results(self.rule.cascade)
        values = {k: opaque(v) for k, v in identities.items()}
        for name, (buf, width) in results.items():
            expr = epilogues.get(name, sp.Symbol(name))
            with self.slots(width) as slot:
                look = self.base_lookup(r, None, slot, values)
                T.buffer_store(buf, self.expr(expr, look), [r, slot])

    def _settle(self, st: States, comp, r):
        """Move lane 0 of ``comp`` from its working anchors to the true ones with IEEE
        products (exp(-inf - -inf) = NaN as in the reference); where the shift is infinite
        and every column is finite, the highest power of it meeting a non-zero state
        dominates (``components.settle``)."""
        names = [a.name for a in comp.anchors]
        held, true = self.held(st, 0, names), self.running(st, 0, r, names)
        finite = all_of([isfinite(true[a]) for a in names])
        same = all_of([held[a] == true[a] for a in names])
        degree = comp.compiled("degree", comp.shift_degrees)
        cols = [c.name for c in comp.columns]
        # a branch, not a Select: where the anchors did not move (the common case) the
        # settling products and their exp are not computed at all.  A NaN anchor always
        # settles: TVM lowers not(held == true) to an ordered !=, false at NaN
        with T.If(tirx.Or(tirx.Not(same), tirx.Not(finite))), T.Then(), \
                self.slots(max(st.widths.get(c, 1) for c in cols)) as slot:
            look = self.state_lookup(st, 0, r, slot, {
                **held, **{primed(a).name: true[a.name] for a in comp.anchors}})
            columns_finite = all_of([isfinite(st.get(c, 0, slot)) for c in cols])
            ieee = tirx.Or(finite, tirx.Not(columns_finite))  # (same: not in this branch)
            values = {}
            for g, name in enumerate(cols):
                terms = [(degree[(g, h)], T.bind(self.expr(comp.matrix[g, h], look) *
                                                 st.get(col, 0, slot)), st.get(col, 0, slot))
                         for h, col in enumerate(cols) if comp.matrix[g, h] != 0]
                if not comp.counts(g) and terms:
                    values[name] = T.bind(tirx.Select(ieee, _total(terms), _dominant(terms)))
            for name, v in values.items():
                st.set(name, 0, v, slot)



def opaque(value: float):
    """``value`` read back from a local cell: TVM's simplifier folds constants (and lets of
    constants) and stops with "Divide by zero" on x / N at N = 0, where IEEE gives inf or
    NaN; it does not track a buffer's contents."""
    cell = T.alloc_buffer((1,), F32, scope="local")
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
    return _total([(0, p, None) for p in picked])
