"""Row-resident plans of staged rules (``algebra.stages``): the stages run as consecutive
passes over each row inside one kernel, so a row is read from DRAM once and re-read from the
cache by the later passes, as long as it fits there.

The policy says which cache it counts on and whether the row fits (``kernel.plan``): a
thread folds one row at a time, so what a later pass re-reads is that row's share of the
streams it reads, and it stays in the core's L2 while it is no larger than
``RESIDENT_CACHE_BYTES``.  A longer row still runs row-resident (one launch, per-row results
never leave the core), but its later passes read it from L3 or DRAM again.
"""

from __future__ import annotations

from algebra.stages import StagedLowering

from .backends import BACKENDS, backend
from .cpu.plan import one_thread, vector_lanes
from .geometry import Geometry
from .plan import STAGED_VARIANT, Plan

RESIDENT = STAGED_VARIANT
# The cache a row stays in between the passes: the L2 of one core (1 MB on the Zen 5 the
# CPU plans are measured on; L1, 48 KB, holds only rows of up to 12K floats).
RESIDENT_CACHE_BYTES = 1 << 20
F32_BYTES = 4


def later_row_bytes(rule: StagedLowering, geo: Geometry) -> int:
    """Bytes of one row that the passes after the first re-read (their streams)."""
    later = set()
    for stage in rule.staged.stages[1:]:
        later |= {s.name for s in stage.rule.cascade.streams}
    return sum(geo.n * geo.inputs[k].width * F32_BYTES for k in sorted(later) if k in
               geo.inputs)


def fits(rule: StagedLowering, geo: Geometry) -> str:
    """Whether a row stays in ``RESIDENT_CACHE_BYTES`` between the passes, in words."""
    size, cache = later_row_bytes(rule, geo), RESIDENT_CACHE_BYTES
    if size <= cache:
        return (f"a row's {size / 1024:.1f} KB stay in the {cache >> 20} MB L2 between the "
                "passes: DRAM sees each row once")
    return (f"a row's {size / 2**20:.1f} MB do not fit the {cache >> 20} MB L2: the later "
            "passes re-read it from L3 or DRAM (one launch, per-row results stay in the core)")


def choose(rule: StagedLowering, geo: Geometry, variant: str | None = None,
           splits: int | None = None, threads: int | None = None, fast_math: bool = True,
           target: str = "cpu") -> Plan:
    """The plan of a staged rule: ``resident`` (the default: every stage over a row, then
    the next row) or ``unfused`` (one kernel pass per reduction over all rows, the
    baseline).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("mad").lowered()
    >>> plan = choose(rule, shape_geometry(rule, {"x": (64, 4096)}))
    >>> plan.variant, plan.reason.split("; ")[-1]
    ('resident', "a row's 16.0 KB stay in the 1 MB L2 between the passes: DRAM sees each row once")
    """
    passes = len(rule.staged.stages)
    if variant not in (None, RESIDENT, "unfused"):
        raise ValueError(f"a staged rule ({passes} passes) runs as variant '{RESIDENT}' or "
                         f"'unfused', not {variant!r}")
    if variant == "unfused":
        return backend(target).choose(rule, geo, variant, splits, threads, fast_math)
    if RESIDENT not in backend(target).variants:
        raise ValueError(f"row-resident kernels of staged rules are built for "
                         f"{sorted(k for k, b in BACKENDS.items() if RESIDENT in b.variants)}"
                         f" only, not target={target!r}")
    lanes = max(vector_lanes(s.rule, geo) for s in rule.staged.stages)
    rows = "one thread" if one_thread(geo) else "rows in parallel"
    why = "requested" if variant else f"{passes} passes over each row in one kernel"
    return Plan(RESIDENT, lanes, 1, fast_math, f"{why}; {rows}; {fits(rule, geo)}")

