"""Stage 5, prove: the identities a rule relies on, each checked by sympy.

An ``Obligation`` is either an identity ``lhs == rhs`` (checked by reducing
``lhs - rhs`` to zero) or a sign fact (``expr > 0`` and friends, checked with
sympy's assumption system).  "sympy could not decide" is a failure, never a pass.
An identity with selects (``where``) is proven case by case: under every truth assignment
of its comparisons (``algebra.selects.cases``).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .selects import cases, has_select

SIGNS = {  # predicate -> (sympy assumption query, printed relation)
    "positive": (lambda e: e.is_positive, "> 0"),
    "negative": (lambda e: e.is_negative, "< 0"),
    "nonnegative": (lambda e: e.is_nonnegative, ">= 0"),
    "nonpositive": (lambda e: e.is_nonpositive, "<= 0"),
}


def is_zero(e: sp.Expr | sp.MatrixBase) -> bool:
    """True only if sympy reduces ``e`` to exactly zero (cheap rewrites first).

    Examples
    --------
    >>> x, m0, m1 = sp.symbols("x m0 m1", real=True)
    >>> is_zero(sp.exp(x - m1) - sp.exp(m0 - m1) * sp.exp(x - m0))
    True
    >>> is_zero(sp.exp(x - m1) - sp.exp(x - m0))
    False
    """
    if isinstance(e, sp.MatrixBase):
        return all(is_zero(v) for v in e)
    if e == 0:
        return True
    if has_select(e):  # select semantics: the identity must hold in every case
        return all(c == 0 or (not has_select(c) and is_zero(c)) for c in cases(e))
    for rewrite in (lambda v: sp.expand(sp.powsimp(sp.expand(v))), _waves_as_exp, sp.simplify):
        if rewrite(e) == 0:
            return True
    return False


def _waves_as_exp(e: sp.Expr) -> sp.Expr:
    """sin and cos as complex exponentials, expanded: identities of rotating pairs (the
    angle-addition law) become cancellations of exponentials, which expand decides quickly
    (simplify takes seconds on a 2x2 rotation composed twice)."""
    if not e.has(sp.sin, sp.cos):
        return e
    return sp.expand(sp.powsimp(sp.expand(e.rewrite(sp.exp))))


@dataclass(frozen=True)
class Obligation:
    """One proof obligation: an identity (lhs == rhs) or a sign fact (lhs `sign`)."""

    name: str
    law: str  # why the rule needs it
    lhs: sp.Expr | sp.MatrixBase
    rhs: sp.Expr | sp.MatrixBase | None = None
    sign: str | None = None  # a key of SIGNS for sign facts

    def check(self) -> bool:
        if self.sign is not None:
            return SIGNS[self.sign][0](self.lhs) is True
        return is_zero(self.lhs - self.rhs)

    def statement(self) -> str:
        if self.sign is not None:
            return f"{self.lhs} {SIGNS[self.sign][1]}"
        return f"{self.lhs} == {self.rhs}"

    def latex(self) -> str:
        if self.sign is not None:
            rel = SIGNS[self.sign][1].replace(">=", r"\geq").replace("<=", r"\leq")
            return f"{sp.latex(self.lhs)} {rel}"
        return f"{sp.latex(self.lhs)} = {sp.latex(self.rhs)}"
