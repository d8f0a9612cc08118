"""The analytic cost model: a predicted time for a candidate plan, without measuring.

Work is counted from the rule by ``work.rule_work``; the machine's figures come from
``machine.machine()`` (measured once with redfuser's own kernels and cached).  For each
loop nest of a plan (the fused pass, or one pass per reduction when unfused, then the
pass that writes per-element outputs) the predicted time is the larger of

- **memory**: the bytes it streams over the bandwidth measured at that working set's
  size.  Rows sharing an input (the queries of one head reading its K and V) re-read it
  from cache, at the bandwidth of the slice they share; a block of ``row_block`` rows
  shares each load (a GEMM: W is packed once per row block of ``mc`` rows);
- **compute**: elements per thread times the per-element cost.  Arithmetic and calls
  cost the measured vector figures when they run in lanes (scaled by how much of a
  16-lane register the lanes fill), over the feature axis (D-wide work), or over the
  elements of a one-lane tile (attention's ``exp(s - m)`` for 16 keys); scalar figures
  otherwise.  Re-anchoring is paid per element by a plain fold and once per tile by a
  tile; a plain fold also waits on its state's dependency chain (the re-anchoring of
  one step needs the previous one), shared by the independent lanes.  A GEMM
  micro-kernel shares each load of the weights by its ``mr`` rows and loads and stores
  its sums once per ``kc`` elements;

plus the launch, each row's lane merges and finalize, and the split variant's merges
of its pieces.  Rows (or row pieces) are spread over the threads in waves; fewer items
than threads leave threads (and their share of the bandwidth) idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from algebra.functions import Dot

from ..lowering import CpuPlan, CudaPlan, Geometry, Plan, backend, signature
from ..lowering.cpu.plan import LANES
from ..lowering.cuda.plan import Gpu
from ..lowering.staged import RESIDENT
from .machine import Machine
from .work import RuleWork, Work, rule_work

VECTOR = LANES  # float32 lanes of one vector register (the CPU plan's fact)
CALL_DEPTH = 12  # dependent steps of a polynomial exp/log: its latency in operations
DOT_SUM = 8  # a dot product's 16 partial sums added by a halving tree (outside tiles)
WRITE_FACTOR = 2.0  # a written byte costs a read for ownership and the write back
F32 = 4


@dataclass(frozen=True)
class Estimate:
    """A predicted time in seconds, with its parts (for the report)."""

    seconds: float
    memory: float
    compute: float
    overhead: float

    @property
    def ms(self) -> float:
        return self.seconds * 1e3

    @property
    def bound(self) -> str:
        return "memory" if self.memory >= self.compute else "compute"


def predict(rule, geo: Geometry, plan: Plan, machine: Machine, target: str = "cpu") -> Estimate:
    """Predicted time of ``plan`` for ``rule`` at ``geo`` on ``machine``.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.tune.machine import nominal_cpu
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> geo, m = shape_geometry(rule, {"x": (4096, 4096)}), nominal_cpu()
    >>> fused = predict(rule, geo, CpuPlan("rolling", 16, tile=8), m)
    >>> unfused = predict(rule, geo, CpuPlan("unfused", 16, tile=8), m)
    >>> unfused.seconds > fused.seconds
    True
    """
    gpu, work = backend(target).gpu, rule_work(rule, geo)
    if gpu is None:  # the host's CPU (a CpuPlan): rows over its threads in waves
        return _predict_cpu(rule, geo, plan, machine, work)
    return _predict_cuda(rule, geo, plan, machine, work, gpu)


def _predict_cpu(rule, geo: Geometry, plan: CpuPlan, machine: Machine,
                 w: RuleWork) -> Estimate:
    pieces = plan.splits if plan.variant == "split" else 1
    items = geo.r * pieces
    waves, busy = math.ceil(items / machine.threads), min(items, machine.threads)
    per_item = math.ceil(geo.n / pieces)
    memory = compute = total = 0.0
    seen: set[str] = set()  # row-resident: streams an earlier pass over the row has read
    for fold, lanes, tile, streams in _passes(rule, geo, plan, w):
        seconds = waves * per_item * _element_cost(fold, plan, lanes, tile, geo.d, machine)
        nbytes = _stream_seconds(geo, [k for k in streams if k not in seen], plan, machine,
                                 busy) + _resident_seconds(geo, seen & set(streams), machine,
                                                           busy)
        seen |= set(streams) if plan.variant == RESIDENT else set()
        memory, compute = memory + nbytes, compute + seconds
        total += max(seconds, nbytes)
    out_bytes = _elementwise_bytes(rule, geo) * WRITE_FACTOR
    if out_bytes:
        ws = _unique_bytes(geo, _stream_names(rule)) + out_bytes
        seconds = waves * per_item * _cost(w.elementwise, VECTOR, geo.d, machine, False)
        nbytes = out_bytes / (machine.bandwidth_at(ws) * busy / machine.threads)
        memory, compute = memory + nbytes, compute + seconds
        total += max(seconds, nbytes)
    overhead = _overhead(geo, plan, w, machine)
    return Estimate(total + overhead, memory, compute, overhead)


def _passes(rule, geo: Geometry, plan: CpuPlan, w: RuleWork):
    """(the fold's counts, lanes, tile, streams read) of each stream pass of the plan; an
    unfused pass reads earlier results as parameters: nothing to re-anchor."""
    streams = _stream_names(rule)
    out = [(w, plan.lanes, plan.tile, streams)]
    if plan.variant in ("unfused", RESIDENT):  # resident: the same passes, row by row
        out = []
        for k, red in enumerate(rule.cascade.reductions):
            used = {s.name for s in red.body.free_symbols} & set(streams)
            alone = replace(w, fold=w.stages[k], reanchor=Work(), merge=Work(ops=1.0),
                            chain=w.pass_chains[k], wide_states=float(red.name in geo.vec),
                            dots=float(len(red.body.atoms(Dot))))
            lanes = plan.lanes if w.stage_lanes[k] else 1
            out.append((alone, lanes, plan.tile, tuple(sorted(used))))
    if w.elementwise != Work():  # the per-element outputs re-read what they use
        out.append((replace(w, fold=Work(), reanchor=Work(), merge=Work(), chain=0.0,
                            wide_states=0.0, dots=0.0), VECTOR, 1, _elementwise_streams(rule)))
    return out


def _element_cost(w: RuleWork, plan: CpuPlan, lanes: int, tile: int, d: int,
                  m: Machine) -> float:
    """Seconds per element and thread of one fold: the larger of its throughput and its
    dependency chain (each lane is one chain; the lanes' chains overlap).  Feature-axis
    work also loads its stream slots (shared by a row block) and, outside a tile, loads
    and stores its state slots and sums each dot product's partial sums."""
    over_tile = w.fold.vops > 0  # one lane, feature axis: a tile's calls run in vectors
    block, kept = (plan.mr, plan.kc) if plan.mr else (plan.row_block, tile)
    wide = Work(vops=w.wide_loads / block + 2.0 * w.wide_states / kept)
    if tile > 1:  # re-anchoring and a merge once per tile
        per_tile = (w.reanchor + w.merge) * (1.0 / tile)
        through = _cost(w.fold + per_tile + wide, lanes, d, m, over_tile, tile)
        chain = w.chain + chain_steps(per_tile)
    else:
        through = _cost(w.fold + w.reanchor + wide + Work(ops=DOT_SUM * w.dots), lanes, d, m,
                        False)
        chain = chain_steps(w.reanchor) + w.chain
    return max(through, chain * m.chain_op / lanes)


def chain_steps(work: Work) -> float:
    """Dependent steps of per-element (width-1) work if it all sits on one chain."""
    return work.ops + work.calls * CALL_DEPTH


def _cost(work: Work, lanes: int, d: int, m: Machine, tiled: bool, tile: int = 1) -> float:
    """Seconds per element and thread of ``work`` run in ``lanes`` lanes (throughput)."""
    wide = (work.vops * m.wide_op + work.vcalls * m.vec_exp) * max(d, VECTOR)
    if lanes > 1:
        fill = VECTOR / min(lanes, VECTOR)
        return fill * (work.ops * m.vec_op + work.calls * m.vec_exp) + wide
    if tiled:  # one lane: the slot-invariant calls run vectorized over the tile's elements
        fill = VECTOR / min(tile, VECTOR)
        return work.ops * m.scalar_op + work.calls * m.vec_exp * fill + wide
    return work.ops * m.scalar_op + work.calls * m.scalar_exp + wide


def _stream_names(rule) -> tuple[str, ...]:
    return tuple(sorted(s.name for s in rule.cascade.streams))


def _elementwise_streams(rule) -> tuple[str, ...]:
    names = {s.name for e in rule.cascade.elementwise.values() for s in e.free_symbols}
    return tuple(sorted(names & set(_stream_names(rule))))


def _unique_bytes(geo: Geometry, names) -> float:
    return float(sum(geo.inputs[k].count * geo.n * geo.inputs[k].width * F32 for k in names
                     if k in geo.inputs))


def _stream_seconds(geo: Geometry, names, plan: CpuPlan, m: Machine, busy: int) -> float:
    """Seconds to stream ``names`` once per row: the distinct bytes from where they live,
    rows sharing an input re-read its slice from cache (a row block shares each load)."""
    share = busy / m.threads
    unique = _unique_bytes(geo, names)
    seconds = unique / (m.bandwidth_at(unique) * share)
    block = plan.mc or plan.row_block
    for k in names:
        g = geo.inputs.get(k)
        if g is not None and g.count < geo.r:
            slice_bytes = geo.n * g.width * F32
            reread = (geo.r - g.count) * slice_bytes / block
            seconds += reread / (m.bandwidth_at(slice_bytes * busy) * share)
    return seconds


def _resident_seconds(geo: Geometry, names, m: Machine, busy: int) -> float:
    """Seconds for a later pass of a row-resident plan to re-read ``names``: each thread
    re-reads the row it just read, so the bandwidth is that of ``busy`` rows' worth of
    bytes (the L2's while a row fits it, DRAM's once rows are megabytes long)."""
    if not names:
        return 0.0
    row = _unique_bytes(geo, names) / max(geo.r, 1)
    return row * geo.r / (m.bandwidth_at(row * busy) * busy / m.threads)


def _elementwise_bytes(rule, geo: Geometry) -> float:
    return float(sum(a.shape[0] * a.shape[1] * a.width * F32
                     for a in signature(rule, geo).elementwise))


def _overhead(geo: Geometry, plan: CpuPlan, w: RuleWork, m: Machine) -> float:
    """Launch; per item (a row, or a row piece): the lanes merged one after the other; per
    row: the finalize and, split, the pieces merged one after the other."""
    merge = _serial(w.merge, geo.d, m)
    pieces = plan.splits if plan.variant == "split" else 1
    item_waves = math.ceil(geo.r * pieces / m.threads)
    row_waves = math.ceil(geo.r / m.threads)
    passes = len(w.stages) if plan.variant == "unfused" else 1
    seconds = m.launch * (1 + (pieces > 1)) + item_waves * passes * (plan.lanes - 1) * merge
    seconds += row_waves * (_serial(w.finalize, geo.d, m) + (pieces - 1) * merge)
    return seconds


def _serial(work: Work, d: int, m: Machine) -> float:
    """Seconds of ``work`` done once, as a dependent sequence (a merge, a finalize)."""
    return chain_steps(work) * m.chain_op + (work.vops * m.wide_op + work.vcalls * m.vec_exp) * \
        max(d, VECTOR)


def _predict_cuda(rule, geo: Geometry, plan: CudaPlan, m: Machine, w: RuleWork,
                  gpu: Gpu) -> Estimate:
    """One block of ``plan.threads`` per row (piece): the GPU is busy in proportion to the
    resident threads; each block ends with log2(threads) barrier-separated merge levels.
    ``m``'s figures are for the whole GPU (seconds per op and per byte at full occupancy)."""
    pieces = plan.splits if plan.variant == "split" else 1
    passes = len(w.stages) if plan.variant == "unfused" else 1
    blocks = geo.r * pieces
    busy = min(1.0, blocks * plan.threads / (gpu.sms * gpu.sm_threads / 2))
    unique = _unique_bytes(geo, _stream_names(rule)) * passes
    if w.elementwise != Work():  # re-read, then write the per-element outputs
        unique += _unique_bytes(geo, _elementwise_streams(rule)) + \
            _elementwise_bytes(rule, geo) * WRITE_FACTOR
    work = w.fold + w.reanchor
    per_element = work.ops + work.calls * CALL_DEPTH + (work.vops + work.vcalls) * geo.d
    compute = geo.r * geo.n * per_element * m.vec_op / busy
    memory = unique / m.bandwidth_at(unique) / busy
    resident = gpu.sms * max(1, min(gpu.sm_blocks, gpu.sm_threads // plan.threads))
    tree = math.log2(plan.threads) * (2 * gpu.sync_s + _serial(w.merge, geo.d, m))
    overhead = m.launch * (passes + (pieces > 1)) + math.ceil(blocks / resident) * tree
    return Estimate(max(memory, compute) + overhead, memory, compute, overhead)

