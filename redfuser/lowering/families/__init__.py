"""One lowering per component family, registered per backend (see ``registry``).  Importing
the package registers every family's default lowering."""

from . import products, selections, sums  # noqa: F401  (each registers its family)
from .registry import Element, FamilyLowering, Join, lowering_for, lowering_for_family, register

__all__ = ["Element", "FamilyLowering", "Join", "lowering_for", "lowering_for_family",
           "register"]
