"""Lowering: FusionRule + Geometry + Plan -> TIR PrimFunc (no runtime, no tuning).

Read top to bottom: ``geometry`` fixes the shapes of a call; ``choose`` (the target's
policy, ``backends``) picks a ``Plan`` of the target's own type (``CpuPlan``,
``CudaPlan``); ``signature`` gives the kernel's arguments; ``build_primfunc`` emits the
target's loop nest of the plan's variant, whose statements come from the ``Emitter``
(``emitter``, ``steps``, ``registers``), with sympy expressions translated by ``texpr``
and vectorizable math from ``fastmath``.
"""

from __future__ import annotations

from algebra.rule import FusionRule
from algebra.stages import StagedLowering

from .backends import BACKENDS, Backend, backend
from .cpu.plan import CpuPlan
from .cuda.plan import CudaPlan
from .geometry import Geometry, InputGeom, geometry, shape_geometry
from .plan import VARIANTS, Plan
from .primfunc import FUNC_NAME, build_primfunc
from .signature import Arg, Signature, signature
from .staged import RESIDENT
from .staged import choose as staged_choose

__all__ = ["BACKENDS", "FUNC_NAME", "VARIANTS", "Arg", "Backend", "CpuPlan", "CudaPlan",
           "Geometry", "InputGeom", "Plan", "Signature", "backend", "build_primfunc", "choose",
           "geometry", "shape_geometry", "signature"]


def choose(rule: FusionRule, geo: Geometry, variant: str | None = None,
           splits: int | None = None, threads: int | None = None, fast_math: bool = True,
           target: str = "cpu", dynamic: bool = False) -> Plan:
    """The hand-written plan of ``target`` for ``rule`` at ``geo`` (``variant``,
    ``splits`` and ``threads`` pin what the caller asked for); ``dynamic``: of one kernel
    for every row count and N (the caller has refused splits and targets without such a
    policy).

    Examples
    --------
    >>> import redfuser
    >>> rule = redfuser.derive("softmax")
    >>> choose(rule, shape_geometry(rule, {"x": (64, 1024)}), threads=2).variant
    'rolling'
    """
    if isinstance(rule, StagedLowering):  # a staged rule: its stages in one kernel
        return staged_choose(rule, geo, variant, splits, threads, fast_math, target, dynamic)
    if variant == RESIDENT:
        raise ValueError(f"variant '{RESIDENT}' runs the stages of a staged rule (derive(..., "
                         "passes='auto')); this rule has one pass")
    if dynamic:
        return backend(target).dynamic(rule, geo, variant, fast_math)
    return backend(target).choose(rule, geo, variant, splits, threads, fast_math)
