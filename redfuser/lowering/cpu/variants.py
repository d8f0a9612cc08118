"""The CPU variants as loop nests around the ``Emitter`` steps.

- rolling: rows in parallel; per row, lanes fold interleaved elements, then merge.
- split: (row, piece) pairs in parallel, each piece's state to a workspace; then per
  row the pieces are merged (flash-decoding).
- unfused: one rolling loop nest per reduction (each reading the final values of
  the earlier ones), the baseline that shows what fusion buys.
- resident: a staged rule (``algebra.stages``): rows in parallel; per row, each stage's
  one-pass fold in turn (each reading the earlier stages' finals), then the per-element
  outputs, so the later passes find the row in cache (``lowering.staged``).

A rolling nest (fused, or one unfused pass) whose rule holds matrix products runs as a
blocked GEMM (``gemm.py``) when its plan says so (``plan.mr``).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

from algebra.stash import tile_anchor

from ...tvm.ir import T, tirx
from ...tvm.target import default_threads
from ..emitter import Emitter
from ..geometry import Geometry, InputGeom
from ..invariants import rule_scores
from ..nests import copy_state, epilogue_values, store_results, unfused_passes, workspace
from ..products import products
from ..registers import Const0, States
from ..signature import I64, result_dtype, result_width
from ..steps import all_of
from . import gemm, score_products, score_tiles, tile_gemm, tiles
from .plan import (
    REGISTER_SCOPE,
    CpuPlan,
    emitter_options,
    lane_aligned,
    micro_kernels,
    one_thread,
    rows_loop,
    stage_plan,
    stash_applies,
    stash_rows,
    vector_lanes,
)
from .resident import row_stashes
from .scores import score_dot, score_product


def _emitter(rule, geo, plan, bufs, rowvals, scores=None) -> Emitter:
    return Emitter(rule, geo, plan, bufs, rowvals, scores=scores, **emitter_options(geo))


def _fold(em: Emitter, st: States, r, start, length, lanes: int, tile: int = 1):
    """Fold elements [start, start + length) into lanes 0..lanes-1, then merge them into 0.

    With tile > 1, whole tiles of lanes x tile elements are folded level by level at
    the tile's own final anchors (one exp per element instead of two for softmax; one
    rescale of attention's D-vector per tile of keys instead of per key) and merged into
    the running lanes; the rest goes element by element."""
    step = lanes * tile
    if step == 1:
        with T.serial(0, length) as t:
            em.update(st, 0, start + t, r)
        return
    aligned = tile > 1 and lanes > 1 and lane_aligned(em.rule)
    known = length.value if isinstance(length, tirx.IntImm) else None  # a static length
    first = 0
    if tile > 1 and known is not None and known >= step:
        tiles.tile(em, st, r, start, lanes, tile, aligned, first=True)
        first = 1  # a whole tile: peel it (no merge into the identity)
    if known is None or known // step > first:  # loops known to be empty are not emitted
        with T.serial(first, tirx.floordiv(length, step)) as c:  # (LLVM compiles them)
            base = start + c * step
            if tile > 1:
                tiles.tile(em, st, r, base, lanes, tile, aligned)
            else:
                with T.vectorized(0, lanes) as lane:
                    em.update(st, lane, base + lane, r)
    if tile > 1 and lanes > 1 and not em.geo.static:
        _lane_chunks(em, st, r, start + tirx.floordiv(length, step) * step,
                     tirx.floordiv(tirx.floormod(length, step), lanes), lanes)
        aligned = False  # the chunks moved each lane's anchors on its own
    half = lanes // 2
    while half >= 1:  # a tree: log2(lanes) dependent merges, each vectorized over half
        with (T.vectorized(0, half) if half > 1 else Const0()) as lane:
            em.merge(st, lane, lane + half, r, aligned)
        half //= 2
    if em.stash_end:
        em.keep_stash_anchors(st)
    # the tail after the lanes merged: it moves lane 0's anchors, which would unalign them
    if known is None or known % step:
        done = tirx.floordiv(length, step) * step
        if tile > 1 and lanes > 1 and not em.geo.static:
            done = length - tirx.floormod(length, lanes)
        with T.serial(done, length) as t:
            em.update(st, 0, start + t, r)


def _lane_chunks(em: Emitter, st: States, r, start, chunks, lanes: int):
    """A symbolic N's remainder after the whole tiles, ``chunks`` x ``lanes`` elements from
    ``start``, folded ``lanes`` wide element by element (a tile fitted to the row is not
    possible: the tile is fixed when N is not known)."""
    with T.serial(0, chunks) as c:
        with T.vectorized(0, lanes) as lane:
            em.update(st, lane, start + c * lanes + lane, r)


def rolling(rule, geo, plan, bufs, results, elementwise, rowvals=None, scores=None):
    if plan.mr and not micro_kernels(geo):
        raise ValueError(f"plan {plan}: the GEMM micro-kernel and score tiles (mr = "
                         f"{plan.mr}) compute float32 (packed float32 panels, AVX FMA "
                         f"blocking); this kernel computes {geo.compute}: use a plan "
                         "without mr (the policy's), or compute_dtype='float32'")
    if plan.tile_dot:  # the products on tile dot products (``tile_dots``)
        return tile_gemm.rolling(rule, geo, plan, bufs, results, elementwise,
                                 rowvals or {}, _fold)
    if plan.mr and products(rule, geo):
        return gemm.rolling(rule, geo, plan, bufs, results, elementwise, rowvals or {}, _fold)
    if plan.mr and score_product(rule, geo):  # f(dot) times its stream matrix: two GEMMs
        return score_products.rolling(rule, geo, plan, bufs, results, elementwise,
                                      rowvals or {}, scores)
    if plan.mr and score_dot(rule, geo):  # a dot against a shared stream matrix: S tiles
        return score_tiles.rolling(rule, geo, plan, bufs, results, elementwise, rowvals or {},
                                   _fold, scores)
    em = _emitter(rule, geo, plan, bufs, {**(rowvals or {}), **results}, scores)
    if plan.row_block > 1:
        return _rolling_blocks(em, geo, plan, results, elementwise)
    stash = bool(elementwise) and stash_applies(rule, geo, plan)
    with _stash_rows(geo, rule.stashes if stash and stash_rows(geo) else {}) as (r, rows):
        if stash:  # into the outputs, or the thread's compute-dtype rows
            em.stash_into(elementwise, plan.lanes * plan.tile, rows)
        if not geo.static:
            em.bind_rows(r)
        st = em.states(2 * plan.lanes)
        for lane in range(plan.lanes):
            st.init(lane)
        _fold(em, st, r, tirx.const(0, I64), _extent(geo.n), plan.lanes, plan.tile)
        em.finalize(st, r, results)
        em.elementwise(r, elementwise)


@contextmanager
def _stash_rows(geo: Geometry, stashes: dict):
    """The rolling loop over rows; with ``stashes`` (outputs stashed in compute-dtype rows,
    ``plan.stash_rows``) a thread's rows share one (1, N, 1) buffer per output.
    Yields (row, output -> its row buffer)."""
    if not stashes:
        with rows_loop(geo)(0, geo.r) as r:
            yield r, {}
        return
    scratch = lambda: {name: T.alloc_buffer((1, geo.n, 1), geo.compute,  # noqa: E731
                                            scope=REGISTER_SCOPE) for name in stashes}
    with _thread_rows(geo, scratch) as (r, rows):
        yield r, rows


def _extent(n):
    """N as an int64 TIR value: a constant, or the shape variable itself."""
    return tirx.const(n, I64) if isinstance(n, int) else n


def _rolling_blocks(em: Emitter, geo: Geometry, plan: CpuPlan, results, elementwise):
    """Blocks of ``plan.row_block`` rows in parallel; each tile is folded for every row of
    the block at once (``tiles.tile_rows``).  The last block repeats the last row where the
    rows do not divide evenly (same values written twice by one thread)."""
    size, block = plan.tile, plan.row_block
    with rows_loop(geo)(0, -(-geo.r // block)) as b:
        rows = [T.bind(tirx.min(b * block + j, geo.r - 1)) for j in range(block)]
        sts = [em.states(2) for _ in rows]
        for st in sts:
            st.init(0)
        with T.serial(0, geo.n // size) as c:
            tiles.tile_rows(em, sts, rows, c * size, size)
        with T.serial(geo.n // size * size, geo.n) as t:
            for st, r in zip(sts, rows, strict=True):
                em.update(st, 0, t, r)
        for st, r in zip(sts, rows, strict=True):
            em.finalize(st, r, results)
            em.elementwise(r, elementwise)


def split(rule, geo, plan, bufs, results, elementwise):
    em = _emitter(rule, geo, plan, bufs, results)
    s, chunk = plan.splits, -(-geo.n // plan.splits)
    work = workspace(rule, geo, geo.r * s)
    with rows_loop(geo)(0, geo.r * s) as rs:
        r, piece = tirx.floordiv(rs, s), tirx.floormod(rs, s)
        st = em.states(2 * plan.lanes)
        for lane in range(plan.lanes):
            st.init(lane)
        start = piece * chunk
        length = tirx.max(tirx.min(tirx.const(geo.n, I64) - start, chunk), 0)
        _fold(em, st, r, start, length, plan.lanes, plan.tile)
        copy_state(st, work, 0, rs, to_work=True)
    with rows_loop(geo)(0, geo.r) as r:
        st = em.states(2)
        copy_state(st, work, 0, r * s, to_work=False)
        with T.serial(1, s) as piece:
            copy_state(st, work, 1, r * s + piece, to_work=False)
            em.merge(st, 0, 1, r)
        em.finalize(st, r, results)
        em.elementwise(r, elementwise)


def unfused(rule, geo, plan, bufs, results, elementwise):
    """One loop nest per reduction; epilogues and per-element outputs in a last one.  Every
    pass computes the whole rule's scores the same way (the max's pass and the exp's)."""
    done, scores = {}, rule_scores(rule)
    for one_pass, result, rowvals in unfused_passes(rule, geo):
        done.update(result)
        lanes = plan.lanes if vector_lanes(one_pass, geo) > 1 else 1
        blocks = plan.row_block if lanes == 1 else 1
        rolling(one_pass, geo, dataclasses.replace(plan, lanes=lanes, row_block=blocks), bufs,
                result, {}, rowvals=rowvals, scores=scores)
    em = _emitter(rule, geo, plan, bufs, epilogue_values(rule, done))
    with rows_loop(geo)(0, geo.r) as r:
        if not geo.static:
            em.bind_rows(r)
        store_results(em, r, results)
        em.elementwise(r, elementwise)


def resident(rule, geo, plan, bufs, results, elementwise):
    """Every stage of a staged rule over one row before the next row: each stage folds in
    its own lanes and tiles, its results go to per-row buffers (the user's outputs, or
    scratch for what only later stages read) that the later stages read as parameters.
    With a row stash (``plan.row_stashes``) the writer stage also stores a costly basis
    value of each element in a row buffer of its thread, and where it wrote them all at the
    row's final anchors the reader folds its rewritten rule over that buffer instead of
    computing them again (threshold_mass: one exp per element instead of two)."""
    scores, rowvals, passes = rule_scores(rule), {}, []
    for stage in rule.staged.stages:
        mine = {}
        for name in stage.results:
            width = result_width(rule, geo, name)
            mine[name] = results.get(name) or (T.alloc_buffer(
                (geo.r, width), result_dtype(rule, name, geo.compute)), width)
        em = _emitter(stage.rule, geo, stage_plan(stage.rule, geo, plan), bufs,
                      {**rowvals, **mine}, scores)
        passes.append((em, mine))
        rowvals.update(mine)
    stashes = row_stashes(rule, geo)
    scratch = lambda: [T.alloc_buffer((1, geo.n, 1), geo.compute,  # noqa: E731
                                      scope=REGISTER_SCOPE) for _ in stashes]
    with _thread_rows(geo, scratch) as (r, rows):
        readers = {}  # reader stage -> (its emitter over the stash, the row's condition)
        if not geo.static:
            for em, _ in passes:
                em.bind_rows(r)
        for k, (em, mine) in enumerate(passes):
            writes = [(s, _stash_row(em, s, buf)) for s, buf in zip(stashes, rows, strict=True)
                      if s.writer == k]
            last = elementwise if k == len(passes) - 1 else {}
            if k in readers:
                em_s, cond = readers[k]
                with T.If(cond):
                    with T.Then():
                        _stage_row(em_s, r, mine, last)
                    with T.Else():
                        _stage_row(em, r, mine, last)
            else:
                _stage_row(em, r, mine, last)
            for s, buf in writes:
                readers[s.reader] = _stash_reader(em, s, buf, r, mine, passes[s.reader][0])


def _stage_row(em: Emitter, r, mine: dict, elementwise: dict):
    """One stage's pass over row ``r``: fold, finalize into ``mine``, per-element outputs."""
    st = em.states(2 * em.plan.lanes)
    for lane in range(em.plan.lanes):
        st.init(lane)
    _fold(em, st, r, tirx.const(0, I64), _extent(em.geo.n), em.plan.lanes, em.plan.tile)
    em.finalize(st, r, mine)
    em.elementwise(r, elementwise)


@contextmanager
def _thread_rows(geo: Geometry, scratch):
    """The rows in one parallel task per thread, each a serial loop over its share; yields
    (row, what ``scratch()`` allocated once per task before the loop).  An allocation over
    1 KB inside the row loop is a heap workspace call per row (threshold_mass's row stash,
    512 x 2048: 0.29 ms allocated per row, 0.27 ms allocated per thread)."""
    if one_thread(geo):
        made = scratch()
        with T.serial(0, geo.r) as r:
            yield r, made
        return
    tasks = min(default_threads(), geo.r) if geo.static else default_threads()
    share = -(-geo.r // tasks) if geo.static else tirx.ceildiv(geo.r, tasks)
    with T.parallel(0, tasks) as task:
        made = scratch()
        with T.serial(task * share, tirx.min((task + 1) * share, geo.r)) as r:
            yield r, made


def _stash_row(em: Emitter, stash, buf):
    """Register the row buffer ``buf`` (1, N, 1) of ``stash`` with the writer's emitter: its
    single tile stores the basis value of each element there."""
    comp = em.rule.components[stash.component]
    em.stashed.setdefault(id(comp), []).append((stash.column, buf, 0))
    em.stash_end = em.plan.lanes * em.plan.tile
    return buf


def _stash_reader(em: Emitter, stash, buf, r, mine: dict, reader: Emitter):
    """After the writer's pass over row ``r``: the elements after its tile get their basis
    value at the final anchors too, and the reader's emitter over the stash comes with the
    row's condition (the tile's anchors are the final ones)."""
    comp = em.rule.components[stash.component]
    if em.stash_end < em.geo.n:
        with T.serial(em.stash_end, em.geo.n) as i:
            T.buffer_store(buf, em.expr(comp.basis[stash.column], em.base_lookup(r, i)),
                           [0, i, 0])
    cond = all_of(em.stash_anchors[tile_anchor(a, em.rule.cascade)] == mine[a.name][0][r, 0]
                  for a in comp.anchors)
    geo = reader.geo
    inputs = {**geo.inputs, stash.stream: InputGeom((1,) * len(geo.rows), geo.n, 1,
                                                    geo.compute)}
    geo = dataclasses.replace(geo, inputs=inputs)
    own = stage_plan(stash.rule, geo, reader.plan)
    em_s = _emitter(stash.rule, geo, own, {**reader.bufs, stash.stream: buf}, reader.rowvals,
                    reader.scores)
    return em_s, T.bind(cond)


VARIANTS = {"rolling": rolling, "split": split, "unfused": unfused, "resident": resident}
