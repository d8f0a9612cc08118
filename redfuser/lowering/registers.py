"""Per-lane registers of a kernel: every state variable, every working anchor, and the NaN
mark of every plain max/min.

A working anchor is the value a re-anchored state is currently held at (the running
anchor where usable, else a fallback: ``algebra.state.working_value``); it travels
with the state into split workspaces and CUDA shared memory like any other register.  A
plain max/min folds
with the target's own float max (NaN may be dropped: TVM compiles with LLVM's
NoNaNsFPMath) and marks NaN apart, in integers: its mark is the largest |bits| folded,
above the bits of inf exactly when a NaN was seen (two integer operations per element
instead of a NaN-ordered select; integers of the compute dtype's width,
``fastmath.FLOAT_BITS``); finalize turns a marked value into NaN.  States and working
anchors are held in the compute dtype (``Geometry.compute``), indices in int64.
"""

from __future__ import annotations

from algebra.families import Family
from algebra.rule import FusionRule
from algebra.state import INDEX_SENTINEL, StateVar

from ..tvm.ir import T, tirx
from .fastmath import float_bits
from .geometry import Geometry
from .signature import I32, I64, rule_k
from .texpr import const


def working_anchors(rule: FusionRule) -> list[str]:
    """Anchors that re-anchored (linear) states are held at: each gets a register."""
    return sorted({a.name for c in rule.components if c.family.linear
                   for a in c.anchors})


def working(anchor: str) -> str:
    """Name of the register holding ``anchor``'s working value."""
    return f"{anchor}@work"


def nan_marked(rule: FusionRule) -> list[str]:
    """The plain max/min states (one value, no index): each gets a NaN mark."""
    return [c.state[0].symbol.name for c in rule.components
            if c.family is Family.EXTREME]


def nan_mark(state: str) -> str:
    """Name of the register holding the NaN mark of a plain max/min state."""
    return f"{state}@nan"


def registers(rule: FusionRule, geo: Geometry) -> dict[str, tuple[int, str, str, object]]:
    """Every per-lane register: name -> (width, dtype, kind, initial value).  A working
    anchor starts at 0: the initial (empty) state is the same at every anchor; a NaN mark
    starts at 0 (no NaN seen)."""
    out, value = {}, geo.compute
    for s in rule.state:
        out[s.symbol.name] = (register_width(rule, geo, s), I64 if s.kind.is_index else value,
                              s.kind, s.init)
    for a in working_anchors(rule):
        out[working(a)] = (geo.width(a), value, None, 0)  # kind None: an anchor, not a state
    for name in nan_marked(rule):
        out[nan_mark(name)] = (out[name][0], float_bits(value).bits, None, 0)
    return out


def register_width(rule: FusionRule, geo: Geometry, state: StateVar) -> int:
    """Slots of one state variable: k for a top-k list, D on the feature axis, else 1."""
    name = state.symbol.name
    return rule_k(rule, name) if state.kind.per_k else geo.width(name)


class States:
    """Local registers of every state variable and working anchor: one row of ``width``
    slots per lane."""

    def __init__(self, rule: FusionRule, geo: Geometry, lanes: int, scope: str = "local"):
        self.bufs, self.widths, self.inits = {}, {}, {}
        self.count = rule.count.name  # the count's register, when the rule keeps one
        for name, (width, dtype, kind, init) in registers(rule, geo).items():
            self.bufs[name] = T.alloc_buffer((lanes, width), dtype, scope=scope)
            self.widths[name], self.inits[name] = width, _initial(kind, dtype, init)
        self.lanes = lanes

    def get(self, name, lane, slot=0):
        return self.bufs[name][lane, slot if self.widths[name] > 1 else 0]

    def set(self, name, lane, value, slot=0):
        T.buffer_store(self.bufs[name], value, [lane, slot if self.widths[name] > 1 else 0])

    def init(self, lane, names=None):
        """Lane ``lane`` of every register (or of ``names``) to its initial value."""
        for name in names or self.bufs:
            buf, value = self.bufs[name], self.inits[name]
            # no loop for one slot: a loop nested in a vectorized lane loop defeats TVM
            with (T.serial(0, self.widths[name]) if self.widths[name] > 1 else Const0()) as s:
                T.buffer_store(buf, value, [lane, s])


def _initial(kind, dtype: str, init):
    if kind is not None and kind.is_index:
        return tirx.const(INDEX_SENTINEL, I64)  # "no index yet"
    return tirx.const(int(init), dtype) if dtype in (I32, I64) else const(float(init), dtype)


class Const0:
    """``with`` stand-in for a loop of extent 1: yields slot 0."""

    def __enter__(self):
        return 0

    def __exit__(self, *exc):
        return False
