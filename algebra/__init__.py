"""The algebra engine: derive proven one-pass fusion rules for cascaded reductions.

sympy only: nothing here imports TVM.
"""

from .backward import Backward
from .cascade import Cascade
from .errors import NoBackward, NotFusable, SpecError
from .library import LIBRARY
from .pipeline import derive
from .reference import reference
from .rule import FusionRule
from .spec import parse
from .stages import Stage, StagedRule

__all__ = ["LIBRARY", "Backward", "Cascade", "FusionRule", "NoBackward", "NotFusable",
           "SpecError", "Stage", "StagedRule", "derive", "parse", "reference"]
