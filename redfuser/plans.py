"""One door from a rule to its plan: every caller (``compile``/``Kernel``, the TensorIR
rewrite, the Relax pass) asks ``plan_for``, so one policy decides everywhere.

The sources, in order: the tuning database's measured plan for this spec, shape, target
and machine (searched first with ``tune=True``), the cost model's first choice
(``tune="model"``, for a shape the database lacks), else the target's hand-written policy
(``lowering.choose``).  Pinning ``variant``, ``splits`` or ``threads``, a staged rule (the
tuner searches one-pass plans) and ``dynamic`` (one kernel for every shape) go straight to
the hand-written policy; ``tune=False`` ignores the database.  It sits above both
``lowering`` (which knows nothing of tuning) and ``tune``.
"""

from __future__ import annotations

from dataclasses import dataclass

from algebra.rule import FusionRule
from algebra.stages import StagedLowering

from .lowering import Geometry, Plan, choose
from .tune.db import TuningDB
from .tune.measure import Measure
from .tune.search import model_plan, tuned_plan

TUNE_MODES = (None, True, False, "model")  # read the database, search, ignore it, cost model
DATABASE, COST_MODEL, HAND_WRITTEN = "tuning database", "cost model", "hand-written policy"


@dataclass(frozen=True)
class Choice:
    """A plan and the source that decided it (``DATABASE``, ``COST_MODEL`` or
    ``HAND_WRITTEN``; the plan's ``reason`` says why within that source)."""

    plan: Plan
    source: str

    @property
    def tuned(self) -> bool:
        """Whether tuning chose it: such a plan may be stale, and a caller whose build of it
        fails falls back to the hand-written plan."""
        return self.source != HAND_WRITTEN


def plan_for(rule: FusionRule, geo: Geometry, target: str = "cpu", *,
             variant: str | None = None, splits: int | None = None,
             threads: int | None = None, fast_math: bool = True, dynamic: bool = False,
             tune: bool | str | None = None, db: TuningDB | None = None,
             measure: Measure | None = None) -> Choice:
    """The plan of ``rule`` at ``geo`` for ``target`` and the source that decided it
    (module docstring); ``tune`` as ``compile``'s (one of ``TUNE_MODES``), ``db`` the
    tuning database (None: the user's), ``measure`` how a search times a candidate.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> geo = shape_geometry(rule, {"x": (64, 1024)})
    >>> choice = plan_for(rule, geo, variant="split", splits=4)
    >>> choice.source, choice.plan.splits, choice.tuned
    ('hand-written policy', 4, False)
    """
    pinned = any(v is not None for v in (variant, splits, threads))
    staged = isinstance(rule, StagedLowering)
    if tune is not False and not pinned and not staged and not dynamic:
        plan = tuned_plan(rule, geo, target, fast_math, search=tune is True, db=db,
                          measure=measure)
        if plan is not None:
            return Choice(plan, DATABASE)
        if tune == "model":
            return Choice(model_plan(rule, geo, target, fast_math), COST_MODEL)
    return Choice(hand_written(rule, geo, target, variant=variant, splits=splits,
                               threads=threads, fast_math=fast_math, dynamic=dynamic),
                  HAND_WRITTEN)


def hand_written(rule: FusionRule, geo: Geometry, target: str = "cpu", *,
                 variant: str | None = None, splits: int | None = None,
                 threads: int | None = None, fast_math: bool = True,
                 dynamic: bool = False) -> Plan:
    """The target's hand-written plan (``lowering.choose``): what ``plan_for`` falls back
    to, and what a caller builds when a tuned plan does not build."""
    return choose(rule, geo, variant, splits, threads, fast_math, target, dynamic)
