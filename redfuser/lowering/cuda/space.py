"""The GPU's tuning facts: the schedule space the tuner (``redfuser.tune.space``) searches
and the identity its measurements are stored under."""

from __future__ import annotations

from algebra.rule import FusionRule

from ...tvm.target import cuda_device_name
from ..geometry import Geometry
from ..plan import MIN_PIECE, SPLIT_VALUES, Param
from ..products import products
from . import plan as cuda_plan

# threads per block the tuner tries: powers of two from a warp to a block's most
THREADS = tuple(t for t in (cuda_plan.GPU.warp << i for i in range(11))
                if t <= cuda_plan.GPU.block_threads)


def params(rule: FusionRule, geo: Geometry, variant: str,
           threads: int) -> tuple[Param, ...] | None:
    """The searched parameters of ``variant`` (None: the variant does not apply);
    ``threads`` (the host's) plays no part on the GPU."""
    if products(rule, geo) and variant != "split":  # the hand-written tiled GEMM, fixed
        plan = cuda_plan.gemm_plan(rule, geo, variant, True)
        return tuple(Param(name, (getattr(plan, name),), "the tiled GEMM of the rule's matrix "
                           "products (not searched)") for name in ("threads", *cuda_plan.GEMM))
    if not cuda_plan.fits(rule, geo):  # no warp's states fit a block's shared memory
        return None
    most = cuda_plan.threads_for(rule, geo, limit=max(THREADS))
    block = Param("threads", tuple(t for t in THREADS if t <= most),
                  "threads per block, combined by a shared-memory merge tree")
    if variant != "split":
        return (block,)
    values = tuple(s for s in SPLIT_VALUES if geo.n // s >= MIN_PIECE)
    return (block, Param("splits", values, "blocks per row, combined with the merge")) \
        if values else None


def plan_fits(plan: cuda_plan.CudaPlan) -> bool:
    """Every plan of the space fits: the tiled GEMM is fixed, threads are bounded above."""
    return True


def machine_id() -> str:
    """The GPU tuning records are stored under (its architecture when it cannot be asked).

    Examples
    --------
    >>> machine_id().startswith("cuda/")
    True
    """
    return f"cuda/{cuda_device_name() or cuda_plan.GPU.arch}"
