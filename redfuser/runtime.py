"""Building and running kernels: rule + geometry + plan -> executable, array marshalling,
timing.  ``kernel.Kernel`` (the user's callable) and ``tune`` (the schedule search) both
build and measure through here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from algebra.dtypes import numpy_dtype
from algebra.layout import Layout
from algebra.rule import FusionRule

from .lowering import FUNC_NAME, Geometry, Plan, backend, build_primfunc, signature
from .lowering.fastmath import elementwise_kernel
from .lowering.signature import call_shape
from .tvm.rpc import export_library
from .tvm.runtime import build as tvm_build
from .tvm.runtime import empty_aligned, from_numpy, time_ms
from .tvm.target import cpu_target, device

ELEMENTWISE_NAME = "fastmath_kernel"


@dataclass(frozen=True)
class Built:
    """A compiled kernel instance: its PrimFunc, the executable, and the plan it follows."""

    primfunc: object
    executable: object
    plan: Plan
    target: str

    def device(self):
        return device(backend(self.target).tvm_target())


def build(rule: FusionRule, geo: Geometry, plan: Plan, target: str = "cpu",
          tvm_target: dict | None = None, keep: frozenset | None = None) -> Built:
    """Lower and compile ``rule`` at ``geo`` following ``plan`` for ``target`` (the
    backend's kernels), for this machine or for the TVM target ``tvm_target`` (another
    machine's: e.g. ``{"kind": "llvm", "mcpu": "cortex-a72", "mtriple": "aarch64-linux-gnu"}``);
    ``keep``: the per-row results that are outputs (``signature``; None: all).  Its
    arguments take the caller's shapes (``signature.call_shape``).
    """
    func = build_primfunc(rule, geo, plan, FUNC_NAME, target, keep=keep, call_view=True)
    return Built(func, tvm_build(func, tvm_target or backend(target).tvm_target()), plan,
                 target)


def export(built: Built, path: str, cross_cc: str | None = None) -> None:
    """Write ``built`` as a library another machine loads (``redfuser.tvm.rpc.export_library``:
    ``.so`` linked here, by ``cross_cc`` for another architecture; ``.tar`` linked there).
    """
    export_library(built.executable, path, cross_cc)


def input_tensors(rule: FusionRule, layout: Layout, geo: Geometry, dev) -> list:
    """Inputs as tensors of the kernel's argument shapes, in its order (sorted names)."""
    sig = signature(rule, geo)
    return [from_numpy(layout.arrays[a.name].reshape(call_shape(rule, geo, a, True)), dev)
            for a in sig.inputs]


def allocate_outputs(rule: FusionRule, geo: Geometry,
                     keep: frozenset | None = None) -> dict[str, np.ndarray]:
    """Fresh aligned arrays for every output (``keep``: as ``signature``), of the kernel's
    argument shapes, in its order."""
    sig = signature(rule, geo, keep)
    return {a.name: empty_aligned(call_shape(rule, geo, a, False), numpy_dtype(a.dtype))
            for a in sig.outputs}


def random_inputs(rule: FusionRule, geo: Geometry, seed: int = 0) -> list[np.ndarray]:
    """Random inputs of ``geo`` in argument order: streams ~ N(0, 1); per-row parameters
    in [0.5, 1) (an eps or a scale stays positive)."""
    g = np.random.default_rng(seed)
    out = []
    for a in signature(rule, geo).inputs:
        shape = call_shape(rule, geo, a, True)
        value = g.standard_normal(shape) if geo.inputs[a.name].length > 1 else \
            g.uniform(0.5, 1.0, shape)
        out.append(value.astype(numpy_dtype(a.dtype)))
    return out


def time_built(built: Built, args: list, repeat: int = 5) -> float:
    """Median milliseconds of one call on ``args`` (arrays or device tensors)."""
    dev = built.device()
    tensors = [a if not isinstance(a, np.ndarray) else from_numpy(a, dev) for a in args]
    return time_ms(built.executable, FUNC_NAME, dev, tensors, repeat)


def time_plan(rule: FusionRule, geo: Geometry, plan: Plan, target: str = "cpu",
              repeat: int = 5, seed: int = 0) -> float:
    """Median milliseconds of ``plan`` built for ``geo`` on random inputs of that geometry
    (what the schedule search measures when it is given nothing else)."""
    built = build(rule, geo, plan, target)
    args = random_inputs(rule, geo, seed) + list(allocate_outputs(rule, geo).values())
    return time_built(built, args, repeat)


def evaluate_elementwise(builder, xs: np.ndarray, lanes: int = 16) -> np.ndarray:
    """Apply a scalar TIR ``builder`` (``lowering.fastmath``) to a float32 array through a
    freshly compiled vectorized kernel.  For tests and quick checks: it compiles on every
    call (about 0.05 s).

    Examples
    --------
    >>> from redfuser.lowering.fastmath import fast_exp
    >>> xs = np.linspace(-5, 5, 100, dtype="float32")
    >>> bool(np.allclose(evaluate_elementwise(fast_exp, xs), np.exp(xs), rtol=3e-7, atol=0))
    True
    """
    xs = np.asarray(xs, dtype=np.float32).ravel()
    padded = np.zeros(-(-max(len(xs), 1) // lanes) * lanes, np.float32)
    padded[: len(xs)] = xs
    out = from_numpy(np.empty_like(padded))
    kernel = tvm_build(elementwise_kernel(builder, len(padded), lanes, name=ELEMENTWISE_NAME),
                       cpu_target())
    kernel[ELEMENTWISE_NAME](from_numpy(padded), out)
    return out.numpy()[: len(xs)]
