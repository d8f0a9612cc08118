"""TensorIR in, TensorIR out: find cascades of reduction blocks in a PrimFunc (``lift``) and
replace each fusable one with its fused kernel (``fuse``, with a ``FuseReport``).

Modules: ``groups`` (units, inlining, grouping: the analysis), ``expr`` (TIR -> sympy ->
spec text), ``axes`` (rows / N / D roles, liveness, the spec), ``emit`` (the fused kernel
over the original buffers, spliced into the function), ``rewrite`` (``fuse``, checks,
report).  Analysis returns frozen data; only ``emit`` and ``rewrite`` build IR.
"""

from ..report import FuseReport, GroupReport
from .axes import Access, Frame
from .expr import LiftError
from .groups import Group, lift
from .rewrite import fuse

__all__ = ["Access", "Frame", "FuseReport", "Group", "GroupReport", "LiftError", "fuse", "lift"]
