"""The whole pipeline, top to bottom: parse -> lift -> separate -> derive -> prove (the
algebra engine), then lower -> schedule -> build (per geometry, inside ``Kernel``)."""

from __future__ import annotations

from algebra import FusionRule, derive

from .kernel import Kernel


def compile(rule_or_spec: FusionRule | str, target: str = "cpu", **options) -> Kernel:  # noqa: A001
    """Compile a fusion rule (or a spec / library name) into a TVM kernel.

    Options: ``variant`` ("rolling", "split", "unfused"; default: chosen per shape by
    ``plan.choose``), ``splits``, ``fast_math`` (polynomial exp; default True),
    ``threads``.  Only proven rules reach this point: ``derive`` refuses the rest.

    Schedules (``tune``): each new shape first looks in the tuning database (written by
    ``redfuser tune`` or an earlier ``tune=True``; see ``redfuser.tune``) and uses the
    measured best plan stored there for this spec, shape, target and machine; without an
    entry, ``plan.choose``'s hand-written rules decide.  ``tune=True`` searches a shape
    that has no entry (the cost model ranks the schedule space, the best few candidates
    are measured, the fastest is stored): seconds per new shape, once per machine.
    ``tune="model"`` takes the cost model's first choice (variant included) without
    measuring anything.
    ``tune=False`` never reads the database; pinning ``variant``, ``splits`` or
    ``threads`` also bypasses it.  A corrupt database is ignored with a warning.

    Examples
    --------
    >>> import numpy as np, redfuser
    >>> k = redfuser.compile("softmax")
    >>> out = k(x=np.array([[0.0, 1.0, 2.0]], np.float32))
    >>> np.round(out["y"], 4)
    array([[0.09  , 0.2447, 0.6652]], dtype=float32)
    """
    rule = rule_or_spec if isinstance(rule_or_spec, FusionRule) else derive(rule_or_spec)
    return Kernel(rule, target, **options)
