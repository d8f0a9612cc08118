"""A GEMM micro-kernel for the matrix products of a rule (``lowering.products``).

``Y[row, :] = sum_i a(row, i) * W[i, :]`` for every product, blocked like BLIS:

- rows in blocks of ``plan.mc`` and columns in ``plan.nt`` ranges: each (row block, column
  range) one parallel task; K in blocks of ``plan.kc``;
- per K block, each row of the block is read once: the rest of the cascade (RMSNorm's
  ``sum(x**2)``) folds that piece of the row with its own lanes and tiles (each column
  task a share of the rows: by one task alone, the other waited for it, 2-3% of RMSNorm +
  GEMM 256 x 4096 -> 4096; the piece's state goes to a workspace, the pieces are merged in
  order at the end, as the split variant does), and ``a(row, i)`` (``x``; ``x / r`` in the unfused
  baseline) is packed into the block's A buffer (``mc x kc``, in L2);
- W is packed per (K block, ``plan.nc`` columns) by each row block into ``plan.nr``-wide
  panels (``nc / nr`` panels of ``kc x nr``, contiguous; columns past D are zeros), so the
  micro-kernel reads one contiguous stream and a panel stays in L2 while every micro-kernel
  of the block passes over it.  Packing happens inside the kernel, not once per shape: W is
  an input and may change between calls (a cached copy could be stale), and packing each
  block as it is needed reads W once per row block without a second 64 MB copy in memory
  (few rows, a large W: split the columns rather than the rows, ``plan.nt``);
- the micro-kernel keeps ``mr x nr`` sums in ``mr x nr / LANES`` vector registers, loads
  ``nr / LANES`` vectors of the panel and broadcasts one A value per row for each of the ``kc``
  steps: one load per ``mr`` multiply-adds.  Rows past the block's end repeat its last row
  (the same values stored twice by one task), so there is no row tail;
- the sums live in a workspace of rows x D rounded up to ``nr``; then, rows in parallel,
  each row's results are computed from them and the merged statistics (``y / r``), the
  parts that do not depend on the column (``1 / r``) once per row.
"""

from __future__ import annotations

from collections.abc import Callable

from algebra.cascade import INDEX
from algebra.rule import FusionRule

from ...tvm.ir import T, tirx
from ..emitter import Emitter
from ..geometry import Geometry
from ..invariants import rule_scores, split_invariant
from ..nests import copy_state, workspace
from ..products import Product, products, without
from ..signature import F32, I64
from ..texpr import const, loaded
from .plan import EMITTER_OPTIONS, LANES, CpuPlan, rows_loop


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def check_blocks(plan: CpuPlan) -> None:
    """Refuse a blocking the micro-kernel cannot run: a panel is whole vectors of the host's
    LANES and a packed block whole panels (else columns would be skipped or overlap).

    Examples
    --------
    >>> from redfuser.lowering import CpuPlan
    >>> try:
    ...     check_blocks(CpuPlan("rolling", 1, 1, True, "", mr=4, nr=LANES + 1, kc=8, nc=LANES + 1))
    ... except ValueError as e:
    ...     print(str(e).split(":")[0])
    GEMM blocking
    """
    if plan.nr % LANES or plan.nc % plan.nr:
        raise ValueError(f"GEMM blocking: nr = {plan.nr} must be a multiple of the {LANES} "
                         f"vector lanes and nc = {plan.nc} a multiple of nr")


def rolling(rule: FusionRule, geo: Geometry, plan: CpuPlan, bufs: dict, results: dict,
            elementwise: dict, rowvals: dict, fold: Callable) -> None:
    """The blocked nest of ``rule`` (which has matrix products at ``geo``) into the active
    IRBuilder frame; ``fold`` folds a piece of a row into lanes and merges them
    (``variants._fold``), ``rowvals`` are per-row values of earlier unfused passes.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import build_primfunc, choose, shape_geometry
    >>> rule = redfuser.derive("rmsnorm_gemm")
    >>> geo = shape_geometry(rule, {"x": (12, 256), "w": (256, 64)})
    >>> plan = choose(rule, geo, threads=2)  # the CPU nest of this plan calls rolling
    >>> from redfuser.lowering.cpu.plan import GEMM
    >>> (plan.mr, plan.nr) == (GEMM["mr"][0], GEMM["nr"][0])  # the host's micro-kernel
    True
    >>> f"in T.unroll({plan.mr}):" in build_primfunc(rule, geo, plan).script()
    True
    """
    check_blocks(plan)
    found = products(rule, geo)
    rest = without(rule, found)
    values = {**rowvals, **results}
    scores = rule_scores(rule)  # both emitters compute each score the same way
    em, em_rest = (Emitter(r, geo, plan, bufs, values, scores=scores, **EMITTER_OPTIONS)
                   for r in (rule, rest))
    sums = {p.state: T.alloc_buffer((geo.r, _round_up(geo.d, plan.nr)), F32) for p in found}
    pieces = -(-geo.n // plan.kc)
    work = workspace(rest, geo, geo.r * pieces) if rest.components else None
    tasks = max(plan.nt, 1)
    with rows_loop(geo)(0, -(-geo.r // plan.mc) * tasks) as t:
        b, task = tirx.floordiv(t, tasks), tirx.floormod(t, tasks)
        row0 = T.bind(tirx.Cast(I64, b) * plan.mc)
        rows = T.bind(tirx.min(tirx.const(geo.r, I64) - row0, plan.mc))
        packed_a = [T.alloc_buffer((plan.mc, plan.kc), F32) for _ in found]
        packed_b = T.alloc_buffer((plan.nc // plan.nr, plan.kc, plan.nr), F32)
        with T.serial(0, pieces) as piece:
            k0 = T.bind(tirx.Cast(I64, piece) * plan.kc)
            length = T.bind(tirx.min(tirx.const(geo.n, I64) - k0, plan.kc))
            if work is not None:  # the statistics: once per row, a share by each column task
                share = T.bind(tirx.floordiv(rows + (tasks - 1), tasks))
                with T.serial(task * share, tirx.min(rows, (task + 1) * share)) as j:
                    fold_statistics(em_rest, plan, fold, work, row0 + j, k0, length,
                                (row0 + j) * pieces + piece)
            with T.serial(0, rows) as j:
                for p, a in zip(found, packed_a, strict=True):
                    pack_a(em, p, a, j, row0 + j, k0, length)
            for p, a in zip(found, packed_a, strict=True):
                blocks = Blocks(plan, geo, row0, rows, k0, length, piece == 0)
                blocks.product(bufs[p.weight], a, packed_b, sums[p.state], task)
    with rows_loop(geo)(0, geo.r) as r:
        st = merged_statistics(em_rest, work, r, pieces)
        row_results(em, geo, found, sums, st, r, results)
        em.elementwise(r, elementwise)


def fold_statistics(em: Emitter, plan: CpuPlan, fold: Callable, work: dict, r, k0, length, slot):
    """Fold elements [k0, k0 + length) of row r into the rest of the cascade's state (its
    own lanes and tiles), stored in row ``slot`` of the workspace."""
    st = em.states(2 * plan.lanes)
    for lane in range(plan.lanes):
        st.init(lane)
    fold(em, st, r, k0, length, plan.lanes, plan.tile)
    copy_state(st, work, 0, slot, to_work=True)


def pack_a(em: Emitter, p: Product, a, j, r, k0, length) -> None:
    """a[j, k] = a(row r, element k0 + k) for the piece; the parts of it that are the same
    for every element (``1 / r`` of the unfused baseline) are computed once.  A score
    product (``score_products``) packs its factor of S here, the dot read from its tile."""
    per_element = {INDEX} | set(em.geo.vec) | {
        k for k, g in em.geo.inputs.items() if g.length > 1}
    (factor,), parts = split_invariant([p.row_factor], per_element, per_slot=False)
    hoisted = {sym: T.bind(em.expr(e, em.base_lookup(r))) for e, sym in parts.items()}

    def store(k):
        T.buffer_store(a, em.expr(factor, em.base_lookup(r, k0 + k, 0, hoisted)), [j, k])

    with T.serial(0, tirx.floordiv(length, LANES)) as c:
        with T.vectorized(0, LANES) as lane:
            store(c * LANES + lane)
    with T.serial(tirx.floordiv(length, LANES) * LANES, length) as k:
        store(k)


class Blocks:
    """The column blocks, panels and micro-kernels of one row block and one K piece."""

    def __init__(self, plan: CpuPlan, geo: Geometry, row0, rows, k0, length, first):
        self.plan, self.geo = plan, geo
        self.row0, self.rows, self.k0, self.length, self.first = row0, rows, k0, length, first

    def product(self, w, a, packed_b, sums, task):
        """sums[rows, cols] (+)= a[:, :length] @ W[k0 : k0 + length, cols] (first piece: =),
        cols the column range of ``task``: whole panels, 1/nt of the (padded) columns."""
        plan = self.plan
        width = _round_up(self.geo.d, plan.nr)
        span = _round_up(-(-width // max(plan.nt, 1)), plan.nr)
        lo = T.bind(tirx.Cast(I64, task) * span)
        hi = T.bind(tirx.min(lo + span, width))
        with T.serial(0, tirx.floordiv(hi - lo + plan.nc - 1, plan.nc)) as block:
            c0 = T.bind(lo + tirx.Cast(I64, block) * plan.nc)
            panels = T.bind(tirx.floordiv(tirx.min(hi - c0, plan.nc), plan.nr))
            self._pack_b(w, packed_b, c0, panels)
            with T.serial(0, panels) as p:
                with T.serial(0, tirx.floordiv(self.rows + plan.mr - 1, plan.mr)) as mb:
                    self.micro(a, packed_b, sums, p, c0 + p * plan.nr, mb)

    def _pack_b(self, w, packed, c0, panels):
        """packed[p, k, :] = W[k0 + k, c0 + p * nr : ... + nr]; the panel that crosses D (the
        last) reads a clamped column and stores 0 past D, so no load leaves W."""
        nr, d = self.plan.nr, self.geo.d
        full = T.bind(tirx.max(tirx.min(tirx.floordiv(d - c0, nr), panels), 0))
        with T.serial(0, full) as p:
            with T.serial(0, self.length) as k:
                with T.vectorized(0, nr) as lane:
                    T.buffer_store(packed, loaded(w, [0, self.k0 + k, c0 + p * nr + lane]),
                                   [p, k, lane])
        with T.serial(full, panels) as p:
            with T.serial(0, self.length) as k:
                with T.serial(0, nr) as lane:
                    col = c0 + p * nr + lane
                    inside = loaded(w, [0, self.k0 + k, tirx.min(col, d - 1)])
                    T.buffer_store(packed, tirx.Select(col < d, inside, const(0)), [p, k, lane])

    def micro(self, a, packed, sums, p, col0, mb):
        """mr x nr sums in registers over the piece's k: per k, nr / LANES panel vectors loaded
        and one broadcast A value per row.  Rows past the block's end repeat its last row.
        ``a`` is anything indexed ``[row, k]``: a score tile reads W in place (``score_tiles``)."""
        mr, nr = self.plan.mr, self.plan.nr
        acc = T.alloc_buffer((mr, nr), F32, scope="local")

        def each(body):
            with T.unroll(0, mr) as i:
                local = tirx.min(mb * mr + i, self.rows - 1)
                with T.unroll(0, nr // LANES) as v:
                    with T.vectorized(0, LANES) as lane:
                        body(i, local, v * LANES + lane)

        each(lambda i, local, c: T.buffer_store(
            acc, tirx.Select(self.first, const(0), sums[self.row0 + local, col0 + c]), [i, c]))
        with T.serial(0, self.length) as k:
            each(lambda i, local, c: T.buffer_store(
                acc, acc[i, c] + a[local, k] * packed[p, k, c], [i, c]))
        each(lambda i, local, c: T.buffer_store(sums, acc[i, c],
                                                [self.row0 + local, col0 + c]))


def merged_statistics(em: Emitter, work, r, pieces: int):
    """Row r's statistics: its pieces merged in order, settled at the true anchors (None
    when the cascade is only matrix products)."""
    if work is None:
        return None
    st = em.states(2)
    copy_state(st, work, 0, r * pieces, to_work=False)
    with T.serial(1, pieces) as piece:
        copy_state(st, work, 1, r * pieces + piece, to_work=False)
        em.merge(st, 0, 1, r)
    em.finalize(st, r, {})  # no results here: it settles the anchored states
    return st


def row_results(em: Emitter, geo: Geometry, found, sums, st, r, results: dict) -> None:
    """Each result of row r from the product sums (state name -> anything indexed
    ``[row, column]``) and the statistics (None: only products); the parts that do not
    depend on the column (``1 / r``) are computed once, the columns in vector chunks."""
    names = {p.state for p in found}
    scalars = {em.rule.count.name: const(geo.n)}  # every element is folded at finalize: n = N
    if st is not None:
        scalars.update({n: T.bind(st.get(n, 0)) for n in st.bufs if st.widths[n] == 1})
    for name, (buf, width) in results.items():
        (expr,), parts = split_invariant([em.rule.running[name]], set(geo.vec) | names,
                                         per_slot=False)
        look = em.base_lookup(r, None, 0, scalars)
        hoisted = {**scalars, **{s: T.bind(em.expr(e, look)) for e, s in parts.items()}}

        def store(slot, lanes=1, buf=buf, expr=expr, hoisted=hoisted):
            wide = {n: sums[n][r, slot] for n in names}
            if st is not None:
                wide.update({n: st.get(n, 0, slot) for n in st.bufs if st.widths[n] > 1})
            em.store_result(buf, em.expr(expr, em.base_lookup(r, None, slot,
                                                             {**hoisted, **wide})), [r, slot],
                            lanes)  # in buf's dtype: y in the inputs' (rounded once)

        full = width // LANES * LANES
        with T.serial(0, full // LANES) as c:
            with T.vectorized(0, LANES) as lane:
                store(c * LANES + lane, LANES)
        with T.serial(full, width) as slot:
            store(slot)
