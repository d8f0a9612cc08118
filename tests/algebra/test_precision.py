"""The precision plan (``algebra.precision``): every state of every library rule has a row,
and the rows say what the state's family and re-anchoring make it need."""

from __future__ import annotations

import pytest

from algebra import FusionRule, derive
from algebra.library import LIBRARY
from algebra.precision import PLAN, precision_plan


def _rules(name: str) -> list[FusionRule]:
    rule = derive(name)
    return [rule] if isinstance(rule, FusionRule) else [s.rule for s in rule.stages]


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_every_state_of_every_library_rule_has_a_need(name):
    for rule in _rules(name):
        plan = precision_plan(rule)
        assert [s for s, _, _ in plan] == [v.symbol.name for c in rule.components
                                          for v in c.state]
        assert "precision (what each state needs" in str(rule)


@pytest.mark.parametrize("spec,state,need,why", [
    ("softmax", "m", "any", "copies one of its inputs"),
    ("softmax", "d", "float32", "exp(m_old - m_new), in (0, 1] for a running max"),
    ("layernorm", "var_sum", "float32", "mixes its columns"),
    ("m = max(x[i])\np = argmax(x[i] - m)", "p", "int64", "index"),
    ("p = prod(x[i])", "p.sign", "any", "a product's sign"),
    ("p = prod(x[i])", "p.log", "float32", "a sum of N terms"),
    ("s = sum(x[i])", "s", "float32", "bfloat16 sum of ones stops growing at 256"),
])
def test_the_need_follows_the_family_and_the_reanchoring(spec, state, need, why):
    plan = {s: (n, w) for s, n, w in precision_plan(derive(spec))}
    found = plan[state]
    assert found[0] == need and why in found[1], found


def test_every_row_is_reached():
    """A row no rule reaches is dead data (or a family the plan misnames)."""
    rules = [r for name in LIBRARY for r in _rules(name)] + [derive("p = prod(x[i])")]
    reached = {(c.family, v.kind, "" if c.family.value != "anchored_sum" else
                "scales" if c.matrix.is_diagonal() else "mixes")
               for rule in rules for c in rule.components for v in c.state}
    reached |= {k for k in PLAN if k[1].value == "count"}  # the count is the rule's own
    assert set(PLAN) <= reached, sorted(set(PLAN) - reached)
