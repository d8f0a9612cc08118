"""The three kernel variants as loop nests around the ``Emitter`` steps.

- rolling: rows in parallel; per row, lanes fold interleaved elements, then merge.
- split: (row, piece) pairs in parallel, each piece's state to a workspace; then per
  row the pieces are merged (flash-decoding).
- unfused: one rolling loop nest per reduction (each reading the final values of
  the earlier ones), the baseline that shows what fusion buys.
"""

from __future__ import annotations

import dataclasses

from algebra.derive import derive_components, running_values
from algebra.rule import FusionRule
from algebra.spec import Cascade

from . import tiles
from .analysis import Geometry
from .lower import Emitter
from .plan import Plan
from .registers import F32, I64, States, registers
from .tvm_adapter import IRBuilder, T, arg_buffer, tirx


def result_width(rule: FusionRule, geo: Geometry, name: str) -> int:
    shape = rule.cascade.shapes.get(name)
    return shape.k if shape is not None and shape.k else geo.width(name)


def result_dtype(rule: FusionRule, name: str) -> str:
    red = next((r for r in rule.cascade.reductions if r.name == name), None)
    return I64 if red is not None and red.op.startswith("arg") else F32


def build_primfunc(rule: FusionRule, geo: Geometry, plan: Plan, name: str = "redfuser_kernel",
                   target: str = "cpu"):
    """One PrimFunc: inputs (R_in, L, F) in sorted name order, then outputs in spec order."""
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            bufs = {}
            for inp in sorted(geo.inputs):
                g = geo.inputs[inp]
                bufs[inp] = arg_buffer(inp, (g.count, g.length, g.width), F32)
            results, elementwise = {}, {}
            for out in rule.outputs:
                if out in rule.cascade.elementwise:
                    width = geo.width(out) if out in geo.vec else elementwise_width(rule, geo,
                                                                                      out)
                    elementwise[out] = arg_buffer(out, (geo.r, geo.n, width), F32)
                else:
                    width = result_width(rule, geo, out)
                    results[out] = (arg_buffer(out, (geo.r, width), result_dtype(rule, out)),
                                    width)
            emit = (VARIANTS if target == "cpu" else CUDA_VARIANTS)[plan.variant]
            emit(rule, geo, plan, bufs, results, elementwise)
    return ib.get()


def elementwise_width(rule, geo, name) -> int:
    from .analysis import is_vec

    return geo.d if is_vec(rule.cascade.elementwise[name], set(geo.vec)) else 1


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
    with T.serial(0, tirx.floordiv(length, step)) as c:
        base = start + c * step
        if tile > 1:
            tiles.tile(em, st, r, base, lanes, tile)
        else:
            with T.vectorized(0, lanes) as lane:
                em.update(st, lane, base + lane, r)
    with T.serial(tirx.floordiv(length, step) * step, length) as t:
        em.update(st, 0, start + t, r)
    if lanes > 1:
        with T.serial(1, lanes) as lane:  # a loop, not unrolled: one copy of the merge
            em.merge(st, 0, lane, r)


def _rolling(rule, geo, plan, bufs, results, elementwise, rowvals=None):
    em = Emitter(rule, geo, plan, bufs, {**(rowvals or {}), **results})
    if plan.row_block > 1:
        return _rolling_blocks(em, geo, plan, results, elementwise)
    with T.parallel(0, geo.r) as r:
        st = States(rule, geo, 2 * plan.lanes)
        for lane in range(plan.lanes):
            st.init(lane)
        _fold(em, st, r, tirx.const(0, I64), tirx.const(geo.n, I64), plan.lanes, plan.tile)
        em.finalize(st, r, results)
        em.elementwise(r, elementwise)


def _rolling_blocks(em: Emitter, geo: Geometry, plan: Plan, results, elementwise):
    """Blocks of ``plan.row_block`` rows in parallel; each tile is folded for every row of
    the block at once (``tiles.tile_rows``).  The last block repeats the last row where the
    rows do not divide evenly (same values written twice by one thread)."""
    size, block = plan.tile, plan.row_block
    with T.parallel(0, -(-geo.r // block)) as b:
        rows = [T.bind(tirx.min(b * block + j, geo.r - 1)) for j in range(block)]
        sts = [States(em.rule, geo, 2) for _ in rows]
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


def _split(rule, geo, plan, bufs, results, elementwise):
    em = Emitter(rule, geo, plan, bufs, results)
    s, chunk = plan.splits, -(-geo.n // plan.splits)
    work = workspace(rule, geo, geo.r * s)
    with T.parallel(0, geo.r * s) as rs:
        r, piece = tirx.floordiv(rs, s), tirx.floormod(rs, s)
        st = States(rule, geo, 2 * plan.lanes)
        for lane in range(plan.lanes):
            st.init(lane)
        start = piece * chunk
        length = tirx.max(tirx.min(tirx.const(geo.n, I64) - start, chunk), 0)
        _fold(em, st, r, start, length, plan.lanes, plan.tile)
        copy_state(st, work, 0, rs, to_work=True)
    with T.parallel(0, geo.r) as r:
        st = States(rule, geo, 2)
        copy_state(st, work, 0, r * s, to_work=False)
        with T.serial(1, s) as piece:
            copy_state(st, work, 1, r * s + piece, to_work=False)
            em.merge(st, 0, 1, r)
        em.finalize(st, r, results)
        em.elementwise(r, elementwise)


def workspace(rule: FusionRule, geo: Geometry, rows: int) -> dict:
    """Global buffers holding one complete state per row piece: name -> (buffer, width)."""
    return {name: (T.alloc_buffer((rows, width), dtype), width)
            for name, (width, dtype, _, _) in registers(rule, geo).items()}


def copy_state(st: States, work: dict, lane, row, to_work: bool):
    """Lane ``lane`` of ``st`` to (or from) row ``row`` of a workspace."""
    for name, (buf, width) in work.items():
        with T.serial(0, width) as w:
            if to_work:
                T.buffer_store(buf, st.bufs[name][lane, w], [row, w])
            else:
                T.buffer_store(st.bufs[name], buf[row, w], [lane, w])


def _cuda(name):
    from . import gpu

    return lambda *args: getattr(gpu, f"cuda_{name}")(*args)


CUDA_VARIANTS = {v: _cuda(v) for v in ("rolling", "split", "unfused")}


def stage_rule(rule: FusionRule, index: int) -> FusionRule:
    """Reduction ``index`` alone, reading earlier results as per-row parameters."""
    c = rule.cascade
    red = dataclasses.replace(c.reductions[index], anchors=())
    cascade = Cascade(c.text, c.streams, c.params, c.vector_inputs, (red,), {}, {}, (red.name,),
                      c.shapes)
    comps = derive_components(cascade)
    return FusionRule(cascade, comps, running_values(cascade, comps), ())


def _unfused(rule, geo, plan, bufs, results, elementwise):
    """One loop nest per reduction; epilogues and per-element outputs in a last one."""
    tmp = {}
    for k, red in enumerate(rule.cascade.reductions):
        width = result_width(rule, geo, red.name)
        buf = T.alloc_buffer((geo.r, width), result_dtype(rule, red.name))
        tmp[red.name] = (buf, width)
        stage = stage_rule(rule, k)
        lanes = plan.lanes if _stage_lanes_ok(stage, geo) else 1
        blocks = plan.row_block if lanes == 1 else 1
        _rolling(stage, geo, dataclasses.replace(plan, lanes=lanes, row_block=blocks), bufs,
                 {red.name: tmp[red.name]}, {}, rowvals=_epilogue_values(rule, tmp))
    em = Emitter(rule, geo, plan, bufs, _epilogue_values(rule, tmp))
    with T.parallel(0, geo.r) as r:
        for name, (buf, width) in results.items():
            expr = rule.cascade.epilogues.get(name, rule.cascade.results[name])
            with em._slots(width) as slot:
                T.buffer_store(buf, em.expr(expr, em.base_lookup(r, None, slot)), [r, slot])
        em.elementwise(r, elementwise)


def _epilogue_values(rule, tmp):
    """Per-row values for the unfused nests: reduction results, and epilogues as formulas."""
    return {**tmp, **rule.cascade.epilogues}


def _stage_lanes_ok(stage: FusionRule, geo: Geometry) -> bool:
    from .plan import vector_lanes

    return vector_lanes(stage, geo) > 1


VARIANTS = {"rolling": _rolling, "split": _split, "unfused": _unfused}
