"""redfuser: derive, prove and (later) lower one-pass rules for cascaded reductions.

>>> import redfuser
>>> rule = redfuser.derive("attention")
>>> rule.verify()
True
"""

from algebra import LIBRARY, FusionRule, NotFusable, SpecError, derive, reference

__all__ = ["LIBRARY", "FusionRule", "NotFusable", "SpecError", "derive", "reference"]
