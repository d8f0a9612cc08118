"""The component families: one name per way a component folds its stream, with the facts
about each that the code downstream asks (instead of testing a component's class).

A component names its family through its ``family`` property (``components.py``); a
lowering is registered per family (``redfuser.lowering.families``).  A new family is a new
row here and a new ``family`` answer on its component class.  These are finer than a law's
algebraic family (``laws.LAWS``: linear, multiplicative, selecting), which picks how a
reduction is derived; a family here says how its component is *folded*.

>>> Family.ANCHORED_SUM.linear, Family.ANCHORED_SUM.anchored, Family.TOP_K.selects
(True, True, True)
>>> [f.value for f in Family if f.selects and f.single]
['extreme', 'arg_extreme']
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class Traits:
    """What a family is: ``linear``: a state vector of sums re-anchored by a matrix;
    ``anchored``: its states are re-anchored as running anchors move during the pass (an
    anchored selection only selects again at finalize); ``selects``: it
    keeps the best elements; ``single``: it keeps one element (k = 1); ``element``: the
    component field holding what it evaluates per element (a tuple for a sum's basis, else
    one expression); ``why``: the row's reason."""

    linear: bool
    anchored: bool
    selects: bool
    single: bool
    element: str
    why: str


class Family(str, Enum):
    """A component family's name (a ``str`` enum: names print and compare as text)."""

    SUM = "sum"
    ANCHORED_SUM = "anchored_sum"
    EXTREME = "extreme"
    ARG_EXTREME = "arg_extreme"
    TOP_K = "top_k"
    PRODUCT = "product"

    @property
    def traits(self) -> Traits:
        return TRAITS[self]

    @property
    def linear(self) -> bool:
        return TRAITS[self].linear

    @property
    def anchored(self) -> bool:
        return TRAITS[self].anchored

    @property
    def selects(self) -> bool:
        return TRAITS[self].selects

    @property
    def single(self) -> bool:
        return TRAITS[self].single


TRAITS: dict[Family, Traits] = {
    Family.SUM: Traits(True, False, False, False,
                       "basis",
                       "sum with no anchor: its states only add (count, sum(x))"),
    Family.ANCHORED_SUM: Traits(True, True, False, False,
                                "basis",
                                "sum re-anchored as its anchors move: exp(m_old - m_new) S"),
    Family.EXTREME: Traits(False, False, True, True,
                           "core",
                           "max/min: one best value, no index; a NaN it folds is marked"),
    Family.ARG_EXTREME: Traits(False, False, True, True,
                               "core",
                               "argmax/argmin: one best value and its index"),
    Family.TOP_K: Traits(False, False, True, False,
                         "core",
                         "top-k: k best values (and indices), inserted in a sorted list"),
    Family.PRODUCT: Traits(False, False, False, False,
                           "factor",
                           "product of an anchor-free factor (the signs of a prod())"),
}


def element_exprs(comp) -> tuple:
    """The per-element expressions a component evaluates (its family's ``element`` field)."""
    value = getattr(comp, comp.family.traits.element)
    return tuple(value) if isinstance(value, tuple) else (value,)


def with_element_exprs(comp, exprs: tuple):
    """``comp`` evaluating ``exprs`` per element instead (as ``element_exprs`` lists them)."""
    field = comp.family.traits.element
    value = tuple(exprs) if isinstance(getattr(comp, field), tuple) else exprs[0]
    return dataclasses.replace(comp, **{field: value, "_cache": {}})


def select_family(k: int, indexed: bool) -> Family:
    """The family of a selection keeping ``k`` elements, with indices or not.

    >>> select_family(1, False).value, select_family(1, True).value, select_family(3, False).value
    ('extreme', 'arg_extreme', 'top_k')
    """
    if k > 1:
        return Family.TOP_K
    return Family.ARG_EXTREME if indexed else Family.EXTREME
