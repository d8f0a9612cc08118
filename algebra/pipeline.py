"""The algebra pipeline, top to bottom: parse -> lift -> separate -> derive -> prove."""

from __future__ import annotations

from contextlib import nullcontext

from .cascade import Cascade
from .derive import derive_components, running_values
from .errors import NotFusable
from .library import LIBRARY, STAGED, resolve_spec
from .limits import DERIVE_BUDGET_S, charged_to, time_budget
from .rule import FusionRule
from .spec import parse
from .stages import StagedRule, staged

PASSES = (1, "auto")  # one pass (refuse what has none), or the fewest stages


def derive(spec: str, *, passes: int | str = 1,
           budget_s: float | None = DERIVE_BUDGET_S.value) -> FusionRule | StagedRule:
    """Derive the proven one-pass fusion rule of a cascade (spec text or a library name).

    ``passes="auto"`` cuts a cascade with no one-pass rule into the fewest stages, each a
    proven one-pass rule reading the earlier stages' final values (a ``StagedRule``,
    ``algebra.stages``); a cascade that has a one-pass rule still gets its ``FusionRule``.
    ``passes=1`` (the default) refuses it with the ``NotFusable`` of the first stage
    boundary.  Library cascades that need stages are staged when named.

    Every identity the rule relies on is checked by sympy first; a rule that could
    not be proven is never returned (``NotFusable`` names the reduction and why).
    Any string gets a rule, a ``SpecError`` or a ``NotFusable`` within bounded work: the
    limits of ``algebra.limits`` (size, nesting, constants, powers, reductions), and
    ``budget_s`` seconds of CPU time as the last resort (None: no budget).

    Examples
    --------
    >>> rule = derive("m = max(x[i]); d = sum(exp(x[i] - m))")
    >>> for new, value in rule.update_lines():
    ...     print(f"{new} = {value}")
    m' = max(m, x)
    d' = d*exp(m - m') + exp(-m' + x)
    >>> rule.verify()
    True
    >>> staged_rule = derive("m = max(x[i]); r = sum(relu(x[i] - m + 1))", passes="auto")
    >>> [stage.rule.outputs for stage in staged_rule.stages]
    [('m',), ('r',)]
    """
    if passes not in PASSES:
        raise ValueError(f"passes must be 1 or 'auto', not {passes!r}")
    with time_budget(budget_s):
        return _derive(spec, "auto" if isinstance(spec, str) and spec.strip() in STAGED else passes)


def _derive(spec: str, passes: int | str = 1) -> FusionRule | StagedRule:
    cascade = parse(resolve_spec(spec))  # stages 1-2: parse and lift to sympy
    name = spec.strip() if isinstance(spec, str) and spec.strip() in LIBRARY else None
    try:
        return derive_cascade(cascade, name)
    except NotFusable:
        if passes == 1:
            raise
    return staged(cascade, derive_cascade, name)


def derive_cascade(cascade: Cascade, name: str | None = None) -> FusionRule:
    """The proven one-pass rule of a lifted cascade (``NotFusable`` if it has none)."""
    components = derive_components(cascade)  # stages 3-4: separate each body, derive its state
    with charged_to(cascade.reductions[-1]) if cascade.reductions else nullcontext():
        running = running_values(cascade, components)  # a map (no reduction) has none
    obligations = [(c, o) for c in components for o in c.obligations]
    status = []
    for comp, o in obligations:  # stage 5: prove
        with charged_to(comp.reduction):
            status.append(o.check())
    for (comp, o), ok in zip(obligations, status, strict=True):
        if not ok:
            raise NotFusable(comp.reduction.name, o.statement(),
                             f"could not be proven by sympy ({o.law}); the rule is not returned")
    return FusionRule(cascade, components, running, tuple(status), name)
