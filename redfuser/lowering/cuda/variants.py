"""The CUDA variants: one thread block per row (or per row piece).

Each thread folds a strided share of the stream into its own slot of a shared-memory
state array; the slots are combined by a tree of the derived merge (the same merge
that combines CPU lanes and split pieces); thread 0 finalizes; then every thread
writes its share of the per-element outputs.  A staged rule's block (``resident``) first
copies its row into shared memory when it fits, then runs every stage over that copy.
"""

from __future__ import annotations

import dataclasses

from ...tvm.ir import T, block_sync, cuda_rounded, tirx
from ..emitter import Emitter
from ..geometry import InputGeom
from ..invariants import rule_scores
from ..nests import copy_state, epilogue_values, store_results, unfused_passes, workspace
from ..products import products
from ..registers import States
from ..signature import F32, result_dtype, result_width
from ..texpr import loaded
from . import gemm
from .plan import row_in_shared


def _tree(em: Emitter, shared: States, t, r, threads: int) -> States:
    """Combine the threads' slots with the derived merge, a tree of log2(threads) levels.

    Each level loads two slots into registers, merges there and stores back, with a
    barrier between loads and stores (the merge never touches shared memory)."""
    pair = States(em.rule, em.geo, 2)
    levels = threads.bit_length() - 1
    with T.serial(0, levels) as level:  # a loop, not unrolled: one copy of the merge
        stride = tirx.shift_right(tirx.const(threads // 2, "int32"), level)
        with T.If(t < stride):
            with T.Then():
                _move(shared, t, pair, 0)
                _move(shared, t + stride, pair, 1)
                em.merge(pair, 0, 1, r)
        block_sync()
        with T.If(t < stride):
            with T.Then():
                _move(pair, 0, shared, t)
        block_sync()
    return pair


def _move(src: States, src_lane, dst: States, dst_lane):
    for name, buf in src.bufs.items():
        with T.serial(0, src.widths[name]) as w:
            T.buffer_store(dst.bufs[name], buf[src_lane, w], [dst_lane, w])


def _gather(em, t, r, threads, fold) -> States:
    """Every thread folds into registers, publishes its state, and the tree merges them;
    returns the registers in which thread 0 holds the row's state."""
    own = States(em.rule, em.geo, 1)
    own.init(0)
    fold(own)
    shared = States(em.rule, em.geo, threads, scope="shared")
    _move(own, 0, shared, t)
    block_sync()
    pair = _tree(em, shared, t, r, threads)
    with T.If(t == 0):
        with T.Then():
            _move(shared, 0, pair, 0)
    return pair


def _fold(em, st, t, r, start, length, threads):
    with T.serial(0, tirx.ceildiv(tirx.max(length - t, 0), threads)) as c:
        em.update(st, 0, start + t + c * threads, r)


def _finish_row(em, t, r, threads: int, results, elementwise, fold):
    """One row's block: fold and merge the threads' states, thread 0 finalizes, then all
    threads write their share of the per-element outputs."""
    st = _gather(em, t, r, threads, fold)
    with T.If(t == 0):
        with T.Then():
            em.finalize(st, r, results)
    block_sync()
    em.elementwise(r, elementwise, t, threads)


def _bind_rows(em: Emitter, r):
    """Symbolic rows: each broadcast input's row index bound once per block
    (``Emitter.bind_rows``)."""
    if not em.geo.static:
        em.bind_rows(r)


def _emitter(rule, geo, plan, bufs, rowvals, scores=None) -> Emitter:
    return Emitter(rule, geo, plan, bufs, rowvals, rounded=cuda_rounded, scores=scores,
                   backend="cuda")


def _row_state(em, t, r, threads: int) -> States:
    """Row r folded by ``threads`` threads and merged: thread 0 holds its state."""
    zero = tirx.const(0, "int32")
    return _gather(em, t, r, threads, lambda own: _fold(em, own, t, r, zero, em.geo.n, threads))


def rolling(rule, geo, plan, bufs, results, elementwise, rowvals=None, scores=None):
    if plan.mr and products(rule, geo):
        return gemm.rolling(rule, geo, plan, bufs, results, elementwise, rowvals or {},
                            scores, _row_state)
    em = _emitter(rule, geo, plan, bufs, {**(rowvals or {}), **results}, scores)
    with T.launch_thread("blockIdx.x", geo.r) as r:
        with T.launch_thread("threadIdx.x", plan.threads) as t:
            _bind_rows(em, r)
            zero = tirx.const(0, "int32")
            _finish_row(em, t, r, plan.threads, results, elementwise,
                        lambda own: _fold(em, own, t, r, zero, geo.n, plan.threads))


def split(rule, geo, plan, bufs, results, elementwise):
    em = _emitter(rule, geo, plan, bufs, results)
    s, chunk = plan.splits, -(-geo.n // plan.splits)
    work = workspace(rule, geo, geo.r * s)
    with T.launch_thread("blockIdx.x", geo.r * s) as rs:
        with T.launch_thread("threadIdx.x", plan.threads) as t:
            r, start = tirx.floordiv(rs, s), tirx.floormod(rs, s) * chunk
            length = tirx.min(geo.n - start, chunk)
            st = _gather(em, t, r, plan.threads,
                         lambda own: _fold(em, own, t, r, start, length, plan.threads))
            with T.If(t == 0):
                with T.Then():
                    copy_state(st, work, 0, rs, True)
    with T.launch_thread("blockIdx.x", geo.r) as r:
        with T.launch_thread("threadIdx.x", plan.threads) as t:
            def load(own):  # plan: splits <= threads, one piece per thread
                with T.If(t < s):
                    with T.Then():
                        copy_state(own, work, 0, r * s + t, False)

            _finish_row(em, t, r, plan.threads, results, elementwise, load)


def unfused(rule, geo, plan, bufs, results, elementwise):
    """One kernel per reduction; thread 0 stores the per-row results, then every thread
    writes its share of the per-element outputs."""
    done, scores = {}, rule_scores(rule)  # each pass computes the scores the same way
    for one_pass, result, rowvals in unfused_passes(rule, geo):
        done.update(result)
        rolling(one_pass, geo, dataclasses.replace(plan, lanes=1), bufs, result, {},
                rowvals=rowvals, scores=scores)
    em = _emitter(rule, geo, plan, bufs, epilogue_values(rule, done))
    with T.launch_thread("blockIdx.x", geo.r) as r:
        with T.launch_thread("threadIdx.x", plan.threads) as t:
            _bind_rows(em, r)
            with T.If(t == 0):
                with T.Then():
                    store_results(em, r, results)
            block_sync()
            em.rowvals = {**em.rowvals, **results}
            em.elementwise(r, elementwise, t, plan.threads)


def _row_copy(em: Emitter, names, t, r, threads: int):
    """The row's streams ``names`` copied into shared memory by every thread (a strided
    share each; ``em`` reads the inputs where they live); returns the geometry and buffers
    that read them there: a copy holds one row, an input shared by every row (row 0)."""
    geo, shared, inputs = em.geo, {}, dict(em.geo.inputs)
    for name in names:
        g = geo.inputs[name]
        buf = T.alloc_buffer((1, geo.n, g.width), F32, scope="shared")
        with T.serial(0, tirx.ceildiv(tirx.max(geo.n - t, 0), threads)) as c:
            i = t + c * threads
            with T.serial(0, g.width) as w:
                T.buffer_store(buf, loaded(em.bufs[name], [em.row_of(name, r), i, w]), [0, i, w])
        shared[name] = buf
        inputs[name] = InputGeom((1,) * len(geo.rows), g.length, g.width)
    block_sync()
    return dataclasses.replace(geo, inputs=inputs), {**em.bufs, **shared}


def resident(rule, geo, plan, bufs, results, elementwise):
    """One block per row runs every stage of a staged rule: the row's streams go to shared
    memory first when they fit (``plan.row_in_shared``), each stage's threads fold it and
    merge by the tree, thread 0 writes the stage's per-row results (global scratch for what
    only later stages read), then the threads write the per-element outputs."""
    scores, tmp = rule_scores(rule), {}
    for stage in rule.staged.stages:
        for name in stage.results:
            width = result_width(rule, geo, name)
            tmp[name] = results.get(name) or (T.alloc_buffer(
                (geo.r, width), result_dtype(rule, name)), width)
    names = row_in_shared(rule, geo)
    with T.launch_thread("blockIdx.x", geo.r) as r:
        with T.launch_thread("threadIdx.x", plan.threads) as t:
            first = _emitter(rule.staged.stages[0].rule, geo, plan, bufs, {}, scores)
            here, reads = _row_copy(first, names, t, r, plan.threads)
            zero, rowvals, em = tirx.const(0, "int32"), {}, None
            for stage in rule.staged.stages:
                mine = {name: tmp[name] for name in stage.results}
                em = _emitter(stage.rule, here, plan, reads, {**rowvals, **mine}, scores)
                _bind_rows(em, r)
                st = _gather(em, t, r, plan.threads,
                             lambda own, em=em: _fold(em, own, t, r, zero, geo.n, plan.threads))
                with T.If(t == 0):
                    with T.Then():
                        em.finalize(st, r, mine)
                block_sync()
                rowvals.update(mine)
            em.elementwise(r, elementwise, t, plan.threads)


VARIANTS = {"rolling": rolling, "split": split, "unfused": unfused, "resident": resident}
