"""FusionRule + Geometry + Plan -> one TIR PrimFunc, built with TVM's IRBuilder."""

from __future__ import annotations

from algebra.dtypes import argument_dtype
from algebra.rule import FusionRule

from ..tvm.ir import IRBuilder, T, arg_alias, arg_buffer, shape_var
from .backends import backend
from .geometry import Geometry, symbolic_geometry
from .plan import Plan
from .signature import I64, call_shape, param_shape, signature
from .texpr import computing

FUNC_NAME = "redfuser_kernel"


def build_primfunc(rule: FusionRule, geo: Geometry, plan: Plan, name: str = FUNC_NAME,
                   target: str = "cpu", fixed_rows: frozenset = frozenset(),
                   keep: frozenset | None = None, call_view: bool = False):
    """One PrimFunc whose arguments follow ``signature(rule, geo, keep)``: inputs
    (R_in, L, F) in sorted name order, then outputs in spec order; its body is the target's
    loop nest of ``plan.variant``.  A dynamic plan makes every row axis and N a shape
    variable, except the row axes in ``fixed_rows`` (indices), which keep their size in
    ``geo``.  The results outside ``keep`` live in (R, width) buffers the function
    allocates itself (a workspace per call: the caller never sees them).  ``call_view``:
    the arguments are declared in the caller's shapes (``signature.call_shape``: what a
    ``Kernel`` passes) instead of (R_in, L, F) and (``param_shape``) a dynamic kernel's;
    the body reads the flattened shapes through aliases of the same memory either way.

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
    backend(target).check_compute(geo.compute)
    if plan.dynamic:
        rows = tuple(size if k in fixed_rows else shape_var(f"rows{k}", I64)
                     for k, size in enumerate(geo.rows))
        geo = symbolic_geometry(rule, geo, rows, shape_var("length", I64))
    sig = signature(rule, geo, keep)
    with IRBuilder() as ib, computing(geo.compute):  # the dtype of the body's literals
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            args = (*sig.inputs, *sig.outputs)
            shapes = [_argument_shape(rule, geo, plan, a, k < len(sig.inputs), call_view)
                      for k, a in enumerate(args)]
            declared = [arg_buffer(a.name, shape, argument_dtype(a.dtype))
                        for a, shape in zip(args, shapes, strict=True)]
            # every argument first: an alias opens a frame (shape variables: always one)
            declared = [b if not plan.dynamic and shape == a.shape else
                        arg_alias(b, a.shape, argument_dtype(a.dtype))
                        for a, b, shape in zip(args, declared, shapes, strict=True)]
            bufs = {a.name: b for a, b in zip(sig.inputs, declared, strict=False)}
            results, elementwise = {}, {}
            for a, buf in zip(sig.outputs, declared[len(sig.inputs):], strict=True):
                if a.elementwise:
                    elementwise[a.name] = buf
                else:
                    results[a.name] = (buf, a.width)
            for a in sig.internal:
                results[a.name] = (T.alloc_buffer(a.shape, a.dtype), a.width)
            backend(target).variants[plan.variant](rule, geo, plan, bufs, results, elementwise)
    return ib.get()


def _argument_shape(rule, geo: Geometry, plan: Plan, arg, is_input: bool,
                    call_view: bool) -> tuple:
    """The declared shape of ``arg``: the caller's (``call_view``), else its flattened one,
    or (dynamic shapes) its row axes kept apart, from which TVM binds the row variables and
    N (the body then reads a flattened alias of it)."""
    if call_view:
        return call_shape(rule, geo, arg, is_input)
    return param_shape(arg, geo, is_input) if plan.dynamic else arg.shape
