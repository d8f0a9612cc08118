"""``compile`` and ``Kernel``: a proven rule as a callable, specialised per shape.

Calling convention (the algebra engine's): any number of row axes broadcasting like
numpy (attention's K and V of shape (H, 1, N, D) are read once per head, never
copied per query), streams (*rows, N[, D]), parameters scalars or (*rows[, D]);
outputs (*rows[, D or k]) and per-element outputs (*rows, N[, D]).  Inputs are
passed to TVM without a copy when they are contiguous (numpy arrays or
any DLPack tensor such as torch's), and outputs are views of the buffers the kernel
wrote, of the inputs' kind (``call.py``); ``out=`` takes preallocated ones.  Kernels
are specialised per input signature: the first call with new shapes compiles (tens of
milliseconds), later calls only look the signature up (``CallPlan``).
With ``dynamic=True`` one kernel serves every row count and stream length: rows and N
are TIR shape variables (``lowering.geometry.symbolic_geometry``), so a call with new
lengths reuses the build; ``kernel.builds`` counts compilations.
The plan of a new geometry comes from the tuning database when it has one (``tune``:
None reads it, True also searches a missing shape, "model" takes the cost model's first
choice for a missing shape without measuring, False ignores the database;
``redfuser.tune``), else from the target's hand-written policy (``lowering.choose``):
``plans.plan_for`` decides, as it does for the TensorIR and Relax rewrites.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from numbers import Number, Real

import numpy as np

from algebra import FusionRule, StagedRule, derive
from algebra.cascade import LENGTH
from algebra.dtypes import ARRAYS, COMPUTES, array_dtype, compute_of
from algebra.layout import resolve

from .call import CallPlan, call_plan, in_kind, input_arrays, output_arrays
from .call_key import input_key
from .kernel_options import (
    check_dynamic,
    check_options,
    compute_dtype_of,
    kept_results,
    out_dtype_of,
)
from .lowering import Geometry, Plan, backend, geometry
from .lowering.geometry import dynamic_key, fits
from .out_arrays import given_outputs
from .plans import hand_written, plan_for
from .runtime import Built, allocate_outputs, build, random_inputs, time_built
from .runtime import input_tensors as layout_tensors
from .tvm.cuda import cuda_source
from .tvm.runtime import from_numpy, host_source

# Executables a Kernel keeps (least recently used evicted): each holds ~1.6 MB of JIT code
# (80 softmax shapes: +128 MB), and a recompile costs ~0.2 s.  32 holds a model's few
# shapes plus one schedule search's candidates (top 4, one per variant, the hand-written
# plan), which are timed in interleaved rounds and must not evict each other.
MAX_CACHED = 32


def compile(rule_or_spec: FusionRule | StagedRule | str, target: str = "cpu",  # noqa: A001
            **options) -> Kernel:
    """Compile a fusion rule (or a spec / library name) into a TVM kernel.

    A staged rule (``derive(..., passes="auto")``, or a library cascade that needs stages)
    becomes ONE kernel that runs its stages as consecutive passes over each row while the
    row is in cache (variant "resident"; ``kernel.plan`` says whether the row fits).

    Options: ``variant`` ("rolling", "split", "unfused"; default: chosen per shape by
    the target's policy), ``splits``, ``fast_math`` (polynomial exp; default True),
    ``threads``; ``plan`` (a ``lowering.Plan``) fixes every parameter for every shape;
    ``outputs`` (names; default all) the outputs a call returns: the per-row results not
    named stay inside the kernel (``softmax`` with ``outputs=("y",)`` writes y alone), and
    every per-element output must be named (the pass that writes it is the rule's).
    Only proven rules reach this point: ``derive`` refuses the rest.

    Schedules (``tune``): each new shape first looks in the tuning database (written by
    ``redfuser tune`` or an earlier ``tune=True``; see ``redfuser.tune``) and uses the
    measured best plan stored there for this spec, shape, target and machine; without an
    entry, the hand-written policy decides.  ``tune=True`` searches a shape that has no
    entry (the cost model ranks the schedule space, the best few candidates are
    measured, the fastest is stored): seconds per new shape, once per machine.
    ``tune="model"`` takes the cost model's first choice (variant included) without
    measuring anything.  ``tune=False`` never reads the database; pinning ``variant``,
    ``splits`` or ``threads`` also bypasses it.  A corrupt database is ignored with a
    warning.

    Dtypes (``algebra.dtypes``): inputs may be float32, bfloat16, float16 or float64 (numpy,
    ml_dtypes or torch arrays), each its own; a kernel computes in float64 where an input
    is float64, else in float32, unless ``compute_dtype`` ("float32" or "float64") says
    otherwise (the rule and its proof do not change; a float64 input of a float32 kernel
    is rounded as it is loaded).  Per-element outputs and feature-vector results
    (attention's ``o``, a GEMM cascade's ``y``: ``signature.stored_results``) are stored as
    the streams are (rounded to nearest even) unless ``out_dtype`` says otherwise, and
    ``out=`` arrays must have that dtype; per-row statistics are stored in the compute
    dtype, indices in int64.  A float64 kernel runs the generic nests (the GEMM
    micro-kernel and score tiles are float32's) on the CPU only.

    ``dynamic=True`` (CPU and CUDA): one build per row rank, D and broadcast pattern serves
    every row count and N (the plan says "dynamic shapes"; no split, row blocks, GEMM
    blocking, stash or tuning database: per-shape kernels stay the default where those pay).

    Examples
    --------
    >>> import numpy as np, redfuser
    >>> k = redfuser.compile("softmax")
    >>> out = k(x=np.array([[0.0, 1.0, 2.0]], np.float32))
    >>> np.round(out["y"], 4)
    array([[0.09  , 0.2447, 0.6652]], dtype=float32)
    >>> k = redfuser.compile("softmax", dynamic=True)
    >>> [k(x=np.ones((r, n), np.float32))["d"].shape for r, n in ((2, 5), (3, 100))]
    [(2,), (3,)]
    >>> k.builds
    1
    """
    rule = rule_or_spec if isinstance(rule_or_spec, (FusionRule, StagedRule)) else \
        derive(rule_or_spec)
    return Kernel(rule.lowered() if isinstance(rule, StagedRule) else rule, target, **options)


class Kernel:
    """A compiled fusion rule: ``kernel(**inputs) -> dict[str, np.ndarray]``."""

    def __init__(self, rule: FusionRule, target: str = "cpu", variant: str | None = None,
                 splits: int | None = None, fast_math: bool = True, threads: int | None = None,
                 tune: bool | str | None = None, plan: Plan | None = None,
                 dynamic: bool = False, outputs=None, out_dtype=None, compute_dtype=None):
        self.backend = backend(target)
        self.out_dtype = out_dtype_of(out_dtype)
        self.compute_dtype = compute_dtype_of(compute_dtype, self.backend)  # None: the inputs'
        check_options(self.backend, variant, splits, fast_math, threads, tune, plan)
        self.keep = kept_results(rule, outputs)  # None: every output
        if not isinstance(dynamic, bool):
            raise TypeError(f"dynamic must be True or False, not {dynamic!r}")
        if dynamic:
            check_dynamic(rule, self.backend, variant, splits, tune, plan)
            plan = plan and dataclasses.replace(plan, dynamic=True)
        self.dynamic, self.builds = dynamic, 0  # builds: compilations so far
        self.rule, self.target, self.tune, self.fixed_plan = rule, target, tune, plan
        self.options = {"variant": variant, "splits": splits, "fast_math": fast_math,
                        "threads": threads}
        self._cache: OrderedDict[tuple, Built] = OrderedDict()  # (geometry, plan): LRU
        self._calls: OrderedDict[tuple, CallPlan] = OrderedDict()  # input signature: LRU
        self._last: Built | None = None
        self._recent: CallPlan | None = None  # the last call's plan, most recent in _calls

    # Step 1. Check the inputs ---------------------------------------------------------
    def _layout(self, inputs: dict):
        """The inputs checked and resolved: arrays kept in their dtype, numbers converted
        to the compute dtype (a float64 temperature stays float64 in a float64 kernel)."""
        kinds = []
        for name, value in inputs.items():
            if name == LENGTH or isinstance(value, Number) or not hasattr(value, "dtype"):
                continue  # N is a count, checked as one by the layout
            kind = array_dtype(value.dtype)
            if kind is None:
                raise TypeError(f"input '{name}' has dtype {value.dtype}; kernels read "
                                f"{', '.join(ARRAYS)} (float64 computes in float64)")
            kinds.append(kind)
        wide = COMPUTES[self.compute_dtype or compute_of(kinds).name].numpy
        # a number is a value, not an array of its own dtype (Python's float is float64)
        values = {k: np.asarray(v, wide) if k != LENGTH and isinstance(v, Real) and
                  not isinstance(v, bool) else v for k, v in inputs.items()}
        layout = resolve(self.rule.cascade, values, dtype=wide, keep=frozenset(ARRAYS))
        _check_feature_axis(layout, inputs)
        return layout

    def _geometry(self, layout) -> Geometry:
        return geometry(self.rule, layout, self.out_dtype, self.compute_dtype)

    def geometry(self, **inputs) -> Geometry:
        """The shapes of a call on ``inputs`` (checked as a call checks them)."""
        return self._geometry(self._layout(inputs))

    # Step 2. Compile for this geometry (cached) ---------------------------------------
    def _compiled(self, geo: Geometry, plan: Plan | None = None) -> Built:
        if 0 in geo.rows:  # TVM refuses zero-sized buffers (with a message about strides)
            raise ValueError(f"no rows (row axes {geo.rows}): a call returns empty outputs "
                             "without a kernel; there is nothing to compile or time")
        plan = plan or self.fixed_plan
        if plan is not None:
            return self._build(geo, plan)
        plan, tuned = self._plan(geo)
        try:
            return self._build(geo, plan)
        except Exception as e:  # noqa: BLE001 - a stale tuning record never stops us
            if not tuned:
                raise
            warnings.warn(f"redfuser: the tuned plan ({plan}) does not build here "
                          f"({type(e).__name__}); using the hand-written plan",
                          RuntimeWarning, stacklevel=2)
            return self._build(geo, self._hand_written(geo))

    def _build(self, geo: Geometry, plan: Plan) -> Built:
        key = (self._dynamic_key(geo, plan) if plan.dynamic else geo.key(), plan)
        if key not in self._cache:
            self._cache[key] = build(self.rule, geo, plan, self.target, keep=self.keep)
            self.builds += 1
            _evict(self._cache)
        self._cache.move_to_end(key)
        self._last = self._cache[key]
        return self._last

    def _dynamic_key(self, geo: Geometry, plan: Plan) -> tuple:
        """The dynamic build ``geo`` runs on: its own broadcast pattern's, else an earlier
        build it fits (``geometry.fits``), so one build serves as many calls as it can."""
        key = dynamic_key(self.rule, geo)
        if (key, plan) in self._cache:
            return key
        return next((k for k, p in self._cache if p == plan and fits(k, self.rule, geo)),
                    key)

    def _hand_written(self, geo: Geometry) -> Plan:
        return hand_written(self.rule, geo, self.target, dynamic=self.dynamic, **self.options)

    def _plan(self, geo: Geometry) -> tuple[Plan, bool]:
        """(plan, from tuning) for this geometry, through the one plan door
        (``plans.plan_for``: the tuning database, the cost model, else the hand-written
        policy)."""
        choice = plan_for(self.rule, geo, self.target, dynamic=self.dynamic, tune=self.tune,
                          measure=self.time_plan, **self.options)
        return choice.plan, choice.tuned

    # Step 3. Run ----------------------------------------------------------------------
    def __call__(self, out: dict | None = None, **inputs) -> dict:
        """Run on ``inputs``; ``out`` maps output names to preallocated arrays (written in
        place and returned as they are)."""
        key = input_key(inputs)
        plan = self._calls.get(key)
        if plan is None:
            plan = self._new_call(key, inputs)
        elif plan is not self._recent:  # the LRU order moves only when the signature does
            self._calls.move_to_end(key)
        self._recent, self._last = plan, plan.built
        if not self.backend.host_memory:
            return self._on_device(plan, inputs, out)
        layout = None if plan.direct else self._layout(inputs)
        if out is not None:
            return self._into(plan, inputs, layout, out)
        users, tensors = output_arrays(plan)
        plan.func(*input_arrays(plan, inputs, layout), *tensors)
        return in_kind(users, None, plan.to_caller)

    def _into(self, plan: CallPlan, inputs: dict, layout, out) -> dict:
        """A host call that writes the caller's ``out`` arrays; one that overlaps an input
        is written to a temporary and copied over afterwards (``out_arrays.given_outputs``)."""
        users, tensors, copies = given_outputs(plan, out, inputs)
        plan.func(*input_arrays(plan, inputs, layout), *tensors)
        for target, temp in copies:
            np.copyto(target, temp)
        return in_kind(users, out, plan.to_caller)

    def _new_call(self, key: tuple, inputs: dict) -> CallPlan:
        """The call plan of a new signature; no kernel is built for one with no rows."""
        layout = self._layout(inputs)
        geo = self._geometry(layout)
        built = None if 0 in layout.rows else self._compiled(geo)
        plan = call_plan(self.rule, layout, geo, built, key, inputs, self.keep)
        self._calls[key] = plan
        _evict(self._calls)
        return plan

    def _on_device(self, plan: CallPlan, inputs: dict, out: dict | None) -> dict:
        """A device kernel: inputs copied over, results copied back into host arrays (an
        output over an input's memory is then harmless; two outputs that share memory are
        still refused)."""
        if out is None:
            users, _ = output_arrays(plan)
        else:
            users, _, _ = given_outputs(plan, out)
        if plan.built is None:  # no rows: nothing to run
            return in_kind(users, out, plan.to_caller)
        dev = plan.built.device()
        if not dev.exist:
            raise RuntimeError(f"no {self.target} device here: use kernel.prepare(...) and "
                               "kernel.primfunc / kernel.cuda_source() to inspect the code")
        layout = self._layout(inputs)
        tensors = [from_numpy(np.asarray(users[o.name]).reshape(o.kernel_shape), dev)
                   for o in plan.outputs]
        plan.func(*layout_tensors(self.rule, layout, plan.geo, dev), *tensors)
        for o, t in zip(plan.outputs, tensors, strict=True):
            np.copyto(np.asarray(users[o.name]).reshape(o.kernel_shape), t.numpy())
        return in_kind(users, out, plan.to_caller)

    def time(self, repeat: int = 5, **inputs) -> float:
        """Median milliseconds of the kernel alone on ``inputs`` (inputs and outputs already on
        the device; TVM's time evaluator synchronises)."""
        layout = self._layout(inputs)
        geo = self._geometry(layout)
        built = self._compiled(geo)
        args = layout_tensors(self.rule, layout, geo, built.device())
        outs = allocate_outputs(self.rule, geo, self.keep)
        return time_built(built, args + list(outs.values()), repeat)

    def time_plan(self, geo: Geometry, plan: Plan, repeat: int = 5, seed: int = 0) -> float:
        """Median milliseconds of ``plan`` built for ``geo`` on random inputs of that
        geometry (what the schedule search measures; the build is cached like a call's)."""
        built = self._compiled(geo, plan)
        args = random_inputs(self.rule, geo, seed) + \
            list(allocate_outputs(self.rule, geo, self.keep).values())
        return time_built(built, args, repeat)

    # Step 4. Show ---------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The plan of the most recent call (variant, lanes, splits and why)."""
        return self._last.plan if self._last else None

    @property
    def primfunc(self):
        """The TIR PrimFunc of the most recent call (None before the first)."""
        return self._last.primfunc if self._last else None

    def source(self) -> str:
        """TVMScript of the most recently compiled PrimFunc."""
        if self._last is None:
            raise RuntimeError("call the kernel once (or kernel.prepare(**inputs)) first")
        return self._last.primfunc.script()

    def assembly(self, fmt: str = "asm") -> str:
        """The CPU code of the most recently compiled kernel: "asm" or "ll" (LLVM IR)."""
        if not self.backend.host_memory or self._last is None:
            raise RuntimeError("assembly() needs a CPU kernel that was called (or "
                               "kernel.prepare(**inputs)) first")
        return host_source(self._last.executable, fmt)

    def cuda_source(self) -> str:
        if self.backend.host_memory or self._last is None:
            raise RuntimeError("cuda_source() needs a kernel compiled with target='cuda' "
                               "(call it or kernel.prepare(**inputs) first)")
        return cuda_source(self._last.executable)

    def prepare(self, **inputs) -> Kernel:
        """Compile for the geometry of ``inputs`` without running (arrays may be dummies)."""
        self._compiled(self.geometry(**inputs))
        return self


def _check_feature_axis(layout, inputs: dict) -> None:
    """A feature axis D of 0: TVM refuses zero-sized buffers (with a message about strides),
    so the input that has the empty axis is named here instead.  (No rows is no error: the
    call returns empty outputs without a kernel, as numpy does.)"""
    if layout.d == 0:
        culprit = next(name for name, a in layout.arrays.items()
                       if a.shape[-1] == 0 and name in layout.vector)
        raise ValueError(f"input '{culprit}' has shape {np.shape(inputs[culprit])}: a "
                         "feature axis D of 0; a kernel needs D >= 1")


def _evict(cache: OrderedDict) -> None:
    while len(cache) > MAX_CACHED:
        cache.popitem(last=False)
