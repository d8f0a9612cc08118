"""What the loop nests of every target share: split workspaces, the unfused baseline's
stages, and the final store of per-row results computed from earlier ones."""

from __future__ import annotations

from algebra.analysis import unfused_rules
from algebra.rule import FusionRule

from ..tvm.ir import T
from .emitter import Emitter
from .geometry import Geometry
from .registers import States, registers
from .signature import result_dtype, result_width


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


def unfused_passes(rule: FusionRule, geo: Geometry):
    """The unfused baseline's passes, in order: (stage rule, {name: its result buffer},
    per-row values it may read); each result buffer is allocated just before its pass."""
    tmp = {}
    for k, red in enumerate(rule.cascade.reductions):
        width = result_width(rule, geo, red.name)
        dtype = result_dtype(rule, red.name, geo.compute)
        tmp[red.name] = (T.alloc_buffer((geo.r, width), dtype), width)
        yield unfused_rules(rule)[k], {red.name: tmp[red.name]}, epilogue_values(rule, tmp)


def epilogue_values(rule: FusionRule, tmp: dict) -> dict:
    """Per-row values for the unfused nests: reduction results, and epilogues as formulas."""
    return {**tmp, **rule.cascade.epilogues}


def store_results(em: Emitter, r, results: dict):
    """Every per-row result of row r from the values the stages left (an epilogue, or the
    reduction's own result), each in its buffer's dtype (``OutputSteps.store_result``)."""
    for name, (buf, width) in results.items():
        expr = em.rule.cascade.epilogues.get(name, em.rule.cascade.results[name])
        with em.slots(width) as slot:
            em.store_result(buf, em.expr(expr, em.base_lookup(r, None, slot)), [r, slot],
                            em.slot_lanes(width))
