"""The algebra pipeline, top to bottom: parse -> lift -> separate -> derive -> prove."""

from __future__ import annotations

from .derive import derive_components, running_values
from .errors import NotFusable
from .library import LIBRARY, resolve_spec
from .limits import DERIVE_BUDGET_S, charged_to, time_budget
from .rule import FusionRule
from .spec import parse


def derive(spec: str, *, budget_s: float | None = DERIVE_BUDGET_S.value) -> FusionRule:
    """Derive the proven one-pass fusion rule of a cascade (spec text or a library name).

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
    """
    with time_budget(budget_s):
        return _derive(spec)


def _derive(spec: str) -> FusionRule:
    text = resolve_spec(spec)
    cascade = parse(text)  # stages 1-2: parse and lift to sympy
    components = derive_components(cascade)  # stages 3-4: separate each body, derive its state
    with charged_to(cascade.reductions[-1]):
        running = running_values(cascade, components)
    obligations = [(c, o) for c in components for o in c.obligations]
    status = []
    for comp, o in obligations:  # stage 5: prove
        with charged_to(comp.reduction):
            status.append(o.check())
    for (comp, o), ok in zip(obligations, status, strict=True):
        if not ok:
            raise NotFusable(comp.reduction.name, o.statement(),
                             f"could not be proven by sympy ({o.law}); the rule is not returned")
    name = spec if spec in LIBRARY else None
    return FusionRule(cascade, components, running, tuple(status), name)
