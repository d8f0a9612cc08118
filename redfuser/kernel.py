"""Stage 8, build: ``Kernel``, the callable compiled form of a rule.

Calling convention (the algebra engine's): any number of row axes broadcasting like
numpy (attention's K and V of shape (H, 1, N, D) are read once per head, never
copied per query), streams (*rows, N[, D]), parameters scalars or (*rows[, D]);
outputs (*rows[, D or k]) and per-element outputs (*rows, N[, D]).  Inputs are
passed to TVM without a copy when they are float32 and contiguous (numpy arrays or
any DLPack tensor such as torch's).  Kernels are specialised per shape: the first
call with a new geometry compiles (tens of milliseconds), later calls hit a cache.
The plan of a new geometry comes from the tuning database when it has one (``tune``:
None reads it, True also searches a missing shape, "model" takes the cost model's first
choice for a missing shape without measuring, False ignores the database;
``redfuser.tune``), else from ``plan.choose``.
"""

from __future__ import annotations

import warnings
from numbers import Number

import numpy as np

from algebra.layout import resolve, to_user
from algebra.rule import FusionRule

from .analysis import Geometry, geometry
from .plan import Plan, choose
from .tvm_adapter import (
    build,
    cpu_target,
    cuda_source,
    cuda_target,
    device,
    empty_aligned,
    from_numpy,
    time_ms,
)
from .variants import build_primfunc, result_dtype

TARGETS = {"cpu": cpu_target, "cuda": cuda_target}
FUNC_NAME = "redfuser_kernel"


class Kernel:
    """A compiled fusion rule: ``kernel(**inputs) -> dict[str, np.ndarray]``."""

    def __init__(self, rule: FusionRule, target: str = "cpu", variant: str | None = None,
                 splits: int | None = None, fast_math: bool = True, threads: int | None = None,
                 tune: bool | str | None = None):
        if target not in TARGETS:
            raise ValueError(f"target must be one of {sorted(TARGETS)}, not {target!r}")
        if tune not in (None, True, False, "model"):
            raise ValueError(f"tune must be None, True, False or 'model', not {tune!r}")
        self.rule, self.target, self.tune = rule, target, tune
        self.options = {"variant": variant, "splits": splits, "fast_math": fast_math,
                        "threads": threads}
        self._cache: dict[tuple, tuple] = {}
        self._last: tuple | None = None

    # Step 1. Check the inputs ---------------------------------------------------------
    def _layout(self, inputs: dict):
        for name, value in inputs.items():
            if isinstance(value, Number) or not hasattr(value, "dtype"):
                continue
            dtype = np.dtype(str(value.dtype).replace("torch.", ""))
            if dtype != np.float32:
                raise TypeError(f"input '{name}' has dtype {dtype}; this kernel computes in "
                                "float32: pass float32 arrays")
        return resolve(self.rule.cascade, inputs, dtype=np.float32)

    # Step 2. Compile for this geometry (cached) ---------------------------------------
    def _compiled(self, geo: Geometry, plan: Plan | None = None):
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
            return self._build(geo, choose(self.rule, geo, target=self.target, **self.options))

    def _build(self, geo: Geometry, plan: Plan):
        key = (geo.key(), plan)
        if key not in self._cache:
            func = build_primfunc(self.rule, geo, plan, FUNC_NAME, self.target)
            self._cache[key] = (func, build(func, TARGETS[self.target]()), plan)
        self._last = self._cache[key]
        return self._cache[key]

    def _plan(self, geo: Geometry) -> tuple[Plan, bool]:
        """(plan, from tuning) for this geometry: the tuning database's plan (searched
        first when ``tune=True``; the cost model's pick when ``tune="model"``) unless the
        caller pinned variant/splits/threads or said ``tune=False``; else
        ``plan.choose``'s rules."""
        pinned = any(self.options[k] is not None for k in ("variant", "splits", "threads"))
        if self.tune is not False and not pinned:
            from .tune.search import model_plan, tuned_plan

            plan = tuned_plan(self, geo, search=self.tune is True)
            if plan is None and self.tune == "model":
                plan = model_plan(self, geo)
            if plan is not None:
                return plan, True
        return choose(self.rule, geo, target=self.target, **self.options), False

    # Step 3. Run ----------------------------------------------------------------------
    def __call__(self, **inputs) -> dict[str, np.ndarray]:
        layout = self._layout(inputs)
        geo = geometry(self.rule, layout)
        _, executable, _ = self._compiled(geo)
        dev = device(TARGETS[self.target]())
        if self.target == "cuda" and not dev.exist:
            raise RuntimeError("no CUDA device here: use kernel.prepare(...) and "
                               "kernel.cuda_source() to inspect the generated code")
        args = _input_tensors(layout, geo, dev)
        outs = self._outputs(geo)
        tensors = [from_numpy(o, dev) for o in outs.values()]
        executable[FUNC_NAME](*args, *tensors)
        if self.target == "cuda":  # device results come back by copy
            outs = {k: t.numpy() for k, t in zip(outs, tensors, strict=True)}
        values = {k: _canonical(self.rule, geo, k, v) for k, v in outs.items()}
        return to_user(self.rule.cascade, layout, values)

    def time(self, repeat: int = 5, **inputs) -> float:
        """Median milliseconds of the kernel alone on ``inputs`` (inputs and outputs already on
        the device; TVM's time evaluator synchronises)."""
        layout = self._layout(inputs)
        geo = geometry(self.rule, layout)
        _, executable, _ = self._compiled(geo)
        dev = device(TARGETS[self.target]())
        args = _input_tensors(layout, geo, dev)
        args += [from_numpy(o, dev) for o in self._outputs(geo).values()]
        return time_ms(executable, FUNC_NAME, dev, args, repeat)

    def time_plan(self, geo: Geometry, plan: Plan, repeat: int = 5, seed: int = 0) -> float:
        """Median milliseconds of ``plan`` built for ``geo`` on random inputs of that
        geometry (what the schedule search measures; the build is cached like a call's)."""
        _, executable, _ = self._compiled(geo, plan)
        dev = device(TARGETS[self.target]())
        g = np.random.default_rng(seed)
        args = [from_numpy(_random_input(g, inp), dev) for _, inp in sorted(geo.inputs.items())]
        args += [from_numpy(o, dev) for o in self._outputs(geo).values()]
        return time_ms(executable, FUNC_NAME, dev, args, repeat)

    def _outputs(self, geo: Geometry) -> dict[str, np.ndarray]:
        from .variants import elementwise_width, result_width

        out = {}
        for name in self.rule.outputs:
            if name in self.rule.cascade.elementwise:
                width = elementwise_width(self.rule, geo, name)
                out[name] = empty_aligned((geo.r, geo.n, width), np.float32)
            else:
                out[name] = empty_aligned((geo.r, result_width(self.rule, geo, name)),
                                          result_dtype(self.rule, name))
        return out

    # Step 4. Show ---------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The plan of the most recent call (variant, lanes, splits and why)."""
        return self._last[2] if self._last else None

    def source(self) -> str:
        """TVMScript of the most recently compiled PrimFunc."""
        if self._last is None:
            raise RuntimeError("call the kernel once (or use compile(..., example=...)) first")
        return self._last[0].script()

    def cuda_source(self) -> str:
        if self.target != "cuda" or self._last is None:
            raise RuntimeError("cuda_source() needs a kernel compiled with target='cuda'")
        return cuda_source(self._last[1])

    def prepare(self, **inputs) -> Kernel:
        """Compile for the geometry of ``inputs`` without running (arrays may be dummies)."""
        self._compiled(geometry(self.rule, self._layout(inputs)))
        return self


def _random_input(g: np.random.Generator, inp) -> np.ndarray:
    """Streams ~ N(0, 1); per-row parameters in [0.5, 1) (an eps or a scale stays positive)."""
    shape = (inp.count, inp.length, inp.width)
    if inp.length > 1:
        return g.standard_normal(shape, np.float32)
    return g.uniform(0.5, 1.0, shape).astype(np.float32)


def _input_tensors(layout, geo: Geometry, dev) -> list:
    """Inputs as (R_in, L, F) tensors in the kernel's argument order (sorted names)."""
    return [from_numpy(layout.arrays[k].reshape(g.count, g.length, g.width), dev)
            for k, g in sorted(geo.inputs.items())]


def _canonical(rule, geo: Geometry, name: str, v: np.ndarray) -> np.ndarray:
    rows = geo.rows
    if name in rule.cascade.elementwise:
        return v.reshape(rows + v.shape[1:])
    shape = rule.cascade.shapes.get(name)
    if shape is not None and shape.k:
        return v.reshape(rows + (v.shape[1], 1))
    return v.reshape(rows + (1, v.shape[1]))

