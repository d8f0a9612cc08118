"""The schedule space: which plan parameters apply to a rule at a geometry, and their values.

Every candidate is a plan of the target's type (``Backend.plan_type``), whose fields but
``fast_math``, ``reason`` and ``dynamic`` are what a tuning record holds; the space is
derived from the rule and the shapes, never listed per workload.  CPU (``llvm``):

==========  ===================  =====================================================
parameter   variants             applies when / values
==========  ===================  =====================================================
variant     -                    rolling (rows in parallel), split (pieces of rows in
                                 parallel, combined with the merge; when N holds two
                                 pieces of 32), unfused (one pass per reduction)
lanes       all                  every state is a per-row scalar (``vector_lanes``):
                                 1, 4, 8, 16, 32 (with 2 x lanes <= N); else 1.  The
                                 unfused baseline: when one of its stages can vectorize
tile        all                  elements per lane folded at fixed anchors before a merge:
                                 a component is re-anchored (1, 2, 4, 8, 16 with lanes,
                                 1, 4, 8, 16, 32 in one lane), or lanes > 1 (then
                                 {1, hand-written}: an unroll), or rows are blocked
splits      split                2, 4, ... 64 and the hand-written choice, each piece
                                 of 32 elements or more (and two tiles)
row_block   rolling, unfused     rows folded together sharing each load: one lane, a
                                 stream broadcast across rows with a feature axis that
                                 fills whole vectors (``CpuPlan.row_block``, when the
                                 lowering has it): 1, 2, 4, 8 with every thread a block
mr, nr, kc  rolling, unfused     the rule holds matrix products (``lowering.products``)
                                 worth a GEMM (``cpu.plan.gemm_blocks``): micro-kernel
                                 rows 4, 6, 8 and columns 16, 32, 64 within the vector
                                 registers, K blocks 128, 256, 512 (at most N); nc, mc
                                 and nt, and the lanes and tile of the rest of the
                                 cascade (RMSNorm's sum(x**2)), as the policy has them
==========  ===================  =====================================================

CUDA: variant; ``threads`` per block (powers of two from 32 up to what the shared-memory
state allows); ``splits`` for split.  ``fast_math`` is not searched: it changes results.
The hand-written plan (``lowering.choose``) is always in the space.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, fields

import numpy as np

from ..lowering import VARIANTS, Geometry, Plan, backend, choose
from ..lowering.plan import Param
from ..tvm.target import default_threads

UNSEARCHED = ("fast_math", "reason", "dynamic")  # a plan's fields no tuning record holds


@dataclass(frozen=True)
class Space:
    """The parameters of each variant for one rule, geometry and target."""

    target: str
    geo: Geometry
    variants: dict[str, tuple[Param, ...]]
    fast_math: bool = True
    default: Plan | None = None  # the hand-written plan (always a candidate)

    def candidates(self) -> list[Plan]:
        """Every valid plan of the space, the hand-written one first."""
        out = [self.default] if self.default is not None else []
        for variant, params in self.variants.items():
            names = [p.name for p in params]
            for values in itertools.product(*(p.values for p in params)):
                plan = plan_from_params({"variant": variant, **dict(zip(names, values,
                                                                        strict=True))},
                                        self.fast_math, "candidate", self.target)
                if _valid(plan, self.geo, self.target) and not any(same_plan(plan, o) for o in out):
                    out.append(plan)
        return out

    def why_not(self, plan: Plan) -> str | None:
        """Why ``plan`` is not a candidate of this space (None: it is one), naming the
        first parameter whose value is out of the space.

        Examples
        --------
        >>> import redfuser
        >>> from redfuser.lowering import shape_geometry
        >>> rule = redfuser.derive("softmax")
        >>> s = space(rule, shape_geometry(rule, {"x": (32, 256)}))
        >>> from redfuser.lowering import CpuPlan, CudaPlan
        >>> s.why_not(CpuPlan("rolling", 1, row_block=1000))
        'row_block=1000 is not in the space of rolling here (1)'
        >>> s.why_not(CudaPlan("rolling", threads=256))
        'a CudaPlan is not a plan of target cpu (its plans are CpuPlan)'
        >>> s.why_not(s.candidates()[-1]) is None
        True
        """
        # what ``candidates`` enumerates, decided without enumerating (which takes 0.1 s)
        kind = backend(self.target).plan_type
        if type(plan) is not kind:
            return (f"a {type(plan).__name__} is not a plan of target {self.target} (its "
                    f"plans are {kind.__name__})")
        if self.default is not None and same_plan(plan, self.default):
            return None
        params = self.variants.get(plan.variant)
        if params is None:
            return (f"variant {plan.variant} is not in the space here (only "
                    f"{', '.join(self.variants)})")
        values = {p.name: p.values for p in params}
        defaults = {f.name: f.default for f in fields(kind)}
        for name in searched(kind)[1:]:  # [0]: the variant
            allowed = values.get(name, (defaults[name],))
            if getattr(plan, name) not in allowed:
                return (f"{name}={getattr(plan, name)} is not in the space of {plan.variant} "
                        f"here ({', '.join(map(str, allowed))})")
        if plan.fast_math != self.fast_math:
            return f"fast_math={plan.fast_math}, but this space has fast_math={self.fast_math}"
        if not _valid(plan, self.geo, self.target):
            return ("its parameters together break a constraint of the space (a tile must "
                    "fit the stream and the registers, a split piece must hold two tiles, a "
                    "GEMM micro-kernel must fit the vector registers)")
        return None

    def __str__(self) -> str:
        lines = [f"schedule space ({self.target}, rows {self.geo.r}, N {self.geo.n}, "
                 f"D {self.geo.d}): {len(self.candidates())} candidates"]
        for variant, params in self.variants.items():
            lines.append(f"  {variant}:")
            lines += [f"    {p.name:<9} {', '.join(map(str, p.values)):<18} {p.why}"
                      for p in params]
        return "\n".join(lines)


def space(rule, geo: Geometry, target: str = "cpu", fast_math: bool = True,
          variants: tuple[str, ...] | None = None, threads: int | None = None) -> Space:
    """The schedule space of ``rule`` at ``geo`` (see the module docstring).

    Examples
    --------
    >>> import redfuser
    >>> rule = redfuser.derive("softmax")
    >>> from redfuser.lowering import shape_geometry
    >>> s = space(rule, shape_geometry(rule, {"x": (64, 1024)}))
    >>> [p.name for p in s.variants["rolling"]], len(s.candidates()) > 20
    (['lanes', 'tile'], True)
    """
    variants = variants or VARIANTS
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variant(s) {sorted(unknown)}; choose from {VARIANTS}")
    threads = threads or default_threads()
    table = backend(target).params
    found = {v: table(rule, geo, v, threads) for v in variants}
    default = choose(rule, geo, target=target, fast_math=fast_math, threads=threads)
    keep = default.variant in variants
    return Space(target, geo, {v: p for v, p in found.items() if p is not None}, fast_math,
                 dataclasses.replace(default, reason="hand-written") if keep else None)


def _valid(plan: Plan, geo: Geometry, target: str = "cpu") -> bool:
    """Constraints between parameters: the target's own (``Backend.plan_fits``: a tile
    fits the caches, a GEMM micro-kernel the registers), a step of the fold
    (``Plan.span``: a CPU tile) fits the stream, a split piece holds two."""
    if not backend(target).plan_fits(plan):
        return False
    if plan.span > geo.n:
        return plan.span == 1
    return plan.variant != "split" or geo.n // plan.splits >= 2 * plan.span


def same_plan(a: Plan, b: Plan) -> bool:
    """Do two plans build the same kernel (the ``reason`` aside)?"""
    return type(a) is type(b) and plan_params(a) == plan_params(b) and a.fast_math == b.fast_math


def searched(kind: type[Plan]) -> tuple[str, ...]:
    """The fields of plan type ``kind`` a tuning record holds, the variant first.

    Examples
    --------
    >>> from redfuser.lowering import backend
    >>> searched(backend("cuda").plan_type)
    ('variant', 'lanes', 'splits', 'threads', 'mc', 'nc', 'kc', 'mr', 'nr')
    """
    return tuple(f.name for f in fields(kind) if f.name not in UNSEARCHED)


def plan_params(plan: Plan) -> dict[str, object]:
    """The searched parameters of a plan, as stored in the tuning database.

    Examples
    --------
    >>> from redfuser.lowering import CpuPlan
    >>> plan_params(CpuPlan("rolling", 16, tile=8))["tile"]
    8
    """
    return {k: getattr(plan, k) for k in searched(type(plan))}


def plan_from_params(params: dict, fast_math: bool = True, reason: str = "",
                     target: str = "cpu") -> Plan:
    """A plan of ``target``'s type (``Backend.plan_type``) from explicit parameters (a
    database record, a CLI request).  A field of the flat plan older redfusers stored in
    every record that this type lacks (``Plan.retired``: ``threads`` in a CPU record) is
    read and dropped while it holds the value it held for this target, and refused,
    named, otherwise.

    Examples
    --------
    >>> plan_from_params({"variant": "split", "lanes": 16, "splits": 4}).splits
    4
    >>> plan_from_params({"variant": "rolling", "tile": 1, "threads": 128}, target="cuda")
    CudaPlan(variant='rolling', lanes=1, splits=1, fast_math=True, reason='', dynamic=False, \
threads=128, mc=0, nc=0, kc=0, mr=0, nr=0)
    >>> try:
    ...     plan_from_params({"variant": "rolling", "tiles": 8})
    ... except ValueError as e:
    ...     print(str(e)[:42])
    unknown plan parameter(s) ['tiles']; known
    >>> try:
    ...     plan_from_params({"variant": "rolling", "tile": 8}, target="cuda")
    ... except ValueError as e:
    ...     print(e)
    plan parameter tile=8: a cuda plan (CudaPlan) has no tile; a record may hold it only as 1
    """
    kind = backend(target).plan_type
    have = searched(kind)
    unknown = sorted(set(params) - set(have) - set(kind.retired))
    if unknown:
        raise ValueError(f"unknown plan parameter(s) {unknown}; known: {', '.join(have)}")
    if params.get("variant") not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {params.get('variant')!r}")
    defaults = {f.name: f.default for f in fields(kind)}
    for k, v in params.items():
        if k == "variant":
            continue
        if isinstance(defaults.get(k), str):  # a name (``CpuPlan.tile_dot``): the type checks it
            if not isinstance(v, str):
                raise ValueError(f"plan parameter {k} must be a name, not {v!r}")
            continue
        if not isinstance(v, int | np.integer) or isinstance(v, bool):
            raise ValueError(f"plan parameter {k} must be a positive integer, not {v!r}")
        if k in kind.retired and v not in kind.retired[k]:
            raise ValueError(f"plan parameter {k}={v}: a {target} plan ({kind.__name__}) has "
                             f"no {k}; a record may hold it only as "
                             f"{' or '.join(map(str, kind.retired[k]))}")
        if k in defaults and v < min(defaults[k], 1):  # a default of 0: none (no GEMM)
            raise ValueError(f"plan parameter {k} must be a positive integer, not {v!r}")
    return kind(**{k: (v if isinstance(v, str) else int(v)) for k, v in params.items()
                   if k in have},
                fast_math=fast_math, reason=reason)
