"""The precision plan: per state, the precision it needs and why, derived from its family.

Kernels store inputs and per-element outputs in bfloat16, float16 or float32
(``algebra.dtypes``) and hold every state in float32.  The plan says where a
lower-precision state would be safe and where not, so that a user who writes a chunked
low-precision kernel by hand sees which accumulator must stay float32 (a float16 partial
sum over chunks is a known class of convergence bugs).  Ours are float32 by construction:
the plan is what the engine knows, stated per state, not an option.

A row per (family, state kind, how its anchors re-anchor it): the need ("any": exact in
the inputs' own dtype, so any storage dtype holds it; "float32": must stay float32;
"int64": an index) and the reason.

Examples
--------
>>> from algebra import derive
>>> [(state, need) for state, need, _ in precision_plan(derive("softmax"))]
[('m', 'any'), ('d', 'float32')]
>>> precision_lines(derive("softmax"))[1][:45]
'd: float32 (re-anchored by scaling (exp(m_old'
"""

from __future__ import annotations

from .families import Family
from .state import StateKind

_SELECTED = ("any", "a max or min copies one of its inputs: exact in the inputs' dtype")
_INDEX = ("int64", "an element's index")
_SUM = ("float32", "a sum of N terms: each chunk's rounding adds up, and a bfloat16 sum of "
                   "ones stops growing at 256")
_COUNT = ("float32", "a count: float32 holds it exactly to 2**24, bfloat16 only to 256")
_SCALED = ("float32", "re-anchored by scaling (exp(m_old - m_new), in (0, 1] for a running "
                      "max): N terms need float32")
_MIXED = ("float32", "re-anchored by a shift that mixes its columns ((x - m')**2 from "
                     "(x - m)**2, (x - m), 1): they can cancel")
# (family, state kind, re-anchoring) -> (need, why); re-anchoring: "scales" (a diagonal
# matrix: each column times a factor), "mixes" (a matrix that combines columns), "" (none)
PLAN = {
    (Family.EXTREME, StateKind.VALUE, ""): _SELECTED,
    (Family.ARG_EXTREME, StateKind.VALUE, ""): _SELECTED,
    (Family.ARG_EXTREME, StateKind.INDEX, ""): _INDEX,
    (Family.TOP_K, StateKind.VALUES_K, ""): _SELECTED,
    (Family.TOP_K, StateKind.INDICES_K, ""): _INDEX,
    (Family.SUM, StateKind.VALUE, ""): _SUM,
    (Family.SUM, StateKind.COUNT, ""): _COUNT,
    (Family.ANCHORED_SUM, StateKind.VALUE, "scales"): _SCALED,
    (Family.ANCHORED_SUM, StateKind.VALUE, "mixes"): _MIXED,
    (Family.ANCHORED_SUM, StateKind.COUNT, "scales"): _COUNT,
    (Family.ANCHORED_SUM, StateKind.COUNT, "mixes"): _COUNT,
    (Family.PRODUCT, StateKind.VALUE, ""): (
        "any", "a product's sign (+1, -1 or 0; its magnitude is a sum of logs): exact"),
}
WORDS = {"any": "any dtype", "float32": "float32", "int64": "int64"}


def _reanchoring(comp) -> str:
    if comp.family is not Family.ANCHORED_SUM:
        return ""
    return "scales" if comp.matrix.is_diagonal() else "mixes"


def precision_plan(rule) -> list[tuple[str, str, str]]:
    """(state, need, why) for every state of ``rule``'s components."""
    out = []
    for comp in rule.components:
        for s in comp.state:
            need, why = PLAN[comp.family, s.kind, _reanchoring(comp)]
            out.append((s.symbol.name, need, why))
    return out


def precision_lines(rule) -> list[str]:
    """The plan as ``str(rule)`` prints it."""
    return [f"{name}: {WORDS[need]} ({why})" for name, need, why in precision_plan(rule)]
