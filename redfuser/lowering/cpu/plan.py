"""CPU plans: the one place for lanes, tiles and row blocks (``CpuPlan``), and the policy
that picks them.

A small analytic model, stated so it can be checked: a fused rule reads the stream
once (the unfused baseline reads it once per reduction); rows are spread over the
threads; when there are fewer rows than threads and the stream is long, the split
variant (flash-decoding) cuts each row into S pieces whose partial states are
combined with the derived merge.  Lanes vectorize the update when every state is a
per-row scalar (no feature axis, no dot product, no top-k insertion).  A rule holding
matrix products (``lowering.products``: RMSNorm + GEMM) runs them as a blocked GEMM with
the blocking of ``GEMM`` (``gemm.py``), the rest of the cascade in lanes beside them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from algebra.families import Family, element_exprs
from algebra.functions import Dot
from algebra.rule import FusionRule

from ...tvm.ir import T, llvm_rounded
from ...tvm.target import default_threads
from ..geometry import Geometry
from ..plan import Plan, check_variant
from ..products import products, without
from ..signature import F32
from .amx import TILE_ROWS
from .prefetch import rows_ahead
from .scores import product_reason, score_blocks, score_dot, score_product, score_reason
from .tile_dots import TILE_DOTS, TileDot, host_tile_dot
from .vector import host_caches, host_exp, host_isa, host_narrowing

ISA, CACHES = host_isa(), host_caches()  # the host's vector unit and caches (vector.py)
LANES = ISA.lanes  # float32 lanes of a vector register: one element per lane per step
# Registers of a many-lane fold: four, so each state accumulates in four independent
# chains (one chain is bound by the add latency).  Measured on AVX-512, logsumexp 512 x
# 2048, 2 threads: 1 register 0.27 ms, 2 0.19, 4 0.15, 8 0.22 (spills).
FOLD_REGISTERS = 4
FOLD_LANES = FOLD_REGISTERS * LANES  # in float32 (``fold_lanes``: in a kernel's compute dtype)
# Elements of a many-lane tile: a row up to this long is one tile (each level re-reads it
# from L1: 32 KB of 48), longer rows are cut into tiles this long.  The tile's merge then
# costs one rescale per 8192 elements (logsumexp 64 x 16384: tiles of 2048 elements
# 0.168 ms, of 8192 0.146, of 16384 0.141; unfused 0.146).
TILE_ELEMENTS = 8192
# CPU registers (states, working anchors, tile caches) are stack buffers: TVM lowers a
# "local" allocation to a heap workspace (TVMBackendAllocWorkspace), whose pointers LLVM
# cannot tell apart, so it kept every state in memory across the loop (a store and a load
# per element); "global" ones under 1 KB become allocas that LLVM promotes to registers
# (logsumexp 64 x 2048, one thread: 0.101 -> 0.086 ms).
REGISTER_SCOPE = "global"
# Every CPU emitter's options: the vector width (float32's; ``emitter_options``: the compute
# dtype's), the registers' scope, LLVM's rounding of a score, and the host's own conversions
# and exp (``vector.py``)
EMITTER_OPTIONS = {"simd": LANES, "scratch": REGISTER_SCOPE, "rounded": llvm_rounded,
                   "backend": "cpu", "narrowing": host_narrowing, "exp": host_exp}
KEY_TILE = 16  # one lane (feature vectors, dots): elements per tile, e.g. attention's keys
# Rows sharing each load of a broadcast stream, and the tile they fold together.  Measured
# on attention 512 queries x 1024 keys x D 64, one thread: (4, 16) 5.4 ms, (8, 32) 3.7 ms,
# (16, 32) 2.9 ms but 7 s to compile; (8, 32) also helps a GEMM (3.2 -> 2.4 ms).
ROW_BLOCK, BLOCK_TILE = 8, 32
BLOCK_MIN_ELEMENTS = 8192  # 32 KB of float32: a shared stream smaller than L1 is cheap to reread
MIN_SPLIT_ELEMENTS = 2048  # below this per split, combining costs more than it saves
# Work (rows x N x D elements) below which a kernel runs on the calling thread: a parallel
# launch costs microseconds on an idle machine and hundreds of them on a loaded one, where
# the workers wait for a core (softmax 1 x 256: 0.7 us of kernel; 16 x 1024 with two busy
# cores: 840 us parallel, 19 us serial).  torch's intra-op grain size is the same 32768.
PARALLEL_MIN_WORK = 32768
# Elements per tile of a many-lane fold with a symbolic N (``dynamic_plan``): the tile
# cannot be fitted to the row, so it is fixed; a row's last (N mod this) elements fold
# LANES-wide, then one by one (fewer than FOLD_LANES).  1024 keeps the one-exp-per-element
# tile for rows of a few thousand elements at a merge per 1024.
DYNAMIC_TILE_ELEMENTS = 1024
# The cache a staged rule's row stays in between its passes (``resident``): one core's L2
# (L1 holds only rows of a few thousand floats).
RESIDENT_CACHE_BYTES = CACHES.l2
F32_BYTES = 4
KC = 512  # K per GEMM block (``GEMM``)
# The GEMM micro-kernel and its cache blocks (``gemm.py``): name -> (value, why), sized by
# the host's vector registers and L2 (``vector.py``).
GEMM: dict[str, tuple[int, str]] = {
    "mr": (ISA.gemm_rows, f"rows per micro-kernel: {ISA.why}"),
    "nr": (ISA.gemm_vectors * LANES, "columns per micro-kernel and per packed panel of W: "
           f"{ISA.gemm_vectors} vectors of {LANES} lanes"),
    "kc": (KC, "K per block: a packed panel (KC x NR x 4 B) stays in L1-L2 while every "
               "micro-kernel of the row block reads it; the sums are loaded and stored once "
               "per KC multiply-adds, and the rest of the cascade folds pieces of KC elements "
               "(one merge per piece: at 512 x 2048 -> 64, KC 256 cost 1.4x KC 512)"),
    "nc": (CACHES.l2 // 2 // (KC * F32_BYTES), "columns per packed block of W: KC x NC x 4 B "
           "is half of the L2"),
    "mc": (256, "most rows per row block (one parallel task): its packed A (MC x KC x 4 B = "
                "512 KB) stays in L2 while the panels pass; with fewer rows than two blocks, "
                "the threads split the columns (Zen 3, 256 x 4096 -> 4096 on 2 threads: "
                "columns split 65 ms, two row blocks of 128 90 ms)"),
}
# The blocking of the products on tile dot products (``tile_gemm.py``): name -> (value, why).
# Measured in one run (bfloat16 256 x 4096 -> 4096, the products alone, 2 cores, Emerald
# Rapids): KC x NC 256 x 512 6.3-6.6 ms, 512 x 256 7.0-7.3, 1024 x 256 6.7-6.8, 256 x 1024
# 6.5-6.8, and 8.8-10.8 for one block of all of K.
TILE_GEMM: dict[str, tuple[int, str]] = {
    "kc": (256, "K per block: the sums are loaded and stored once per KC values, and the "
                "rows' block of A (rows x KC x 2 B: 128 KB at 256 rows) stays in L2 while "
                "every panel of the group passes"),
    "nc": (512, "columns packed together (16 panels of 32: KC x NC x 2 B = 256 KB): each row "
                "of W is read 1 KB at a time"),
}
GEMM_FIELDS = ("mr", "nr", "kc", "nc", "mc", "nt")  # a CpuPlan's blocking; 0: no micro-kernel


@dataclass(frozen=True, kw_only=True)
class CpuPlan(Plan):
    """A CPU plan: the shared fields (``lanes``: vector lanes of the compute dtype folding a
    row side by side), tiles and row blocks, and the blocking of a GEMM micro-kernel (``gemm.py``).

    Examples
    --------
    >>> print(CpuPlan("rolling", 16, mr=6, nr=64, kc=256, nc=512, mc=126, nt=1, reason="why"))
    rolling (16 lanes, GEMM micro-kernel 6 x 64, KC 256, NC 512, MC 126, NT 1): why
    >>> print(CpuPlan("rolling", 1, tile=32, row_block=8, reason="shared keys"))
    rolling (1 lanes, blocks of 8 rows): shared keys
    """

    tile: int = 1  # elements per lane folded at fixed anchors before a merge
    row_block: int = 1  # one lane: rows folded together, sharing each streamed load
    # matrix products (0: none): a micro-kernel of mr rows x nr columns, K in blocks of kc,
    # W's columns packed in blocks of nc; a parallel task per block of mc rows and range of
    # 1/nt of the columns
    mr: int = 0
    nr: int = 0
    kc: int = 0
    nc: int = 0
    mc: int = 0
    nt: int = 0
    tile_dot: str = ""  # the products on this row of ``tile_dots.TILE_DOTS`` ("": FMAs)
    ahead: int = 0  # rows ahead whose streams are prefetched (``prefetch.py``; 0: none)

    terse: ClassVar[frozenset[str]] = frozenset({"row_block", "tile_dot", "ahead",
                                                 *GEMM_FIELDS})
    retired: ClassVar[Mapping[str, tuple[int, ...]]] = {"threads": (1,)}  # CUDA's, unset

    def __post_init__(self) -> None:
        if self.ahead < 0:
            raise ValueError(f"plan parameter ahead (rows prefetched ahead) must be >= 0, not "
                             f"{self.ahead}")
        names = [dot.name for dot in TILE_DOTS]
        if self.tile_dot and self.tile_dot not in names:
            raise ValueError(f"plan parameter tile_dot must be one of {names} or '' (the "
                             f"float32 micro-kernel), not {self.tile_dot!r}")

    @property
    def span(self) -> int:
        return self.lanes * self.tile  # a tile of every lane

    def row_by_row(self) -> CpuPlan:
        return dataclasses.replace(self, row_block=1)

    def details(self) -> str:
        extra = f", blocks of {self.row_block} rows" if self.row_block > 1 else ""
        extra += f", prefetch {self.ahead} row(s) ahead" if self.ahead else ""
        kernel = f"{self.tile_dot} tiles" if self.tile_dot else "GEMM micro-kernel"
        return extra + (f", {kernel} {self.mr} x {self.nr}, KC {self.kc}, NC "
                        f"{self.nc}, MC {self.mc}, NT {self.nt}" if self.mr else "")


def simd_lanes(geo: Geometry) -> int:
    """Lanes of a vector register in the compute dtype of ``geo`` (float64: half of
    float32's ``LANES``)."""
    return ISA.lanes_of(geo.compute)


def fold_lanes(geo: Geometry) -> int:
    """Lanes of a many-lane fold in the compute dtype of ``geo`` (FOLD_REGISTERS registers)."""
    return FOLD_REGISTERS * simd_lanes(geo)


def emitter_options(geo: Geometry) -> dict:
    """``EMITTER_OPTIONS`` with the vector width of ``geo``'s compute dtype."""
    return {**EMITTER_OPTIONS, "simd": simd_lanes(geo)}


def micro_kernels(geo: Geometry) -> bool:
    """May ``geo`` run on the float32 micro-kernels (the blocked GEMM, score tiles)?  Their
    packed panels, sums and register blocking are float32's; a float64 kernel folds its
    products in the generic nest (a dot per element), which computes in any dtype."""
    return geo.compute == F32


def vector_lanes(rule: FusionRule, geo: Geometry) -> int:
    """Lanes for the element update when each lane's update is straight-line code:
    ``fold_lanes`` where the stream fills them twice, else ``simd_lanes`` (or 1)."""
    scalar_states = all(s.symbol.name not in geo.vec for s in rule.state)
    no_dot = not any(e.atoms(Dot) for c in rule.components for e in element_exprs(c))
    no_insert = not any(c.family is Family.TOP_K for c in rule.components)
    if not (scalar_states and no_dot and no_insert):
        return 1
    if not geo.static:  # any N: lanes as for a long row, the tails fold one by one
        return fold_lanes(geo)
    return next((lanes for lanes in (fold_lanes(geo), simd_lanes(geo)) if geo.n >= 2 * lanes),
                1)


def tile_for(rule: FusionRule, lanes: int, n: int) -> int:
    """Elements per lane folded at fixed anchors: with lanes, the row in equal tiles of
    TILE_ELEMENTS to twice that (a row shorter than 2 TILE_ELEMENTS is one tile, and what
    is left over is less than ``lanes`` per tile); in one lane, KEY_TILE where a state is
    re-anchored."""
    if lanes > 1:
        tiles = max(1, n // TILE_ELEMENTS)
        return max(1, n // (tiles * lanes))
    anchored = any(c.family.anchored for c in rule.components)
    return KEY_TILE if anchored else 1


def lane_aligned(rule: FusionRule) -> bool:
    """Whether the lanes of a tiled fold can share their working anchors: every state an
    anchor reads is a single best value (max/min, arg or not), which is idempotent, so the
    tile's best can be written into every lane without counting anything twice.  Lanes
    held at one anchor then merge by adding (``Emitter.merge(aligned=True)``): no exp."""
    single = {s.symbol.name for c in rule.components
              if c.family.single for s in c.state}
    states = {s.symbol.name for s in rule.state}
    read = {sym.name for c in rule.components if c.family.linear
            for a in c.anchors for sym in rule.running[a.name].free_symbols}
    return bool(read & states) and read & states <= single


def stash_applies(rule: FusionRule, geo: Geometry, plan: CpuPlan) -> bool:
    """Per-element outputs are stashed (``algebra.stash``: written by the statistics pass,
    finished with one multiply) when the row is a single tile of aligned lanes: every
    stashed value was then computed at the same anchors, held in lane 0 afterwards.  A
    low-precision output is stashed into a float32 row buffer of the thread instead
    (``stash_rows``): in its own dtype the value would be rounded twice."""
    return (bool(rule.stashes) and plan.variant == "rolling" and plan.row_block == 1 and
            single_tile(rule, geo, plan.lanes, plan.tile))


def stash_rows(geo: Geometry) -> bool:
    """Are stashed values kept in a row buffer of the compute dtype per thread rather than
    in the outputs (outputs stored in another dtype than the compute one)?"""
    return geo.out_dtype != geo.compute


def single_tile(rule: FusionRule, geo: Geometry, lanes: int, tile: int) -> bool:
    """Is each row of ``geo`` folded as one tile of ``lanes`` aligned lanes (every value of the
    tile computed at the same anchors, lane 0's after the merge)?"""
    return (geo.static and lanes > 1 and tile > 1 and geo.n // (lanes * tile) == 1 and
            lane_aligned(rule))


def stage_plan(stage: FusionRule, geo: Geometry, plan: CpuPlan) -> CpuPlan:
    """``plan`` for one stage of a row-resident kernel: the stage's own lanes and tiles (a
    dynamic plan's for a symbolic N)."""
    if plan.dynamic:
        own = dynamic_plan(stage, geo, fast_math=plan.fast_math)
        return dataclasses.replace(plan, lanes=own.lanes, tile=own.tile)
    lanes = vector_lanes(stage, geo)
    return dataclasses.replace(plan, lanes=lanes, tile=tile_for(stage, lanes, geo.n))


def one_thread(geo: Geometry) -> bool:
    """Is the work too small to share between threads (``PARALLEL_MIN_WORK``)?  Never
    known for symbolic shapes: their rows run in parallel."""
    return geo.static and geo.r * geo.n * max(geo.d, 1) < PARALLEL_MIN_WORK


def rows_loop(geo: Geometry):
    """The loop over rows (or row tasks) of a kernel: serial under ``PARALLEL_MIN_WORK``."""
    return T.serial if one_thread(geo) else T.parallel


def choose(rule: FusionRule, geo: Geometry, variant: str | None = None,
           splits: int | None = None, threads: int | None = None,
           fast_math: bool = True) -> CpuPlan:
    """Pick rolling or split (or honour ``variant``) with a row/thread/length model."""
    check_variant(variant)
    threads = threads or default_threads()
    lanes = vector_lanes(rule, geo)
    tiled = micro_kernels(geo)
    blocks = gemm_blocks(rule, geo, threads) if variant != "split" and tiled else None
    if blocks is not None and not (variant is None and geo.r < threads and
                                   geo.n >= 2 * MIN_SPLIT_ELEMENTS):
        dot = host_tile_dot(rule, geo) if variant in (None, "rolling") else None
        if dot is not None:
            return tile_plan(rule, geo, variant, fast_math, dot)
        return gemm_plan(rule, geo, variant, fast_math, blocks)
    scored = score_plan(rule, geo, threads, fast_math) if variant in (None, "rolling") and \
        tiled else None
    if scored is not None:
        return scored
    if variant == "unfused":
        block = row_block_for(geo, lanes, threads)  # the same scheduling quality per pass
        tile = BLOCK_TILE if block > 1 else tile_for(rule, lanes, geo.n) if lanes > 1 else 1
        return CpuPlan("unfused", lanes, 1, fast_math, "requested: one pass per reduction",
                    tile=tile, row_block=block)
    idle = geo.r < threads
    long = geo.n >= 2 * MIN_SPLIT_ELEMENTS and not one_thread(geo)
    if variant == "split" or (variant is None and idle and long):
        s = splits or max(2, min(geo.n // MIN_SPLIT_ELEMENTS, 4 * threads // max(geo.r, 1)))
        s = max(1, min(s, geo.n))
        why = "requested" if variant else (f"{geo.r} row(s) < {threads} threads and N = "
                                           f"{geo.n}: split each row, combine with the merge")
        return CpuPlan("split", lanes, s, fast_math, why,
                       tile=tile_for(rule, lanes, -(-geo.n // s)))
    why = "requested" if variant else (f"{geo.r} rows >= {threads} threads" if not idle else
                                       f"N = {geo.n} too short to split")
    rows = ("one thread (less work than PARALLEL_MIN_WORK)" if one_thread(geo) else
            "rows in parallel")
    block = row_block_for(geo, lanes, threads)
    tile = BLOCK_TILE if block > 1 else tile_for(rule, lanes, geo.n)
    ahead = rows_ahead(geo, one_thread(geo)) if lanes > 1 and tile > 1 else 0
    plan = CpuPlan("rolling", lanes, 1, fast_math, f"{why}; {rows}, one pass each",
                   tile=tile, row_block=block, ahead=ahead)
    if stash_applies(rule, geo, plan):
        plan = dataclasses.replace(plan, reason=plan.reason + "; per-element outputs stashed "
                                   "by the statistics pass (one multiply to finish)")
    return plan


def score_plan(rule: FusionRule, geo: Geometry, threads: int, fast_math: bool) -> CpuPlan | None:
    """The plan of a rule whose element holds a dot against a shared stream matrix, as
    score tiles (``scores.py``): two GEMMs a tile where the sum is a factor of the dot times
    that matrix, else S a tile at a time folded row by row where the fold takes more than
    one lane (a one-lane fold, attention's D-vector sum, keeps its row blocks); None
    elsewhere."""
    scored = score_blocks(rule, geo, threads)
    if scored is None:
        return None
    found, product = score_dot(rule, geo), score_product(rule, geo)
    if product is not None:
        return CpuPlan("rolling", 1, 1, fast_math, product_reason(product, found, scored),
                       **scored)
    lanes = vector_lanes(found.folded, dataclasses.replace(geo, n=scored["nc"]))
    if lanes == 1:
        return None
    return CpuPlan("rolling", lanes, 1, fast_math, score_reason(found, geo, scored, lanes),
                   tile=tile_for(found.folded, lanes, scored["nc"]), **scored)


def dynamic_plan(rule: FusionRule, geo: Geometry, variant: str | None = None,
                 fast_math: bool = True) -> CpuPlan:
    """The plan of a kernel for every row count and N (``Plan.dynamic``): rows in parallel,
    one pass each (rolling) or the unfused baseline; lanes as for a long row, tiles of
    DYNAMIC_TILE_ELEMENTS (KEY_TILE in one lane), tails folded element by element.  No
    split (its pieces depend on N), no row blocks and no GEMM blocking (fitted to shapes).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> dynamic_plan(rule, shape_geometry(rule, {"x": (3, 5)})).lanes == FOLD_LANES
    True
    """
    check_variant(variant, dynamic=True)
    lanes = vector_lanes(rule, dataclasses.replace(geo, n=2 * DYNAMIC_TILE_ELEMENTS))
    tile = max(1, DYNAMIC_TILE_ELEMENTS // lanes) if lanes > 1 else tile_for(rule, 1, 0)
    why = ("requested: one pass per reduction" if variant == "unfused" else "any rows and N")
    return CpuPlan(variant or "rolling", lanes, 1, fast_math, f"{why}; rows in parallel, one "
                f"pass each, tiles of {tile} per lane, tails one by one", tile=tile,
                dynamic=True)


def row_block_for(geo: Geometry, lanes: int, threads: int) -> int:
    """Rows folded together when a wide stream is shared by many rows (attention's K/V by
    the queries of a head, a GEMM's weights by every row): each load of it then serves
    ROW_BLOCK rows, like a GEMM micro-kernel.  Only for one-lane rules whose feature axis
    fills whole vectors, only while every thread keeps a block, and only where a row's
    share of the stream outgrows the L1 cache (below that, re-reading it per row is cheap
    and the ROW_BLOCK copies of the fold cost compile time: 0.5 s -> 3.4 s for attention)."""
    shared = any(g.count < geo.r and g.length > 1 and g.width > 1 and
                 g.length * g.width >= BLOCK_MIN_ELEMENTS for g in geo.inputs.values())
    enough = geo.r >= ROW_BLOCK * threads
    return ROW_BLOCK if lanes == 1 and shared and enough and geo.d % simd_lanes(geo) == 0 \
        else 1


def gemm_blocks(rule: FusionRule, geo: Geometry, threads: int) -> dict[str, int] | None:
    """The GEMM blocking (``GEMM``, fitted to the shapes) when ``rule`` holds matrix products
    worth a micro-kernel at ``geo``: at least MR rows (fewer is mostly padding) and a
    shared stream of at least BLOCK_MIN_ELEMENTS (smaller, re-reading it is cheap).  The
    ``threads`` tasks split the rows (each row block packs all of W) or the columns (each
    column range re-reads the rows), whichever reads less (``_tasks``).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("rmsnorm_gemm")
    >>> blocks = gemm_blocks(rule, shape_geometry(rule, {"x": (256, 4096), "w": (4096, 4096)}), 2)
    >>> blocks["kc"], blocks["nc"] % blocks["nr"], blocks["mc"] % blocks["mr"]
    (512, 0, 0)
    >>> gemm_blocks(rule, shape_geometry(rule, {"x": (4096, 512), "w": (512, 100)}), 2)["nt"]
    1
    >>> gemm_blocks(rule, shape_geometry(rule, {"x": (3, 4096), "w": (4096, 100)}), 2) is None
    True
    """
    mr = GEMM["mr"][0]
    if not products(rule, geo) or geo.r < mr or geo.n * geo.d < BLOCK_MIN_ELEMENTS:
        return None
    nr = min(GEMM["nr"][0], -(-geo.d // LANES) * LANES)
    width = -(-geo.d // nr) * nr
    row_blocks, nt = _tasks(geo, threads, mr, width // nr)
    per_block = -(-geo.r // row_blocks)
    return {"mr": mr, "nr": nr, "kc": min(GEMM["kc"][0], geo.n),
            "nc": min(GEMM["nc"][0] // nr * nr, width), "mc": -(-per_block // mr) * mr,
            "nt": nt}


def _tasks(geo: Geometry, threads: int, mr: int, panels: int) -> tuple[int, int]:
    """(row blocks, column ranges) for at least ``threads`` tasks, reading the least: each
    row block packs all of W (N x D), each column range re-reads the rows (R x N).  Row
    blocks hold at most GEMM mc rows (their packed A stays in L2)."""
    least = -(-geo.r // GEMM["mc"][0])
    best = None
    for nt in range(1, min(threads, panels) + 1):
        blocks = min(max(least, -(-threads // nt)), -(-geo.r // mr))
        reads = blocks * geo.d + nt * geo.r  # x N elements
        if best is None or reads < best[0]:
            best = (reads, blocks, nt)
    return best[1], best[2]


def gemm_plan(rule: FusionRule, geo: Geometry, variant: str | None, fast_math: bool,
               blocks: dict[str, int]) -> CpuPlan:
    """Rolling or unfused (``variant``; None: rolling) with the matrix products as a blocked
    GEMM of ``blocks`` (mr, nr, kc, nc, mc); the rest of the cascade (RMSNorm's sum(x**2))
    folds in its own lanes.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("rmsnorm_gemm")
    >>> geo = shape_geometry(rule, {"x": (7, 40), "w": (40, 20)})
    >>> blocks = dict(mr=2, nr=16, kc=8, nc=16, mc=4)
    >>> gemm_plan(rule, geo, "unfused", True, blocks).mc
    4
    """
    rest = without(rule, products(rule, geo))
    piece = dataclasses.replace(geo, n=blocks["kc"])  # the rest folds pieces of kc elements
    lanes = vector_lanes(rest, piece) if rest.components else 1
    why = "requested" if variant else f"{geo.r} rows hold {len(products(rule, geo))} matrix " \
                                      "product(s)"
    ranges = f" x {blocks['nt']} column ranges" if blocks.get("nt", 1) > 1 else ""
    why += f"; rows in blocks of {blocks['mc']}{ranges} in parallel, a blocked GEMM " + \
        ("per product pass" if variant == "unfused" else "with the other reductions folded "
         "in the same pass over each row")
    return CpuPlan(variant or "rolling", lanes, 1, fast_math, why,
                tile=tile_for(rest, lanes, blocks["kc"]), **blocks)


def tile_plan(rule: FusionRule, geo: Geometry, variant: str | None, fast_math: bool,
              dot: TileDot) -> CpuPlan:
    """Rolling with the matrix products on ``dot`` (``tile_gemm.py``, blocked by
    ``TILE_GEMM``); the rest of the cascade folds each whole row in its own lanes.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> from redfuser.lowering.cpu.tile_dots import TILE_DOTS
    >>> rule = redfuser.derive("rmsnorm_gemm")
    >>> geo = shape_geometry(rule, {"x": (70, 300), "w": (300, 40)})
    >>> print(tile_plan(rule, geo, None, True, TILE_DOTS[0]).details())
    , amx-bf16 tiles 32 x 32, KC 256, NC 64, MC 96, NT 1
    """
    rest = without(rule, products(rule, geo))
    lanes = vector_lanes(rest, geo) if rest.components else 1
    block = 2 * TILE_ROWS  # 2 x 2 tiles of 16 x 16 sums
    nc = min(TILE_GEMM["nc"][0], -(-geo.d // block) * block)
    why = (f"{'requested' if variant else f'{geo.r} rows hold matrix products'}; their "
           f"operands are {dot.operand} as stored: the products on {dot.name} tiles "
           f"({dot.why}), the other reductions folded in a pass over each row before")
    return CpuPlan(variant or "rolling", lanes, 1, fast_math, why,
                   tile=tile_for(rest, lanes, geo.n), mr=block, nr=block,
                   kc=TILE_GEMM["kc"][0], nc=nc, mc=-(-geo.r // block) * block, nt=1,
                   tile_dot=dot.name)
