"""The targets: one table, each target an object that owns its facts.

A ``Backend`` carries what differs between targets: the TVM target it compiles for, the
policy that picks a plan (``cpu/plan.py``, ``cuda/plan.py``: lanes and row blocks, or
threads per block and SM count) and the one for symbolic shapes where it has one, the
loop nests of each variant (``cpu/variants.py``, ``cuda/variants.py``), and whether the
kernel writes its outputs in host memory.
Nothing else in redfuser tests the target's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..tvm.target import cpu_target, cuda_target
from .cpu import plan as cpu_plan
from .cpu import variants as cpu_variants
from .cuda import plan as cuda_plan
from .cuda import variants as cuda_variants
from .plan import Plan


@dataclass(frozen=True)
class Backend:
    """One target (see the module docstring)."""

    name: str
    tvm_kind: str  # the kind of TVM target (``Target.kind.name``) this backend serves
    tvm_target: Callable[[], dict]
    choose: Callable[..., Plan]
    variants: Mapping[str, Callable]
    host_memory: bool  # outputs are written where the caller's arrays live (no copy back)
    resident_fit: Callable[..., str]  # where a staged rule's row stays between its passes
    # the policy of one kernel for every row count and N (``Plan.dynamic``); None: the
    # target builds per shape only
    dynamic: Callable[..., Plan] | None = None


BACKENDS: dict[str, Backend] = {
    "cpu": Backend("cpu", "llvm", cpu_target, cpu_plan.choose, cpu_variants.VARIANTS, True,
                   cpu_plan.resident_fit, cpu_plan.dynamic_plan),
    "cuda": Backend("cuda", "cuda", cuda_target, cuda_plan.choose, cuda_variants.VARIANTS, False,
                    cuda_plan.resident_fit, cuda_plan.dynamic_plan),
}


def backend(target: str) -> Backend:
    """The backend named ``target`` (a clear error for any other name).

    Examples
    --------
    >>> backend("cuda").host_memory
    False
    >>> backend("gpu")
    Traceback (most recent call last):
    ...
    ValueError: target must be one of ['cpu', 'cuda'], not 'gpu'
    """
    if target not in BACKENDS:
        raise ValueError(f"target must be one of {sorted(BACKENDS)}, not {target!r}")
    return BACKENDS[target]


def backend_of_kind(kind: str | None) -> Backend | None:
    """The backend for TVM target kind ``kind`` (None, no target in scope: the CPU's), or
    None when no backend serves it.

    Examples
    --------
    >>> backend_of_kind("cuda").name, backend_of_kind(None).name, backend_of_kind("metal")
    ('cuda', 'cpu', None)
    """
    kind = kind or BACKENDS["cpu"].tvm_kind
    return next((b for b in BACKENDS.values() if b.tvm_kind == kind), None)
