"""The ``Emitter``: the statements of a rule's state, update, merge, finalize and
per-element outputs, emitted into the active IRBuilder frame (the loop nests around them
live in ``lowering.cpu.variants`` and ``lowering.cuda.variants``).

The kernel is generated from the rule's state, update, merge and finalize, the same
code path for every cascade.  Per row (rows run in parallel): state registers per
lane, the element update folded over the stream, the lanes combined with the
derived merge, finalize, then the per-element outputs in a second pass.  The split
variant stores each piece's state in a workspace and merges the pieces; the
unfused variant runs one such loop nest per reduction.

What one component does in each of these steps is its family's (``lowering.families``:
a lowering registered per family and backend); the emitter walks the components and asks
``lowering_for``, and holds what the families share (lookups, anchors, re-anchoring).

The laws of ``algebra.components`` are kept: each re-anchored state is held at its
*working* anchors (``algebra.state.working_value``), kept in registers of their
own next to the state, and settled to the true final anchors at finalize with IEEE
arithmetic; an unmoved anchor keeps the state (Select on equality, so -inf - -inf is
never used) and a factor or state that is exactly 0 gives 0 (``_mul0``).
"""

from __future__ import annotations

from contextlib import contextmanager

import sympy as sp

from algebra.cascade import INDEX, LENGTH, carries_feature_axis
from algebra.rule import FusionRule
from algebra.state import guarded_anchors, primed

from ..tvm.ir import LEAVES, T, tirx
from .anchors import AnchorSteps, at
from .families import Element, FamilyLowering, Join, lowering_for
from .fastmath import statement_lets
from .geometry import Geometry, is_one, is_streamed, same_rows
from .invariants import rule_dots, rule_scores, split_invariant, with_scores
from .masks import MaskSteps
from .outputs import OutputSteps
from .plan import Plan
from .registers import Const0, States, working_anchors
from .signature import I64
from .steps import SelectSteps, SettleSteps, all_of, opaque
from .texpr import const, loaded, to_tir


def _mul0(a, b):
    """a * b where an exact 0 on either side gives 0 (0 * inf = 0 * nan = 0).  Operands are
    let-bound as statements: TVM's vectorizer mishandles expression Lets under a Select."""
    zero = const(0)
    a, b = (v if isinstance(v, LEAVES) else T.bind(v) for v in (a, b))
    return tirx.Select(tirx.Or(a == zero, b == zero), zero, a * b)


class Emitter(AnchorSteps, SelectSteps, SettleSteps, MaskSteps, OutputSteps):
    """Emits the statements of one kernel into the active IRBuilder frame.

    ``simd``: the target's vector width in the compute dtype (1 where threads, not vectors,
    carry the parallelism); feature-axis loops are vectorized that wide when no lane loop is
    vectorized around them (a vector loop cannot nest).  ``scratch``: the storage scope of
    the kernel's own registers and caches on this target.  ``rounded``: the target's way to
    round a value on its own (no FMA contraction into what reads it); each score
    (``invariants.rule_scores``; ``scores`` passes a whole rule's to one of its unfused
    stages) is computed through it wherever it is read, so the running max and the
    ``exp(s - m)`` terms see the same rounded s."""

    def __init__(self, rule: FusionRule, geo: Geometry, plan: Plan, bufs: dict, rowvals: dict,
                 simd: int = 1, scratch: str = "local", rounded=None, scores=None,
                 backend: str | None = None, narrowing=None, exp=None):
        self.dot_list = rule_dots(rule)
        rule, self.scores = with_scores(rule, rule_scores(rule) if scores is None else scores)
        self.rule, self.geo, self.plan, self.bufs = rule, geo, plan, bufs
        self.rounded = rounded or (lambda v: v)
        # (storage dtype, lanes) -> the intrinsic that rounds a vector to it, or None
        self.narrowing = narrowing or (lambda dtype, lanes: None)
        self.exp = exp  # the fast exp's builder (None: ``fastmath.fast_exp``)
        # what varies over the feature axis: those values, and the scores that read them
        self.vec = frozenset(geo.vec) | {k for k, e in self.scores.items()
                                         if carries_feature_axis(e, set(geo.vec))}
        self.rowvals = rowvals  # per-row values other than inputs: name -> (buffer, width)
        self.anchor_names = working_anchors(rule)
        self.components, self.aliases = folded(rule)
        self.guarded = guarded_anchors(rule.components)
        # one value per row: parameters and N (divisions by them become hoisted reciprocals)
        self.per_row = frozenset({k for k, g in geo.inputs.items() if is_one(g.length)} |
                                 ({LENGTH} if not geo.static or geo.n else set()))
        self.assumed: dict = {}  # condition -> sympy true/false (``assuming``)
        self.simd, self.scratch = simd, scratch
        self.backend = backend  # which registered family lowerings apply (None: defaults)
        # id(component) -> [(column, buffer, its row index: None for the kernel's row)]
        self.stashed: dict[int, list] = {}
        self.stash_end = 0  # elements [0, stash_end) of each row hold stashed values
        self.stash_anchors: dict = {}  # tile anchor symbol -> the value they were written at
        self.stash_reads: dict = {}  # output -> (buffer, row) its stashed values are read from
        self.slot_simd = simd if plan.lanes == 1 else 1  # lanes > 1: the lane loop is vector
        self.bound_rows: tuple = (None, {})  # (row, input -> its bound row index)

    # Step 1. Reading values ---------------------------------------------------------
    def bind_rows(self, r):
        """Bind each broadcast input's row index once for row ``r``: with shape variables
        it is a floordiv/floormod chain that TVM would otherwise simplify at every access
        (attention on rows (1, H, L): 175 s to compile instead of seconds)."""
        self.bound_rows = (r, {})
        self.bound_rows = (r, {name: T.bind(self.row_of(name, r))
                               for name, g in self.geo.inputs.items()
                               if not same_rows(g.rows, self.geo.rows)})

    def row_of(self, name: str, r):
        g = self.geo.inputs[name]
        if same_rows(g.rows, self.geo.rows):
            return r
        if self.bound_rows[0] is r and name in self.bound_rows[1]:
            return self.bound_rows[1][name]
        idx, inner = tirx.const(0, I64), 1
        for size, stride, own in reversed(list(zip(self.geo.rows, g.strides, g.rows,
                                                   strict=True))):
            if not is_one(own):
                idx = idx + tirx.floormod(tirx.floordiv(r, inner), size) * stride
            inner *= size
        return idx

    def base_lookup(self, r, i=None, slot=0, extra=None):
        """Inputs at row r (stream element i), N, i, per-row values, then ``extra``."""
        extra = extra or {}

        def look(sym):
            if sym in extra:
                return extra[sym]
            name = sym.name
            if name in extra:
                return extra[name]
            if name in self.scores:  # computed where it is read, always the same way
                return self.rounded(self.expr(self.scores[name], look))
            if name in self.geo.inputs:
                g = self.geo.inputs[name]
                at = slot if g.width > 1 else 0
                pos = i if is_streamed(g.length) else 0
                return loaded(self.bufs[name], [self.row_of(name, r), pos, at], self.geo.compute)
            if name in self.rowvals:
                value = self.rowvals[name]
                if isinstance(value, sp.Expr):  # an epilogue: computed where it is read
                    return self.expr(value, look)
                buf, width = value
                return buf[r, slot if width > 1 else 0]
            if name == LENGTH:
                if not self.geo.static:  # a shape variable
                    return tirx.Cast(self.geo.compute, self.geo.n)
                return const(self.geo.n) if self.geo.n else opaque(0.0)
            if name == INDEX:
                return tirx.Cast(self.geo.compute, i)
            raise KeyError(f"no value for `{sym}` while lowering")

        return look

    def expr(self, e: sp.Expr, look):
        if self.assumed:  # conditions known to hold on the block being emitted
            e = e.xreplace(self.assumed)
        with statement_lets(T.bind):
            return to_tir(e, look, self.geo.compute, self.plan.fast_math, self.per_row,
                          self.exp)

    def states(self, lanes: int) -> States:
        """Registers for ``lanes`` lanes, in this target's scratch scope."""
        return States(self.rule, self.geo, lanes, self.scratch)

    def state_lookup(self, st: States, lane, r, slot=0, extra=None):
        vals = {n: st.get(n, lane, slot) for n in st.bufs}
        vals.update({n: vals[twin] for n, twin in self.aliases.items()})
        return self.base_lookup(r, None, slot, {**vals, **(extra or {})})

    # Step 2. One element ------------------------------------------------------------
    def dots(self, r, i):
        """Every dot product of the element, bound once."""
        return {dot: T.bind(self._dot(dot, r, i)) for dot in self.dot_list}

    def _dot(self, dot, r, i):
        """``slot_simd`` partial sums over the feature axis, then a halving tree: a scalar chain
        of D dependent adds would bound attention by the add latency (4 cycles per feature)."""
        d, vector = self.geo.d, self.slot_simd
        width = vector if vector > 1 and d % vector == 0 else 1
        acc = T.alloc_buffer((width,), self.geo.compute, scope=self.scratch)
        with (T.vectorized(0, width) if width > 1 else Const0()) as lane:
            T.buffer_store(acc, const(0), [lane])
        with T.serial(0, d // width) as c:
            with (T.vectorized(0, width) if width > 1 else Const0()) as lane:
                look = self.base_lookup(r, i, c * width + lane)
                T.buffer_store(acc, acc[lane] + self.expr(dot.args[0], look) *
                               self.expr(dot.args[1], look), [lane])
        half = width // 2
        while half >= 1:
            with (T.vectorized(0, half) if half > 1 else Const0()) as lane:
                T.buffer_store(acc, acc[lane] + acc[lane + half], [lane])
            half //= 2
        return acc[0]

    def count_before(self, st: States, lane):
        """The lane's count before this step (None when the rule keeps no count)."""
        return T.bind(st.get(st.count, lane)) if st.count in st.bufs else None

    def update(self, st: States, lane, i, r):
        """Fold element i of row r into the lane: each component by its family's lowering."""
        dots = self.dots(r, i)
        old, moved = self.held(st, lane, self.anchor_names), {}
        count = self.count_before(st, lane)
        if count is not None:
            st.set(st.count, lane, count + const(1))
        step = Element(lane, i, r, dots, old, moved, count)
        for comp in self.components:
            self.lowering(comp).update(self, st, comp, step)
        self.hold(st, lane, moved)

    def tile_step(self, st: States, comp, lane, i, r, dots=None, basis=None):
        """Fold element i into ``comp`` of a tile whose upstream components are complete:
        the anchors are final for the tile (held by ``hold_for``), so A = I and the step is
        the plain update.  ``basis``: (basis, values) precomputed by ``tile_bases``."""
        self.lowering(comp).tile_step(self, st, comp, Element(lane, i, r, dots or {}), basis)

    def merge_select(self, st: States, comp, a, b):
        """Lane a <- the selection of lanes a and b (a tile's best shared between lanes)."""
        self.lowering(comp).merge(self, st, comp, Join(a, b))

    def lowering(self, comp) -> FamilyLowering:
        """The lowering of ``comp``'s family on this emitter's backend."""
        return lowering_for(comp, self.backend)

    def basis_values(self, comp, r, i, anchors, dots, pre=None):
        """slot -> the element's basis values; parts that are the same for every slot of a
        feature vector (attention's exp(s - m)) are bound once, before the slot loop (or
        come precomputed: ``pre`` = (basis, values))."""
        basis, hoisted = pre or self._hoist(comp.basis, self.vec, self.base_lookup(
            r, i, 0, {**dots, **self.row_values(anchors)}))
        return lambda slot: [self.expr(b, self.base_lookup(r, i, slot, {
            **dots, **at(anchors, slot), **hoisted})) for b in basis]

    def _hoist(self, exprs, varying: set, look, per_slot: bool = True):
        """``exprs`` with their largest parts free of ``varying`` names replaced by symbols
        bound here (to their values under ``look``); returns (exprs, symbol -> value)."""
        out, found = split_invariant(exprs, varying, per_slot)
        return out, {sym: T.bind(self.expr(e, look)) for e, sym in found.items()}

    @contextmanager
    def slots(self, width: int):
        """Loop over the slots of a feature vector (or top-k list); vectorized in
        ``slot_simd``-wide chunks when no lane loop is vectorized around it."""
        vector = self.slot_simd
        if width == 1:
            yield 0
        elif vector > 1 and width % vector == 0:
            with T.serial(0, width // vector) as outer:
                with T.vectorized(0, vector) as inner:
                    yield outer * vector + inner
        else:
            with T.serial(0, width) as slot:
                yield slot

    def reanchor_add(self, st, comp, sources, lane_out, new, r, fresh):
        """S_out = sum over sources (lane, anchors) of A(anchors -> new) S_lane [+ fresh]."""
        cols = [c.name for c in comp.columns]
        width = max(st.widths.get(c, 1) for c in cols)
        entries = [self._entries(st, comp, lane, a_old, new, r) for lane, a_old, _ in sources]
        with self.slots(width) as slot:
            new_at = at(new, slot)
            terms = [self._reanchor(st, comp, lane, at(a_old, slot), count, new_at, r, slot, ent)
                     for (lane, a_old, count), ent in zip(sources, entries, strict=True)]
            extra = fresh(slot) if fresh else None
            values = {}
            for k, c in enumerate(cols):
                if c == st.count:
                    continue
                v = terms[0][k]
                for t in terms[1:]:
                    v = v + t[k]
                values[c] = T.bind(v + extra[k] if extra else v)
            for c, v in values.items():
                st.set(c, lane_out, v, slot)

    def _entry_lookup(self, st, comp, lane, a_old: dict, a_new: dict, r, slot):
        """Lookup of the matrix entries: old anchors by name, new ones primed (values)."""
        return self.state_lookup(st, lane, r, slot, {
            **{a.name: a_old[a.name] for a in comp.anchors if a.name in a_old},
            **{primed(a).name: a_new[a.name] for a in comp.anchors if a.name in a_new}})

    def _entries(self, st, comp, lane, a_old, a_new, r) -> dict:
        """Matrix entries that are the same for every slot, bound once before the slot loop
        (an entry reading a feature-vector anchor, old or new, is computed per slot)."""
        look = self._entry_lookup(st, comp, lane, self.row_values(a_old),
                                  self.row_values(a_new), r, 0)
        varying = self.vec | {primed(a).name for a in comp.anchors if a.name in self.vec}
        return {gh: T.bind(self.expr(e, look)) for gh, e in _matrix_items(comp)
                if e != 1 and not ({s.name for s in e.free_symbols} & varying)}

    def _reanchor(self, st, comp, lane, a_old: dict, count, a_new: dict, r, slot, entries):
        """A(a_old -> a_new) S_lane at ``slot`` (anchor values at that slot)."""
        names = [c.name for c in comp.columns]
        look = self._entry_lookup(st, comp, lane, a_old, a_new, r, slot)
        same = all_of([a_old[a.name] == a_new[a.name] for a in comp.anchors])
        out = []
        for g, name in enumerate(names):
            moved = None
            for h, col in enumerate(names):
                entry = comp.matrix[g, h]
                if entry == 0:
                    continue
                s = count if col == st.count else st.get(col, lane, slot)
                value = entries.get((g, h)) if (g, h) in entries else self.expr(entry, look)
                term = s if entry == 1 else _mul0(value, s)
                moved = term if moved is None else moved + term
            keep = st.get(name, lane, slot)
            out.append(moved if same is None else tirx.Select(same, keep, moved))
        return out

    # Step 4. Merge, finalize, outputs -----------------------------------------------
    def merge(self, st: States, a, b, r, aligned: bool = False, tile: bool = False):
        """Lane a <- merge(lane a, lane b).  ``aligned``: the caller guarantees both lanes are
        held at the same working anchors, so re-anchoring is the identity (the proven
        obligation A(a, a) = I) and a sum merges by adding, with no matrix and no exp.
        ``tile``: b is a tile, whose top-k lists were folded straight into a (``direct``)."""
        left, right = self.held(st, a, self.anchor_names), self.held(st, b, self.anchor_names)
        moved = {}
        n_a, n_b = self.count_before(st, a), self.count_before(st, b)
        if n_a is not None:
            st.set(st.count, a, n_a + n_b)
        join = Join(a, b, r, left, right, moved, n_a, n_b, aligned)
        for comp in self.components:
            if tile and self.lowering(comp).direct:
                continue
            self.lowering(comp).merge(self, st, comp, join)
        self.hold(st, a, moved)

    def finalize(self, st: States, r, results: dict):
        """Every result of the rule into its per-row buffer (name -> (buffer, width)), after
        the states settle at the true final anchors (a max/min that folded a NaN is NaN
        first: the anchors read it)."""
        if not self.geo.static:  # N is known when the kernel runs: both, behind a branch
            with T.If(self.geo.n == tirx.const(0, I64)):
                with T.Then():
                    self._finalize_empty(r, results)
                with T.Else():
                    self._finalize_folded(st, r, results)
            return
        if self.geo.n == 0:
            self._finalize_empty(r, results)
            return
        self._finalize_folded(st, r, results)

    def _finalize_folded(self, st: States, r, results: dict):
        self.mark_nans(st)
        for comp in self.components:  # in dependence order: a recomputed value is an anchor
            self.lowering(comp).settle(self, st, comp, r)
        for comp in self.components:
            self.lowering(comp).reselect(self, st, comp, r)
        for name, expr in self.rule.running.items():
            if name not in results:
                continue
            buf, width = results[name]
            with self.slots(width) as slot:  # in buf's dtype (``OutputSteps.store_result``)
                self.store_result(buf, self.expr(expr, self.state_lookup(st, 0, r, slot)),
                                  [r, slot], self.slot_lanes(width))


def folded(rule: FusionRule) -> tuple[list, dict[str, str]]:
    """The components the kernel folds, and the states it reads from a twin instead: a
    selection of values only (``topk(g, k)``, ``max(g)``) whose twin selects the same g, k
    and direction with indices (``argtopk(g, k)``) holds exactly the twin's values, so it is
    not folded a second time.  The twin takes the place of the first selection it stands in
    for: a tile folds its anchors level by level, so ``m = max(x)`` read as
    ``argmax(x)``'s best must still be folded before the sums anchored on it."""
    selects = [c for c in rule.components if c.family.selects]
    twins = {id(c): t for c in selects for t in selects
             if len(c.state) == 1 and len(t.state) == 2 and
             (t.core, t.direction, t.k) == (c.core, c.direction, c.k)}
    aliases = {c.state[0].symbol.name: twins[id(c)].state[0].symbol.name
               for c in selects if id(c) in twins}
    order, placed = [], set()
    for c in rule.components:
        c = twins.get(id(c), c)
        if id(c) not in placed:
            order.append(c)
            placed.add(id(c))
    return order, aliases



def _matrix_items(comp):
    """((row, column), entry) of the non-zero entries of a component's matrix."""
    m = comp.matrix
    return [((g, h), m[g, h]) for g in range(m.rows) for h in range(m.cols) if m[g, h] != 0]
