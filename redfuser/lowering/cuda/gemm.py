"""A tiled GEMM for the matrix products of a rule on CUDA (``lowering.products``).

``Y[row, :] = sum_i a(row, i) * W[i, :]`` for every product, in three launches:

1. the rest of the cascade (RMSNorm's ``sum(x**2)``): one block per row folds it and
   merges the threads by the derived merge (``row_state``), thread 0 settles it at its
   final anchors and stores it in a per-row workspace; skipped when the rule is only
   products;
2. the product: a block per ``mc x nc`` tile of the output, K in slices of ``kc``; each
   slice's ``a(row, i)`` (``x``; ``x / r`` in the unfused baseline) is computed once into
   shared memory, beside the slice of W, and each thread keeps ``mr x nr`` sums in
   registers: rows ``ty + i * mc / mr`` and columns ``tx + j * nc / nr``, so a warp reads
   consecutive shared words of W (no bank conflicts) and one word of A (a broadcast), and
   stores consecutive columns.  Rows and columns past the ends read a clamped element
   and are not stored;
3. the results: one block per row, the threads striding over each result's slots
   (``y / r``: the sums and the settled statistics), then the per-element outputs.

The anchor factor was moved to finalize by the derivation, so launch 2 is a plain GEMM
and launch 1 is independent of it: the row is read twice (``R x N`` words, against the
``N x D`` of W that launch 2 streams once per row tile).
"""

from __future__ import annotations

from collections.abc import Callable

from algebra.rule import FusionRule

from ...tvm.ir import T, block_sync, cuda_rounded, tirx
from ..emitter import Emitter
from ..geometry import Geometry
from ..nests import copy_state, workspace
from ..products import Product, products, without
from ..signature import F32
from ..texpr import const, loaded
from .plan import CudaPlan, threads_for


def rolling(rule: FusionRule, geo: Geometry, plan: CudaPlan, bufs: dict, results: dict,
            elementwise: dict, rowvals: dict, scores: dict, row_state: Callable) -> None:
    """The launches of ``rule`` (which has matrix products at ``geo``) into the active
    IRBuilder frame; ``row_state(em, t, r, threads)`` folds row r by ``threads`` threads
    and returns the registers in which thread 0 holds its state (``variants._gather``).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import build_primfunc, shape_geometry
    >>> from redfuser.lowering.cuda.plan import choose
    >>> rule = redfuser.derive("rmsnorm_gemm")
    >>> geo = shape_geometry(rule, {"x": (100, 300), "w": (300, 200)})
    >>> plan = choose(rule, geo)
    >>> plan.mr, plan.threads
    (4, 256)
    >>> text = build_primfunc(rule, geo, plan, target="cuda").script()
    >>> text.count('T.launch_thread("threadIdx.x"')  # statistics, product, results
    3
    """
    found = products(rule, geo)
    rest = without(rule, found)
    values = {**rowvals, **results}
    em, em_rest = (Emitter(r, geo, plan, bufs, values, rounded=cuda_rounded, scores=scores,
                           backend="cuda")
                   for r in (rule, rest))
    sums = {p.state: T.alloc_buffer((geo.r, geo.d), F32) for p in found}
    work = workspace(rest, geo, geo.r) if rest.components else None
    if work is not None:
        _statistics(em_rest, geo, work, row_state)
    for p in found:
        _product(em, p, geo, plan, bufs[p.weight], sums[p.state])
    _results(em, em_rest, geo, found, sums, work, results, elementwise)


def _statistics(em: Emitter, geo: Geometry, work: dict, row_state: Callable):
    """Launch 1: each row's statistics, settled at the final anchors, into ``work``."""
    threads = threads_for(em.rule, geo)
    with T.launch_thread("blockIdx.x", geo.r) as r:
        with T.launch_thread("threadIdx.x", threads) as t:
            st = row_state(em, t, r, threads)
            with T.If(t == 0):
                with T.Then():
                    em.finalize(st, r, {})  # no results: it settles the anchored states
                    copy_state(st, work, 0, r, to_work=True)


def _product(em: Emitter, p: Product, geo: Geometry, plan: CudaPlan, w, sums):
    """Launch 2: sums = a @ W, one ``mc x nc`` tile a block (module docstring)."""
    mc, nc, kc, mr, nr = plan.mc, plan.nc, plan.kc, plan.mr, plan.nr
    across, threads = nc // nr, plan.threads
    with T.launch_thread("blockIdx.y", -(-geo.r // mc)) as by:
        with T.launch_thread("blockIdx.x", -(-geo.d // nc)) as bx:
            with T.launch_thread("threadIdx.x", threads) as t:
                a = T.alloc_buffer((mc, kc), F32, scope="shared")
                b = T.alloc_buffer((kc, nc), F32, scope="shared")
                acc = T.alloc_buffer((mr, nr), F32, scope="local")
                ty, tx = tirx.floordiv(t, across), tirx.floormod(t, across)
                _tile(mr, nr, lambda i, j: T.buffer_store(acc, const(0), [i, j]))
                with T.serial(0, -(-geo.n // kc)) as kb:
                    _load_a(em, p, geo, a, by * mc, kb * kc, t, threads)
                    _load_b(w, geo, b, kb * kc, bx * nc, t, threads)
                    block_sync()
                    with T.serial(0, kc) as k:
                        _tile(mr, nr, lambda i, j: T.buffer_store(
                            acc, acc[i, j] + a[ty + i * (mc // mr), k] *
                            b[k, tx + j * across], [i, j]))
                    block_sync()

                def store(i, j):
                    row, col = by * mc + ty + i * (mc // mr), bx * nc + tx + j * across
                    with T.If(tirx.all(row < geo.r, col < geo.d)):
                        with T.Then():
                            T.buffer_store(sums, acc[i, j], [row, col])

                _tile(mr, nr, store)


def _tile(mr: int, nr: int, body):
    with T.unroll(0, mr) as i:
        with T.unroll(0, nr) as j:
            body(i, j)


def _load_a(em: Emitter, p: Product, geo: Geometry, a, row0, k0, t, threads: int):
    """a[i, k] = a(row0 + i, k0 + k), 0 past the rows or the row's end."""
    rows, kc = a.shape
    with T.serial(0, -(-(rows * kc) // threads)) as c:
        e = t + c * threads
        i, k = tirx.floordiv(e, kc), tirx.floormod(e, kc)
        row, col = row0 + i, k0 + k
        value = em.expr(p.row_factor, em.base_lookup(tirx.min(row, geo.r - 1),
                                                     tirx.min(col, geo.n - 1)))
        inside = tirx.all(row < geo.r, col < geo.n)
        with T.If(e < rows * kc):
            with T.Then():
                T.buffer_store(a, tirx.Select(inside, value, const(0)), [i, k])


def _load_b(w, geo: Geometry, b, k0, col0, t, threads: int):
    """b[k, j] = W[k0 + k, col0 + j], 0 past the row's end or D (consecutive threads read
    consecutive columns)."""
    kc, nc = b.shape
    with T.serial(0, -(-(kc * nc) // threads)) as c:
        e = t + c * threads
        k, j = tirx.floordiv(e, nc), tirx.floormod(e, nc)
        row, col = k0 + k, col0 + j
        value = loaded(w, [0, tirx.min(row, geo.n - 1), tirx.min(col, geo.d - 1)])
        inside = tirx.all(row < geo.n, col < geo.d)
        with T.If(e < kc * nc):
            with T.Then():
                T.buffer_store(b, tirx.Select(inside, value, const(0)), [k, j])


def _in_order(rule: FusionRule, results: dict) -> list[str]:
    """The results, those that read another result after it."""
    def reads_other(name):
        return bool({s.name for s in rule.running[name].free_symbols} & (set(results) - {name}))
    return sorted(results, key=reads_other)


def _results(em: Emitter, em_rest: Emitter, geo: Geometry, found, sums, work, results: dict,
             elementwise: dict):
    """Launch 3: each result of each row from the sums and the settled statistics, the
    threads striding over its slots, a barrier after each (a later result may read it);
    then the per-element outputs."""
    names = {p.state for p in found}
    threads = threads_for(em_rest.rule, geo)
    with T.launch_thread("blockIdx.x", geo.r) as r:
        with T.launch_thread("threadIdx.x", threads) as t:
            scalars = {em.rule.count.name: const(geo.n)}  # every element folded: n = N
            st = None
            if work is not None:
                st = em_rest.states(1)
                copy_state(st, work, 0, r, to_work=False)
                scalars.update({n: st.get(n, 0) for n in st.bufs if st.widths[n] == 1})
            for name in _in_order(em.rule, results):
                buf, width = results[name]
                with T.serial(0, tirx.ceildiv(tirx.max(width - t, 0), threads)) as c:
                    slot = t + c * threads
                    wide = {n: sums[n][r, slot] for n in names}
                    if st is not None:
                        wide.update({n: st.get(n, 0, slot) for n in st.bufs
                                     if st.widths[n] > 1})
                    look = em.base_lookup(r, None, slot, {**scalars, **wide})
                    em.store_result(buf, em.expr(em.rule.running[name], look), [r, slot])
                block_sync()
            em.elementwise(r, elementwise, t, threads)
