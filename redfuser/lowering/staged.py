"""Row-resident plans of staged rules (``algebra.stages``): the stages run as consecutive
passes over each row inside one kernel, so a row is read from DRAM once and re-read from the
cache by the later passes, as long as it fits there.

The plan starts from the target's own (lanes and tiles on a CPU, threads per block on
CUDA) and says where the row stays between the passes and whether it fits
(``kernel.plan``), from the target's ``resident_fit``: a CPU core's L2 (``cpu/resident.py``), a
CUDA block's shared memory (``cuda/plan.py``).  A row that does not fit still runs
row-resident (one launch, per-row results never leave the core or block), but its later
passes read it again from further out.
"""

from __future__ import annotations

import dataclasses

from algebra.stages import StagedLowering

from .backends import backend
from .geometry import Geometry
from .plan import STAGED_VARIANT, Plan

RESIDENT = STAGED_VARIANT


def choose(rule: StagedLowering, geo: Geometry, variant: str | None = None,
           splits: int | None = None, threads: int | None = None, fast_math: bool = True,
           target: str = "cpu", dynamic: bool = False) -> Plan:
    """The plan of a staged rule: ``resident`` (the default: every stage over a row, then
    the next row) or ``unfused`` (one kernel pass per reduction over all rows, the
    baseline); ``dynamic``: for every row count and N, from the target's dynamic policy.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("mad").lowered()
    >>> plan = choose(rule, shape_geometry(rule, {"x": (64, 4096)}))
    >>> plan.variant, plan.reason.split("; ")[-1].split(" L2")[1]  # the host's L2 size before
    ('resident', ' between the passes: DRAM sees each row once')
    """
    passes = len(rule.staged.stages)
    if variant not in (None, RESIDENT, "unfused"):
        raise ValueError(f"a staged rule ({passes} passes) runs as variant '{RESIDENT}' or "
                         f"'unfused', not {variant!r}")
    b = backend(target)
    target_plan = b.dynamic(rule, geo, "unfused", fast_math) if dynamic else \
        b.choose(rule, geo, "unfused", splits, threads, fast_math)
    if variant == "unfused":
        return target_plan
    why = "requested" if variant else f"{passes} passes over each row in one kernel"
    fit = b.resident_fit(rule, geo, dynamic)
    return dataclasses.replace(target_plan.row_by_row(), variant=RESIDENT,
                               reason=f"{why}; {fit}")

