"""Which lowering emits a component family's TIR, per backend.

Each component names its family (``algebra.families.Family``, as data: ``comp.family``).
A family's lowering owns how that family UPDATES (one element, or one element of a tile),
MERGES two partial states and FINALIZES (``settle``: a re-anchored state moves to the true
final anchors; ``reselect``: an anchored selection selects again).  Its states are
initialised from the law's identity (``StateVar.init``, ``registers.States.init``), the same
for every family.  The ``Emitter`` walks the rule's components and asks ``lowering_for``;
it never tests a component's class.

Lowerings are registered the way JAX's ``register_lowering(prim, rule, platform=...)`` is:
``register(family, lowering, backend=None)`` in the module that knows the family
(``sums.py``, ``selections.py``, ``products.py``), ``backend=None`` being the default for every
backend in ``lowering.backends.BACKENDS``.  A new case plugs in as a new registration, not
as new branches:

- a new component family (a backward rule's, say): a row in ``algebra.families`` and a
  module here calling ``register`` for it;
- a backend- or dtype-specific way to lower a family (a CUDA warp-shuffle merge, an fp8
  accumulate): a lowering registered for that family with ``backend="cuda"``, overriding
  the default there only.

>>> from algebra.families import Family
>>> from redfuser.lowering.families import lowering_for_family
>>> lowering_for_family(Family.TOP_K, "cuda").direct
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from algebra.families import Family


@dataclass(frozen=True)
class Element:
    """One element folded into lane ``lane`` of a row ``r``: its index ``i``, its bound dot
    products, and (outside tiles) the lane's held anchors before the step (``old``), the
    working anchors moved so far (``moved``, filled as components move them) and the lane's
    count before the step."""

    lane: Any
    i: Any
    r: Any
    dots: dict
    old: dict | None = None
    moved: dict | None = None
    count: Any = None


@dataclass(frozen=True)
class Join:
    """Lane ``a`` <- merge(lane ``a``, lane ``b``) of row ``r``: their held anchors
    (``left``, ``right``), the anchors moved so far, their counts, and ``aligned`` (both
    lanes are held at the same working anchors).  A selection reads only the lanes."""

    a: Any
    b: Any
    r: Any = None
    left: dict | None = None
    right: dict | None = None
    moved: dict | None = None
    n_a: Any = None
    n_b: Any = None
    aligned: bool = False


class FamilyLowering(Protocol):
    """How one component family is emitted (``em``: the ``Emitter``, ``st``: its states).
    ``direct``: the family folds straight into the running lane, never in a tile of its
    own."""

    direct: bool

    def update(self, em, st, comp, e: Element) -> None: ...

    def tile_step(self, em, st, comp, e: Element, basis) -> None: ...

    def merge(self, em, st, comp, j: Join) -> None: ...

    def settle(self, em, st, comp, r) -> None: ...

    def reselect(self, em, st, comp, r) -> None: ...


_LOWERINGS: dict[tuple[Family, str | None], FamilyLowering] = {}


def register(family: Family, lowering: FamilyLowering, backend: str | None = None) -> None:
    """Lower ``family`` with ``lowering`` on ``backend`` (None: on every backend that has no
    registration of its own)."""
    key = (Family(family), backend)
    if key in _LOWERINGS:
        raise ValueError(f"a lowering of {key[0].value} is already registered for "
                         f"{backend or 'every backend'}")
    _LOWERINGS[key] = lowering


def lowering_for_family(family: Family, backend: str | None = None) -> FamilyLowering:
    """The lowering of ``family`` on ``backend``: its own registration, else the default."""
    found = _LOWERINGS.get((family, backend)) or _LOWERINGS.get((family, None))
    if found is None:
        raise LookupError(f"no lowering of {family.value} for {backend or 'every backend'}")
    return found


def lowering_for(component, backend: str | None = None) -> FamilyLowering:
    """The lowering of ``component``'s family on ``backend``."""
    return lowering_for_family(component.family, backend)
