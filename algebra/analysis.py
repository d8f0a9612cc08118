"""Facts about a proven rule that the lowering reads, computed once per rule (cached on it).

Pure sympy: what a rule *is* (its components' families, the unfused baseline's passes) is
the algebra's business; the lowering only emits what these say.
"""

from __future__ import annotations

import dataclasses

from .derive import derive_components, running_values
from .rule import FusionRule


def unfused_rules(rule: FusionRule) -> tuple[FusionRule, ...]:
    """The unfused baseline's passes: one rule per reduction of ``rule``, in order
    (``stage_rule``), derived once per rule.

    >>> from algebra import derive
    >>> rule = derive("softmax")
    >>> [[r.name for r in s.cascade.reductions] for s in unfused_rules(rule)]
    [['m'], ['d']]
    >>> unfused_rules(rule) is unfused_rules(rule)
    True
    """
    return rule.compiled(("analysis.unfused_rules",), lambda: tuple(
        stage_rule(rule, k) for k in range(len(rule.cascade.reductions))))


def stage_rule(rule: FusionRule, index: int) -> FusionRule:
    """Reduction ``index`` alone, reading earlier results as per-row parameters.  A
    selection keeps the fused rule's component: ``argtopk(exp(x - m) / d)`` ranks ``x``
    (the monotone commutation), since the float32 values of the body tie where the float64
    oracle's do not (exp(-1e-11) rounds to 1), and selects again over the body where an
    anchor is not finite, as the fused kernel does."""
    c = rule.cascade
    red = dataclasses.replace(c.reductions[index], anchors=())
    cascade = dataclasses.replace(c, reductions=(red,), epilogues={}, elementwise={},
                                  outputs=(red.name,))
    fused = next(comp for comp in rule.components if comp.reduction.name == red.name)
    if not fused.family.selects:
        comps = derive_components(cascade)
        return FusionRule(cascade, comps, running_values(cascade, comps), ())
    # its anchors are the earlier passes' final values: read as themselves (per-row values)
    alone = dataclasses.replace(fused, anchors=())  # finalize reads them as symbols
    running = {**running_values(cascade, (alone,)), **{a.name: a for a in fused.anchors}}
    return FusionRule(cascade, (fused,), running, ())
