"""The CPU's schedule space: which plan parameters the tuner (``redfuser.tune.space``)
searches for a rule at a geometry, and their values (the table in that module's
docstring).  Values are sized by the host's vector unit (``vector.py``)."""

from __future__ import annotations

import os

from algebra.cascade import carries_feature_axis
from algebra.functions import Dot
from algebra.rule import FusionRule

from ...tvm.target import default_threads, host_target
from ..geometry import Geometry
from ..plan import MIN_PIECE, SPLIT_VALUES, Param
from .plan import (
    ISA,
    LANES,
    TILE_ELEMENTS,
    CpuPlan,
    choose,
    gemm_blocks,
    gemm_plan,
    micro_kernels,
    vector_lanes,
)

LANE_VALUES = (1, LANES, 2 * LANES, 4 * LANES)  # one to four vector registers
TILES_LANES = (8, 32, 128)  # lanes > 1: elements per lane per tile
TILES_ONE = (1, 4, 8, 16, 32)  # one lane: elements per tile (attention's keys)
ROW_BLOCKS = (1, 2, 4, 8)
MR_VALUES, KC_VALUES = (4, 6, 8), (128, 256, 512)
NR_VALUES = tuple(v * LANES for v in (1, 2, 3, 4))  # whole vectors (``ISA.fits`` prunes)
MAX_TILE_ELEMENTS = TILE_ELEMENTS  # lanes x tile: beyond it a tile's passes leave L1


def params(rule: FusionRule, geo: Geometry, variant: str,
           threads: int) -> tuple[Param, ...] | None:
    """The searched parameters of ``variant`` (None: the variant does not apply).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> [p.name for p in params(rule, shape_geometry(rule, {"x": (64, 1024)}), "split", 2)]
    ['lanes', 'tile', 'splits']
    """
    tiled = variant != "split" and micro_kernels(geo)  # float32's micro-kernels only
    blocks = gemm_blocks(rule, geo, threads) if tiled else None
    if blocks is not None:
        return _gemm(rule, geo, variant, blocks)
    lanes = _lanes(rule, geo, variant)
    block = _row_block(geo, lanes, threads) if variant != "split" else None
    found = [lanes, _tile(rule, lanes, block is not None), block]
    if variant == "split":
        splits = _splits(rule, geo, threads)
        if splits is None:
            return None
        found.append(splits)
    return tuple(p for p in found if p is not None)


def plan_fits(plan: CpuPlan) -> bool:
    """Does a tile's passes stay in L1 (``MAX_TILE_ELEMENTS``), and a GEMM micro-kernel's
    sums, panel vectors and broadcast fit the vector registers, and a packed block hold
    whole panels (where there is a micro-kernel), and blocked rows fold tiles (a row block
    of one-element tiles shares nothing: rows are blocked with tile > 1 or a GEMM)?"""
    gemm = not plan.mr or (not plan.nc % plan.nr and ISA.fits(plan.mr, plan.nr))
    blocks = plan.row_block == 1 or plan.tile > 1 or plan.mr > 0
    return gemm and blocks and plan.lanes * plan.tile <= MAX_TILE_ELEMENTS


def machine_id() -> str:
    """What a measurement here is valid for: the CPU's name with the features the kernels
    are built for beyond it (``host_target``: a tile plan is measured only where AMX is),
    cores and runtime threads.

    Examples
    --------
    >>> machine_id().count("/")
    2
    """
    target = host_target()
    cpu = target["mcpu"] + "".join(target.get("mattr", ()))
    return f"{cpu}/{os.cpu_count()} cpus/{default_threads()} threads"


def stage_lanes(rule: FusionRule, geo: Geometry) -> tuple[bool, ...]:
    """May each reduction's stage (the unfused variant's passes) run in vector lanes?"""
    if vector_lanes(rule, geo) > 1:
        return (True,) * len(rule.cascade.reductions)
    vec_names = set(geo.vec)
    return tuple(not carries_feature_axis(r.body, vec_names) and r.k is None and
                 geo.n >= 2 * LANES and not r.body.atoms(Dot) for r in rule.cascade.reductions)


def _gemm(rule, geo: Geometry, variant: str, blocks: dict) -> tuple[Param, ...]:
    """The GEMM micro-kernel's parameters where the policy blocks the rule's products; the
    rest of the cascade (a pass over the rows beside the GEMM) keeps the policy's lanes and
    tile: it costs little next to the product."""
    plan = gemm_plan(rule, geo, variant, True, blocks)
    width = -(-geo.d // LANES) * LANES
    why = "the rule's matrix products run as a blocked GEMM"
    return (Param("lanes", (plan.lanes,), "the rest of the cascade's (the policy's)"),
            Param("tile", (plan.tile,), "the rest of the cascade's (the policy's)"),
            Param("mr", MR_VALUES, why + ": rows per micro-kernel"),
            Param("nr", tuple(sorted({v for v in NR_VALUES if v <= width} | {blocks["nr"]})),
                  "columns per micro-kernel and packed panel"),
            Param("kc", tuple(sorted({min(v, geo.n) for v in KC_VALUES})), "K per block"),
            Param("nc", (blocks["nc"],), "columns per packed block (the policy's)"),
            Param("mc", (blocks["mc"],), "rows per row block (the policy's)"),
            Param("nt", (blocks["nt"],), "column ranges per row block (the policy's)"))


def _lanes(rule, geo: Geometry, variant: str) -> Param:
    if variant == "unfused":
        ok = any(stage_lanes(rule, geo))
    else:
        ok = vector_lanes(rule, geo) > 1
    if not ok:
        return Param("lanes", (1,), "a state carries the feature axis, a dot product or a "
                                    "top-k insertion: one lane")
    return Param("lanes", tuple(v for v in LANE_VALUES if 2 * v <= geo.n),
                 "every state is a per-row scalar: the update runs in vector lanes")


def _anchored(rule) -> bool:
    return any(c.family.anchored for c in rule.components)


def _tile(rule, lanes: Param, blocks: bool) -> Param | None:
    if blocks and not _anchored(rule):
        return Param("tile", TILES_ONE, "rows are blocked: elements per tile of the block")
    if _anchored(rule):
        values = sorted(set(TILES_LANES if max(lanes.values) > 1 else ()) |
                        set(TILES_ONE if min(lanes.values) == 1 else ()))
        return Param("tile", tuple(values), "a state is re-anchored: the rescale is paid "
                                            "once per tile")
    if max(lanes.values) > 1:
        return Param("tile", (1, 8), "lanes: tiles unroll the fold (nothing re-anchored)")
    return None


def _splits(rule, geo: Geometry, threads: int) -> Param | None:
    hand = choose(rule, geo, variant="split", threads=threads).splits
    values = [s for s in sorted(set(SPLIT_VALUES) | {hand}) if geo.n // s >= MIN_PIECE]
    if not values:
        return None
    return Param("splits", tuple(values), "pieces per row, in parallel, combined with the "
                                          "derived merge")


def _row_block(geo: Geometry, lanes: Param, threads: int) -> Param | None:
    if lanes.values != (1,):
        return None
    shared = any(g.count < geo.r and g.length > 1 and g.width > 1 for g in geo.inputs.values())
    values = tuple(b for b in ROW_BLOCKS if b * threads <= geo.r)
    if not shared or geo.d % LANES or len(values) < 2:
        return None
    return Param("row_block", values, "a stream is shared by the rows: a block of rows "
                                      "shares each load of it")
