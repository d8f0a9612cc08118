"""The algebra pipeline, top to bottom: parse -> lift -> separate -> derive -> prove."""

from __future__ import annotations

from .derive import derive_components, running_values
from .errors import NotFusable
from .library import LIBRARY, resolve_spec
from .rule import FusionRule
from .spec import parse


def derive(spec: str) -> FusionRule:
    """Derive the proven one-pass fusion rule of a cascade (spec text or a library name).

    Every identity the rule relies on is checked by sympy first; a rule that could
    not be proven is never returned (``NotFusable`` names the reduction and why).

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
    text = resolve_spec(spec)
    cascade = parse(text)  # stages 1-2: parse and lift to sympy
    components = derive_components(cascade)  # stages 3-4: separate each body, derive its state
    running = running_values(cascade, components)
    obligations = [(c, o) for c in components for o in c.obligations]
    status = tuple(o.check() for _, o in obligations)  # stage 5: prove
    for (comp, o), ok in zip(obligations, status, strict=True):
        if not ok:
            raise NotFusable(comp.reduction.name, o.statement(),
                             f"could not be proven by sympy ({o.law}); the rule is not returned")
    name = spec if spec in LIBRARY else None
    return FusionRule(cascade, components, running, status, name)
