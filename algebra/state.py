"""The state of a fused component: its variables, their kinds, and the anchors they are at.

A state variable (``StateVar``) holds a value, an index or k of either (``StateKind``),
starting at its law's identity.  A re-anchored state is kept during the pass at a *working*
anchor (``working_value``): the running value where it is finite, a fallback where it is not;
``primed`` names an anchor at another point (new, left, right), and ``mul0`` is the product
under which an empty state stays empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import sympy as sp

INDEX_SENTINEL = np.iinfo(np.int64).max  # "no index yet": loses every tie
INDEX_KEY = "#i"  # the element's integer position in the element environment


class StateKind(str, Enum):
    """What a state variable holds; its storage follows (an index is an int64, a top-k
    state holds k slots).  A ``str`` enum: the laws table spells kinds as plain strings."""

    VALUE = "value"
    INDEX = "index"
    VALUES_K = "values_k"
    INDICES_K = "indices_k"
    COUNT = "count"

    @property
    def is_index(self) -> bool:
        return self in (StateKind.INDEX, StateKind.INDICES_K)

    @property
    def per_k(self) -> bool:
        """One slot per selected element (top-k) rather than per feature."""
        return self in (StateKind.VALUES_K, StateKind.INDICES_K)


@dataclass(frozen=True)
class StateVar:
    """One state variable: its symbol, initial value (the law's identity) and meaning."""

    symbol: sp.Symbol
    init: sp.Expr
    meaning: str
    kind: StateKind = StateKind.VALUE

    def __post_init__(self):
        object.__setattr__(self, "kind", StateKind(self.kind))  # a law's string, checked


def primed(a: sp.Symbol, mark: str = "'") -> sp.Symbol:
    """The same anchor at another point: m -> m' (new), m_L, m_R ..."""
    return sp.Symbol(a.name + mark, **a.assumptions0)


def mul0(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a * b where an exact 0 on either side wins (0 * inf = 0 * nan = 0)."""
    return np.where((a == 0) | (b == 0), 0, a * b)


# Working anchors (module doc): the value a re-anchored state is held at where the running
# value cannot serve.  An anchor the state only re-anchors through exp() and polynomial
# shifts is held at 0 where it is not finite; one whose power the state keeps (1/m, m**2:
# ``separate.state_factor``) is also held away from 0, where that power has its pole or zero
# (the state there would be inf/NaN or 0 whatever it summed), at 1 (every such power is 1).
WORKING_FALLBACK = {False: 0.0, True: 1.0}  # guarded? -> where the state is held instead


def working_value(v: np.ndarray, guarded: bool, dt: np.dtype) -> np.ndarray:
    """The working anchor for the running value ``v``: ``v`` where it is finite (and, for a
    guarded anchor, not 0), else the fallback."""
    usable = np.isfinite(v) & (v != 0) if guarded else np.isfinite(v)
    return np.where(usable, v, dt.type(WORKING_FALLBACK[guarded]))


def guarded_anchors(components) -> frozenset[str]:
    """Anchors some state keeps a power of (see ``WORKING_FALLBACK``)."""
    return frozenset().union(*(getattr(c, "guards", frozenset()) for c in components))
