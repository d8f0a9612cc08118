"""CUDA plans: the one place for the GPU's facts (SM count, shared memory, threads) and the
policy that picks threads per block and splits."""

from __future__ import annotations

from algebra.rule import FusionRule

from ..geometry import Geometry
from ..plan import Plan, check_variant
from ..registers import register_width

SMS = 132  # streaming multiprocessors of an H100/H200: blocks needed to fill the GPU
SHARED_BYTES = 48 * 1024  # static shared memory available to a block without opt-in
MAX_THREADS = 256  # threads per block the hand-written plan starts from
MIN_THREADS = 32  # one warp: never fewer
WORD_BYTES = 4  # float32 / the low word of an index: what the shared-memory state holds


def threads_for(rule: FusionRule, geo: Geometry, limit: int = MAX_THREADS) -> int:
    """Largest power of two <= limit whose shared-memory state fits."""
    words = sum(register_width(rule, geo, s) for s in rule.state)
    threads = limit
    while threads > MIN_THREADS and threads * words * WORD_BYTES > SHARED_BYTES:
        threads //= 2
    return threads


def row_in_shared(rule, geo: Geometry) -> tuple[str, ...]:
    """The streams a staged rule's block copies to shared memory: every stream its stages
    read, when one row of them and the threads' states fit ``SHARED_BYTES`` (else none:
    the stages re-read the row from global memory, through L1/L2)."""
    if not geo.static:  # a row of any length: its size is not known when building
        return ()
    names = tuple(sorted({s.name for st in rule.staged.stages for s in st.rule.cascade.streams}))
    row = sum(geo.n * geo.inputs[k].width * WORD_BYTES for k in names)
    state = threads_for(rule, geo) * sum(register_width(rule, geo, s) for s in rule.state)
    return names if row + state * WORD_BYTES <= SHARED_BYTES else ()


def resident_fit(rule, geo: Geometry, dynamic: bool = False) -> str:
    """Where a staged rule's block keeps its row between the passes, in words (``dynamic``:
    for rows of any length, re-read through the caches)."""
    if dynamic:
        return ("rows of any length: the passes re-read the row from global memory (through "
                "L1/L2; no shared-memory copy of a row whose length is not known)")
    if row_in_shared(rule, geo):
        return (f"the row is copied to shared memory ({SHARED_BYTES >> 10} KB a block) and "
                "every pass reads it there: DRAM sees each row once")
    return (f"a row does not fit the {SHARED_BYTES >> 10} KB of shared memory: the passes "
            "re-read it from global memory (through L1/L2)")


def choose(rule: FusionRule, geo: Geometry, variant: str | None = None,
           splits: int | None = None, threads: int | None = None,
           fast_math: bool = True) -> Plan:
    """One block per row, threads merged by a tree; split rows over blocks when there are
    fewer rows than SMs and each thread still gets several elements."""
    check_variant(variant)
    threads = threads_for(rule, geo)
    if variant == "unfused":
        return Plan("unfused", 1, 1, fast_math, "requested: one kernel per reduction", threads)
    few = geo.r < SMS and geo.n >= 4 * threads
    if variant == "split" or (variant is None and few):
        s = splits or min(threads, max(2, SMS // max(geo.r, 1)), max(1, geo.n // threads))
        s = max(1, min(s, threads, geo.n))
        why = "requested" if variant else f"{geo.r} rows < {SMS} SMs: split each row"
        return Plan("split", 1, s, fast_math, why, threads)
    return Plan("rolling", 1, 1, fast_math, "one block per row, threads merged by a tree",
                threads)


def dynamic_plan(rule: FusionRule, geo: Geometry, variant: str | None = None,
                 fast_math: bool = True) -> Plan:
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
    why = "requested: one kernel per reduction" if variant == "unfused" else "any rows and N"
    return Plan(variant or "rolling", 1, 1, fast_math, f"{why}; one block per row, threads "
                "merged by a tree", threads_for(rule, geo), dynamic=True)
