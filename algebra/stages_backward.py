"""The backward of a staged cascade (``StagedRule.backward``, ``algebra.stages``).

A staged forward's passes are how it is computed, not what it computes: its backward is the
gradient of the cascade's math, derived from the whole cascade by the reverse sweep every
backward uses (``algebra.backward``) and proven the same way, against ``sympy.diff`` of the
multi-pass definition.  An earlier stage's final that a later stage reads (mad's ``mu``) is
a per-row result like any other: reverse mode passes it the later stage's adjoint (a sum
over the row, ``g_mu_sum``), which it hands on to the stream, where the gradients add.
Kinks follow torch: ``abs'(0) = 0``, ``relu'(0) = 0``, a select branch by branch.

What the backward reads (``saved``) are per-row finals of the forward.  Written with each of
them an output (``forward_spec``: a hidden sum named, an argmax for a selection) the forward
is derived again as the rule was, in stages, and each saved value is named with the pass
that computes it.  The backward spec is derived the same way (``passes="auto"``): one pass
where it has one, else in stages (a sum whose body reads, at a kink, an adjoint the
backward computes over the same row).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from .backward import Backward, backward
from .cascade import Cascade
from .errors import NoBackward, NotFusable
from .rule import FusionRule
from .spec import parse

Rederive = Callable[[Cascade], object]  # a cascade -> its FusionRule, or its StagedRule


@dataclass(frozen=True)
class StagedBackward(Backward):
    """The ``Backward`` of a staged cascade, with how it runs: the results each pass of
    the forward computes (its saved values among them) and the backward spec's passes
    (0 where no kernel runs: every gradient a map, ``Backward.is_map``)."""

    forward_passes: tuple[tuple[str, ...], ...] = ()
    passes: int = 1

    def __str__(self) -> str:
        lines = [f"staged forward ({len(self.forward_passes)} passes): the backward is the "
                 "whole cascade's, reverse mode through each final a later pass reads, as "
                 "through any per-row result"]
        for k, results in enumerate(self.forward_passes):
            kept = [s for s in self.saved if s in results]
            lines.append(f"  forward pass {k + 1} computes {', '.join(results)}"
                         f"{'; saves ' + ', '.join(kept) if kept else ''}")
        runs = ("no kernel: every gradient is a map" if self.passes == 0 else
                "one pass over the stream" if self.passes == 1 else
                f"{self.passes} passes over the stream (staged, as the forward)")
        lines.append(f"  the backward spec runs in {runs}")
        return "\n".join([*lines, str(super().__str__())])


def staged_backward(cascade: Cascade, outputs: tuple[str, ...] | None,
                    rederive: Rederive) -> StagedBackward:
    """The derived, proven backward of a staged ``cascade`` for the gradients of
    ``outputs`` (default: its terminal outputs), its forward and backward specs derived by
    ``rederive`` (module docstring).

    Examples
    --------
    >>> import algebra
    >>> b = algebra.derive("mad").backward()
    >>> print(b.spec)
    g_mu_sum = sum(dmad*sign(mu - x[i])/N**2)
    dx[i] = g_mu_sum - dmad*sign(mu - x[i])/N
    >>> b.saved, b.proven, b.forward_passes, b.passes
    (('mu',), True, (('mu_sum', 'mu'), ('mad_sum', 'mad')), 1)
    """
    b = backward(cascade, outputs)
    forward = _rederived(b.forward_spec, rederive)
    runs = _rederived(b.spec, rederive) if b.spec else None
    fields = {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}
    return StagedBackward(**fields, forward_passes=_passes_of(forward),
                          passes=0 if runs is None else len(_passes_of(runs)))


def _rederived(spec: str, rederive: Rederive):
    try:
        return rederive(parse(spec))
    except NotFusable as why:
        raise NoBackward(f"the backward's cascade has no staged rule: {why}") from why


def _passes_of(rule) -> tuple[tuple[str, ...], ...]:
    """The per-row results each pass of ``rule`` computes: one pass for a ``FusionRule``,
    else one a stage."""
    if isinstance(rule, FusionRule):
        c = rule.cascade
        return (tuple(r.name for r in c.reductions) + tuple(c.epilogues),)
    return tuple(stage.results for stage in rule.stages)
