"""redfuser: derive, prove and lower one-pass rules for cascaded reductions.

The phases, in the order they run:

1. ``algebra``: parse the spec and lift each reduction to sympy; separate each body;
   derive every component's state, update, merge and finalize; prove every identity
   (``algebra.pipeline.derive`` -> a ``FusionRule``).  sympy and numpy only.
2. ``kernel.compile`` wraps a rule in a ``Kernel``; its first call with a new shape
   resolves the inputs (``algebra.layout``) and fixes a ``Geometry``
   (``lowering.geometry``).
3. The plan (``plans.plan_for``): the tuning database (``tune``), else the target's policy
   (``lowering.backends`` -> ``lowering.cpu.plan`` / ``lowering.cuda.plan``).
4. ``lowering.build_primfunc``: the target's loop nest of the plan's variant, its
   statements emitted by ``lowering.emitter`` -> a TIR PrimFunc.
5. ``runtime.build``: TVM compiles it (``redfuser.tvm``, the only package importing TVM);
   the kernel runs on the caller's arrays.

``tensorir`` and ``relax`` find cascades in TVM programs and fuse them through the same
phases.  ``derive``/``reference`` need only sympy and numpy; ``compile`` (TVM) is imported
on first use so that deriving rules does not pay for loading TVM.

>>> import redfuser
>>> rule = redfuser.derive("attention")
>>> rule.verify()
True
"""

from algebra import (
    LIBRARY,
    FusionRule,
    NoBackward,
    NotFusable,
    SpecError,
    StagedRule,
    derive,
    reference,
)

__all__ = ["LIBRARY", "FuseReport", "FusionRule", "Kernel", "NoBackward", "NotFusable", "SpecError",
           "QuantGemm", "StagedRule", "compile", "derive", "fuse", "lift", "quant_gemm",
           "reference"]


def __getattr__(name: str):
    if name in ("compile", "Kernel"):
        from . import kernel  # lazily: loading TVM costs 0.6 s, which derive never needs

        return getattr(kernel, name)
    if name in ("quant_gemm", "QuantGemm"):  # exact int8 quantization + GEMM (TVM)
        from . import quant

        return getattr(quant, name)
    if name in ("lift", "fuse", "FuseReport"):  # TensorIR: find and fuse cascades
        from . import tensorir

        return getattr(tensorir, name)
    raise AttributeError(f"module 'redfuser' has no attribute {name!r}")
