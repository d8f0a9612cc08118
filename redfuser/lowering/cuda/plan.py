"""CUDA plans: the one place for the GPU's facts (``GPU``: SM count, shared memory, warp),
the plan type (``CudaPlan``: threads per block, GEMM tiles) and the policy that picks
threads per block and splits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from algebra.rule import FusionRule

from ..geometry import Geometry
from ..plan import Plan, check_variant
from ..products import products
from ..registers import register_width


@dataclass(frozen=True)
class Gpu:
    """The facts of the GPU redfuser compiles for (``Backend.gpu``)."""

    arch: str  # what redfuser compiles CUDA for (and names a GPU it cannot query)
    sms: int  # streaming multiprocessors: blocks needed to fill the GPU
    sm_threads: int  # resident threads per SM
    sm_blocks: int  # resident blocks per SM
    warp: int  # threads of a warp: a block never has fewer
    block_threads: int  # the most threads a block may have
    shared_bytes: int  # static shared memory available to a block without opt-in
    sync_s: float  # one block-wide barrier, seconds
    # nominal figures for the cost model until a device run measures better ones: bytes/s,
    # seconds per op and per exp per element-thread, launch seconds
    nominal: tuple[float, float, float, float]


GPU = Gpu("sm_90", 132, 2048, 32, 32, 1024, 48 * 1024, 2e-8,  # H100/H200-class parts
          (3.3e12, 1.0 / 6.0e13, 4.0 / 6.0e13, 4e-6))
MAX_THREADS = 256  # threads per block the hand-written plan starts from
WORD_BYTES = 4  # float32 / the low word of an index: what the shared-memory state holds
# The tiled GEMM of a rule's matrix products (``gemm.py``): (value, why).  A block computes
# an MC x NC tile of the output with (MC / MR) x (NC / NR) threads, each MR x NR sums in
# registers; K in slices of KC staged in shared memory (A: MC x KC, W: KC x NC words).
GEMM = {
    "mc": (64, "output rows per block: 4 row tiles of a 256-row GEMM"),
    "nc": (64, "output columns per block: 256 blocks for 256 x 4096, about 2 per SM"),
    "kc": (16, "K per shared-memory slice: (64 + 64) x 16 words = 8 KB a block"),
    "mr": (4, "rows of sums per thread"),
    "nr": (4, "columns of sums per thread: 16 sums, 8 shared loads per 16 multiply-adds"),
}


@dataclass(frozen=True, kw_only=True)
class CudaPlan(Plan):
    """A CUDA plan: the shared fields (``lanes`` is always 1: the threads of a block share
    a row), the threads per block and the tiles of a rule's matrix products (``GEMM``,
    ``gemm.py``; 0: none).

    Examples
    --------
    >>> print(CudaPlan("split", splits=8, threads=128, reason="few rows"))
    split (1 lanes, 8 splits): few rows
    >>> CudaPlan("rolling", tile=8)
    Traceback (most recent call last):
    ...
    TypeError: CudaPlan.__init__() got an unexpected keyword argument 'tile'
    """

    threads: int = 1  # threads per block, their states combined by a shared-memory merge tree
    # matrix products: a block computes an mc x nc tile of the output, each of its threads
    # mr x nr sums in registers; K in slices of kc staged in shared memory
    mc: int = 0
    nc: int = 0
    kc: int = 0
    mr: int = 0
    nr: int = 0

    hidden: ClassVar[frozenset[str]] = frozenset({"lanes"})  # always 1
    terse: ClassVar[frozenset[str]] = frozenset(GEMM)
    # the CPU's fields at their defaults; nt: the tiled GEMM's plans held 1, never read
    retired: ClassVar[Mapping[str, tuple[int, ...]]] = {
        "tile": (1,), "row_block": (1,), "nt": (0, 1)}

    def details(self) -> str:
        return (f", GEMM tiles of {self.mc} x {self.nc} a block, {self.mr} x {self.nr} sums a "
                f"thread, K slices of {self.kc}" if self.mr else "")


def threads_for(rule: FusionRule, geo: Geometry, limit: int = MAX_THREADS) -> int:
    """Largest power of two <= limit whose shared-memory state fits."""
    words = sum(register_width(rule, geo, s) for s in rule.state)
    threads = limit
    while threads > GPU.warp and threads * words * WORD_BYTES > GPU.shared_bytes:
        threads //= 2
    return threads


def fits(rule: FusionRule, geo: Geometry) -> bool:
    """Do one warp's states fit a block's shared memory (``check_fits``)?"""
    words = sum(register_width(rule, geo, s) for s in rule.state)
    return GPU.warp * words * WORD_BYTES <= GPU.shared_bytes


def check_fits(rule: FusionRule, geo: Geometry) -> None:
    """Refuse a rule whose per-thread state is too wide for one warp's states to fit the
    shared memory of a block (the tree merge keeps every thread's state there), naming the
    widest state; a matrix product's wide state runs as a tiled GEMM instead (``choose``).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("attention")
    >>> geo = shape_geometry(rule, {"q": (2, 1, 8192), "k": (1, 16, 8192),
    ...                             "v": (1, 16, 8192), "scale": (1, 1)})
    >>> try:
    ...     check_fits(rule, geo)
    ... except ValueError as e:
    ...     print(str(e)[:60])
    the state of 'attention' is 8194 words a thread: 32 threads'
    """
    if not fits(rule, geo):
        widths = {s.symbol.name: register_width(rule, geo, s) for s in rule.state}
        words = sum(widths.values())
        widest = max(widths, key=widths.get)
        what = repr(rule.name) if rule.name else "the cascade"  # a lifted one has no name
        raise ValueError(
            f"the state of {what} is {words} words a thread: {GPU.warp} threads' "
            f"states exceed the {GPU.shared_bytes >> 10} KB of shared memory a block merges them "
            f"in (widest: '{widest}', {widths[widest]} words); only a matrix product's wide "
            "state runs on CUDA (as a tiled GEMM, variant rolling or unfused)")


def row_in_shared(rule, geo: Geometry) -> tuple[str, ...]:
    """The streams a staged rule's block copies to shared memory: every stream its stages
    read, when one row of them and the threads' states fit ``GPU.shared_bytes`` (else none:
    the stages re-read the row from global memory, through L1/L2)."""
    if not geo.static:  # a row of any length: its size is not known when building
        return ()
    names = tuple(sorted({s.name for st in rule.staged.stages for s in st.rule.cascade.streams}))
    row = sum(geo.n * geo.inputs[k].width * WORD_BYTES for k in names)
    state = threads_for(rule, geo) * sum(register_width(rule, geo, s) for s in rule.state)
    return names if row + state * WORD_BYTES <= GPU.shared_bytes else ()


def resident_fit(rule, geo: Geometry, dynamic: bool = False) -> str:
    """Where a staged rule's block keeps its row between the passes, in words (``dynamic``:
    for rows of any length, re-read through the caches)."""
    if dynamic:
        return ("rows of any length: the passes re-read the row from global memory (through "
                "L1/L2; no shared-memory copy of a row whose length is not known)")
    if row_in_shared(rule, geo):
        return (f"the row is copied to shared memory ({GPU.shared_bytes >> 10} KB a block) and "
                "every pass reads it there: DRAM sees each row once")
    return (f"a row does not fit the {GPU.shared_bytes >> 10} KB of shared memory: the passes "
            "re-read it from global memory (through L1/L2)")


def choose(rule: FusionRule, geo: Geometry, variant: str | None = None,
           splits: int | None = None, threads: int | None = None,
           fast_math: bool = True) -> CudaPlan:
    """One block per row, threads merged by a tree; split rows over blocks when there are
    fewer rows than SMs and each thread still gets several elements."""
    check_variant(variant)
    if products(rule, geo) and variant != "split":
        return gemm_plan(rule, geo, variant, fast_math)
    check_fits(rule, geo)
    threads = threads_for(rule, geo)
    if variant == "unfused":
        return CudaPlan("unfused", 1, 1, fast_math, "requested: one kernel per reduction",
                        threads=threads)
    few = geo.r < GPU.sms and geo.n >= 4 * threads
    if variant == "split" or (variant is None and few):
        s = splits or min(threads, max(2, GPU.sms // max(geo.r, 1)), max(1, geo.n // threads))
        s = max(1, min(s, threads, geo.n))
        why = "requested" if variant else f"{geo.r} rows < {GPU.sms} SMs: split each row"
        return CudaPlan("split", 1, s, fast_math, why, threads=threads)
    return CudaPlan("rolling", 1, 1, fast_math, "one block per row, threads merged by a tree",
                    threads=threads)


def gemm_plan(rule: FusionRule, geo: Geometry, variant: str | None,
              fast_math: bool) -> CudaPlan:
    """Rolling or unfused (``variant``; None: rolling) with the matrix products as the tiled
    GEMM of ``GEMM``; the rest of the cascade folds per row beside it (``gemm.py``).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("rmsnorm_gemm")
    >>> print(gemm_plan(rule, shape_geometry(rule, {"x": (256, 4096), "w": (4096, 4096)}),
    ...                 None, True))  # doctest: +NORMALIZE_WHITESPACE
    rolling (1 lanes, GEMM tiles of 64 x 64 a block, 4 x 4 sums a thread, K slices of 16): 256
    rows hold 1 matrix product(s): tiles of 64 x 64 outputs a block, the other reductions in
    a launch of their own
    """
    blocks = {k: v for k, (v, _) in GEMM.items()}
    threads = (blocks["mc"] // blocks["mr"]) * (blocks["nc"] // blocks["nr"])
    why = "requested" if variant else f"{geo.r} rows hold {len(products(rule, geo))} matrix " \
                                      "product(s)"
    why += f": tiles of {blocks['mc']} x {blocks['nc']} outputs a block, the other " + \
        ("reductions unfused before them" if variant == "unfused" else
         "reductions in a launch of their own")
    return CudaPlan(variant or "rolling", 1, 1, fast_math, why, threads=threads, **blocks)


def dynamic_plan(rule: FusionRule, geo: Geometry, variant: str | None = None,
                 fast_math: bool = True) -> CudaPlan:
    """The plan of a kernel for every row count and N (``Plan.dynamic``): one block per row
    (the grid's size is the row count, read from the arguments), the threads striding over
    a row of any length; no split (its pieces depend on N), no row copied to shared memory
    (its size depends on N).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> plan = dynamic_plan(rule, shape_geometry(rule, {"x": (3, 5)}))
    >>> plan.variant, plan.threads, plan.dynamic
    ('rolling', 256, True)
    """
    check_variant(variant, dynamic=True)
    check_fits(rule, geo)
    why = "requested: one kernel per reduction" if variant == "unfused" else "any rows and N"
    return CudaPlan(variant or "rolling", 1, 1, fast_math, f"{why}; one block per row, "
                    "threads merged by a tree", threads=threads_for(rule, geo), dynamic=True)
