"""FusionRule + Geometry + Plan -> one TIR PrimFunc, built with TVM's IRBuilder."""

from __future__ import annotations

from algebra.rule import FusionRule

from ..tvm_adapter import IRBuilder, T, arg_buffer
from .backends import backend
from .geometry import Geometry
from .plan import Plan
from .signature import signature

FUNC_NAME = "redfuser_kernel"


def build_primfunc(rule: FusionRule, geo: Geometry, plan: Plan, name: str = FUNC_NAME,
                   target: str = "cpu"):
    """One PrimFunc whose arguments follow ``signature(rule, geo)``: inputs (R_in, L, F)
    in sorted name order, then outputs in spec order; its body is the target's loop nest
    of ``plan.variant``.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import choose, shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> geo = shape_geometry(rule, {"x": (64, 1024)})
    >>> func = build_primfunc(rule, geo, choose(rule, geo))
    >>> "T.parallel" in func.script()  # rows in parallel: the CPU's rolling nest
    True
    """
    sig = signature(rule, geo)
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            bufs = {a.name: arg_buffer(a.name, a.shape, a.dtype) for a in sig.inputs}
            results, elementwise = {}, {}
            for a in sig.outputs:
                buf = arg_buffer(a.name, a.shape, a.dtype)
                if a.elementwise:
                    elementwise[a.name] = buf
                else:
                    results[a.name] = (buf, a.width)
            backend(target).variants[plan.variant](rule, geo, plan, bufs, results, elementwise)
    return ib.get()
