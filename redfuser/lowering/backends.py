"""The targets: one table, each target an object that owns its facts.

A ``Backend`` carries what differs between targets: the TVM target kinds it serves and
the target it compiles for, the policy that picks a plan and the plan's type (``cpu/plan.py``,
``cuda/plan.py``: lanes and row blocks, or threads per block and SM count) and the one
for symbolic shapes where it has one, the loop nests of each variant
(``cpu/variants.py``, ``cuda/variants.py``), whether the kernel writes its outputs in host
memory, and what the tuner (``redfuser.tune``) needs of it: its schedule space
(``cpu/space.py``, ``cuda/space.py``), the identity its measurements are stored under,
and for a GPU its facts (``cuda/plan.py``'s ``GPU``).
Nothing else in redfuser tests the target's name (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from algebra.dtypes import COMPUTE, COMPUTES

from ..tvm.target import cuda_target, host_target
from .cpu import plan as cpu_plan
from .cpu import resident as cpu_resident
from .cpu import space as cpu_space
from .cpu import variants as cpu_variants
from .cuda import plan as cuda_plan
from .cuda import space as cuda_space
from .cuda import variants as cuda_variants
from .plan import Plan


@dataclass(frozen=True)
class Backend:
    """One target (see the module docstring)."""

    name: str
    tvm_kind: str  # the kind of TVM target (``Target.kind.name``) this backend builds for
    tvm_target: Callable[[], dict]
    choose: Callable[..., Plan]
    # the type ``choose`` returns: its fields are what a tuning record of this target holds
    plan_type: type[Plan]
    variants: Mapping[str, Callable]
    host_memory: bool  # outputs are written where the caller's arrays live (no copy back)
    resident_fit: Callable[..., str]  # where a staged rule's row stays between its passes
    # the policy of one kernel for every row count and N (``Plan.dynamic``); None: the
    # target builds per shape only
    dynamic: Callable[..., Plan] | None
    # the tuner's: (rule, geo, variant, threads) -> the variant's searched ``Param``s or
    # None, and whether a candidate's parameters fit the target together
    params: Callable[..., tuple | None]
    plan_fits: Callable[[Plan], bool]
    machine_id: Callable[[], str]  # the identity measurements here are stored under
    # the GPU's facts (SMs, shared memory, warp, nominal figures); None: the host's CPU,
    # whose figures are measured here (``tune.machine``) and whose rows spread over cores
    gpu: cuda_plan.Gpu | None = None
    # further TVM kinds whose functions ``fuse`` rewrites with this backend (as C source)
    also_kinds: tuple[str, ...] = ()
    # the compute dtypes its kernels build in (``Geometry.compute``), and why not others
    computes: tuple[str, ...] = (COMPUTE.name,)
    computes_why: str = ""

    def check_compute(self, compute: str) -> None:
        """Refuse a kernel computing in a dtype this target does not build, by name."""
        if compute not in self.computes:
            raise ValueError(f"target '{self.name}' computes {' or '.join(self.computes)} "
                             f"({self.computes_why}); this kernel computes {compute}: use "
                             "compute_dtype='float32', or redfuser.reference for float64")


BACKENDS: dict[str, Backend] = {
    "cpu": Backend("cpu", "llvm", host_target, cpu_plan.choose, cpu_plan.CpuPlan,
                   cpu_variants.VARIANTS, True, cpu_resident.resident_fit, cpu_plan.dynamic_plan,
                   cpu_space.params, cpu_space.plan_fits, cpu_space.machine_id,
                   also_kinds=("c",), computes=tuple(COMPUTES)),
    "cuda": Backend("cuda", "cuda", partial(cuda_target, cuda_plan.GPU.arch), cuda_plan.choose,
                    cuda_plan.CudaPlan, cuda_variants.VARIANTS, False, cuda_plan.resident_fit,
                    cuda_plan.dynamic_plan, cuda_space.params, cuda_space.plan_fits,
                    cuda_space.machine_id, cuda_plan.GPU,
                    computes_why="its shared-memory states, warp merges and polynomial exp are "
                                 "float32's, and a GPU's float64 rate is a fraction of that"),
}


def backend(target: str) -> Backend:
    """The backend named ``target`` (a clear error for any other name).

    Examples
    --------
    >>> backend("cuda").host_memory, backend("cuda").plan_type.__name__
    (False, 'CudaPlan')
    >>> backend("gpu")
    Traceback (most recent call last):
    ...
    ValueError: target must be one of ['cpu', 'cuda'], not 'gpu'
    """
    if not isinstance(target, str) or target not in BACKENDS:
        raise ValueError(f"target must be one of {sorted(BACKENDS)}, not {target!r}")
    return BACKENDS[target]


def backend_of_kind(kind: str | None, rewrite: bool = False) -> Backend | None:
    """The backend that builds for TVM target kind ``kind`` (None, no target in scope: the
    CPU's), or None when no backend serves it; ``rewrite``: also the kinds whose functions
    ``fuse`` rewrites (``Backend.also_kinds``).

    Examples
    --------
    >>> backend_of_kind("cuda").name, backend_of_kind(None).name, backend_of_kind("metal")
    ('cuda', 'cpu', None)
    >>> backend_of_kind("c"), backend_of_kind("c", rewrite=True).name
    (None, 'cpu')
    """
    kind = kind or BACKENDS["cpu"].tvm_kind
    return next((b for b in BACKENDS.values()
                 if kind == b.tvm_kind or rewrite and kind in b.also_kinds), None)


def build_kinds() -> tuple[str, ...]:
    """The TVM target kinds redfuser builds for (for messages).

    Examples
    --------
    >>> build_kinds()
    ('llvm', 'cuda')
    """
    return tuple(b.tvm_kind for b in BACKENDS.values())
