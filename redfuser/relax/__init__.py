"""redfuser for Relax models: find cascaded reductions in a Relax module and fuse them.

``FuseCascadedReductions()`` is a ``tvm.transform`` module pass.  It lifts each dataflow
block into redfuser's spec language with a table of op translations (``ops.py``), groups
the lifted values into cascades (``group.py``), derives each cascade's one-pass rule and
replaces the group's bindings by one ``R.call_tir`` of the fused TensorIR kernel
(``rewrite.py``).  A cascade the engine refuses, or that does not build, is left as it was
and its reason recorded; ``pass_obj.report`` is the ``FuseReport`` of the last run.

>>> from redfuser.relax import FuseCascadedReductions, FuseReport
>>> isinstance(FuseCascadedReductions().report, FuseReport)
True
"""

from ..report import FuseReport, GroupReport
from .driver import FuseCascadedReductions, fuse_module
from .pipeline import build, cpu_pipeline, run

__all__ = ["FuseCascadedReductions", "FuseReport", "GroupReport", "build", "cpu_pipeline",
           "fuse_module", "run"]
