"""Building a Relax module for the CPU, with or without the pass, through one pipeline.

``tvm.compile`` on a Relax module for an LLVM target runs the "default" build pipeline,
which legalizes every op into an unscheduled TensorIR function and fuses nothing.  Both
builds here run the same steps so a comparison measures the pass alone: the shapes a
symbolic function's bounds decide made exact (``bounds.py``: TVM's legalization cannot build
a tensor known only by its rank), legalize,
TVM's own operator fusion (FuseOps/FuseTIR), dlight's CPU rules (GEMV, Reduction), then
the default build.  With ``fuse=True`` FuseCascadedReductions runs first.
"""

from __future__ import annotations

from ..report import FuseReport
from ..tvm.graph import IRModule, Sequential, dlight, module_pass, relax, relax_tensor, relax_vm
from ..tvm.graph import build_relax as _build_relax
from ..tvm.ir import argument_dtypes
from ..tvm.target import host_target
from .bounds import tightened_module
from .driver import FuseCascadedReductions


def cpu_pipeline():
    """The Relax pipeline both builds use (a Pass).

    >>> cpu_pipeline().info.name
    'RedfuserCPUPipeline'
    """

    @module_pass(opt_level=0, name="RedfuserCPUPipeline")
    def _pipeline(mod: IRModule, _ctx) -> IRModule:
        mod = Sequential([  # shapes its bounds decide first: legalization needs them

            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
        ])(tightened_module(mod))
        return relax.get_pipeline("default")(_schedule_each(mod))

    return _pipeline


def _schedule_each(mod: IRModule) -> IRModule:
    """dlight's CPU rules, one PrimFunc at a time: a rule that fails on one function (the
    GEMV rule asserts on some fused reductions) leaves that function unscheduled instead of
    failing the build.  A function with bfloat16 or float16 arguments gets the Reduction
    rule alone: GEMV's 128 strided lanes a vector, unrolled, each converted from the narrow
    dtype, took LLVM 112 s for one (64, 256, 64) x (64, 64, 1) product of a tiny Mixtral
    (its bfloat16 build: 2 minutes; 12 s without)."""
    rules = dlight.ApplyDefaultSchedule(dlight.cpu.GEMV(), dlight.cpu.Reduction())
    narrow = dlight.ApplyDefaultSchedule(dlight.cpu.Reduction())
    out = mod.clone()
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            continue
        low = argument_dtypes(func) & {"bfloat16", "float16"}
        try:
            out[gv] = (narrow if low else rules)(IRModule({gv: func}))[gv]
        except Exception:  # noqa: BLE001, S112 - keep the legalized function as it is
            continue
    return out


def build(mod: IRModule, fuse: bool = True):
    """Compile ``mod`` for this CPU; returns (VM executable, FuseReport or None).

    Examples
    --------
    >>> import numpy as np
    >>> from redfuser.tvm.graph import relax
    >>> bb = relax.BlockBuilder()
    >>> x = relax.Var("x", relax.TensorType((4, 32), "float32"))
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.softmax(x))
    ...     gv = bb.emit_func_output(y)
    >>> ex, report = build(bb.get())
    >>> out = run(ex, np.ones((4, 32), np.float32))
    >>> float(out.sum()), report.fused
    (4.0, 1)
    """
    report = None
    if fuse:
        fuse_pass = FuseCascadedReductions()
        mod = fuse_pass(mod)
        report = fuse_pass.report
    return _build_relax(mod, cpu_pipeline(), host_target()), report


def run(executable, *args, func: str = "main"):
    """Call ``func`` of a built module on numpy arrays; results as numpy (nested like the
    Relax result: a tuple gives a list)."""
    vm = relax_vm(executable)
    out = vm[func](*[relax_tensor(a) for a in args])
    return _to_numpy(out)


def _to_numpy(value):
    if hasattr(value, "numpy"):
        return value.numpy()
    return [_to_numpy(v) for v in value]


__all__ = ["FuseReport", "build", "cpu_pipeline", "run"]
