"""redfuser: derive, prove and lower one-pass rules for cascaded reductions.

``derive``/``reference`` need only sympy and numpy; ``compile`` (TVM) is imported on
first use so that deriving rules does not pay for loading TVM.

>>> import redfuser
>>> rule = redfuser.derive("attention")
>>> rule.verify()
True
"""

from algebra import LIBRARY, FusionRule, NotFusable, SpecError, derive, reference

__all__ = ["LIBRARY", "FuseReport", "FusionRule", "Kernel", "NotFusable", "SpecError", "compile",
           "derive", "fuse", "lift", "reference"]


def __getattr__(name: str):
    if name == "compile":
        from .compiler import compile

        return compile
    if name == "Kernel":
        from .kernel import Kernel

        return Kernel
    if name in ("lift", "fuse", "FuseReport"):  # TensorIR: find and fuse cascades
        from . import tensorir

        return getattr(tensorir, name)
    raise AttributeError(f"module 'redfuser' has no attribute {name!r}")
