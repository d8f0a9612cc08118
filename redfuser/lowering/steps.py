"""Emitter steps for selections (max/min/arg/top-k) and for settling re-anchored states at
finalize; mixed into ``emitter.Emitter`` (kept apart to keep each module readable)."""

from __future__ import annotations

from algebra.components import COUNT, INDEX_SENTINEL, primed

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

    def _select_insert(self, st, comp, lane, v, j):
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
        cur_v = T.alloc_buffer((1,), F32, scope=self.scratch)
        cur_j = T.alloc_buffer((1,), I64, scope=self.scratch)
        T.buffer_store(cur_v, v, [0])
        T.buffer_store(cur_j, j if jname else tirx.const(0, I64), [0])
        with T.serial(0, comp.k) as t:
            sj = st.get(jname, lane, t) if jname else None
            with T.If(self._better(comp, cur_v[0], cur_j[0] if jname else None,
                                   st.get(vname, lane, t), sj)):
                with T.Then():
                    tv = T.bind(st.get(vname, lane, t))
                    st.set(vname, lane, cur_v[0], t)
                    T.buffer_store(cur_v, tv, [0])
                    if jname:
                        tj = T.bind(sj)
                        st.set(jname, lane, cur_j[0], t)
                        T.buffer_store(cur_j, tj, [0])



class SettleSteps:
    def _settle(self, st: States, comp, r):
        """Move lane 0 of ``comp`` from its working anchors to the true ones with IEEE
        products (exp(-inf - -inf) = NaN as in the reference); where the shift is infinite,
        the highest power of it meeting a non-zero state dominates (``components.settle``)."""
        names = [a.name for a in comp.anchors]
        held, true = self.held(st, 0, names), self.running(st, 0, r, names)
        finite = all_of([isfinite(true[a]) for a in names])
        same = all_of([held[a] == true[a] for a in names])
        degree = comp.compiled("degree", comp.shift_degrees)
        cols = [c.name for c in comp.columns]
        # a branch, not a Select: where the anchors did not move (the common case) the
        # settling products and their exp are not computed at all
        with T.If(tirx.Not(same)), T.Then(), \
                self.slots(max(st.widths.get(c, 1) for c in cols)) as slot:
            look = self.state_lookup(st, 0, r, slot, {
                **held, **{primed(a).name: true[a.name] for a in comp.anchors}})
            values = {}
            for g, name in enumerate(cols):
                terms = [(degree[(g, h)], T.bind(self.expr(comp.matrix[g, h], look) *
                                                 st.get(col, 0, slot)), st.get(col, 0, slot))
                         for h, col in enumerate(cols) if comp.matrix[g, h] != 0]
                if name != COUNT.name and terms:
                    values[name] = T.bind(tirx.Select(tirx.Or(same, finite), _total(terms),
                                                      _dominant(terms)))
            for name, v in values.items():
                st.set(name, 0, v, slot)



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
