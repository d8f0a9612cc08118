"""Analyses of a rule's expressions the emitter uses to compute things once: the parts
that do not vary over an axis (hoisted out of its loop) and the dot products."""

from __future__ import annotations

import sympy as sp
from sympy.logic.boolalg import Boolean

from algebra.functions import Dot, Where
from algebra.rule import FusionRule

from .geometry import component_exprs


def split_invariant(exprs, varying: set, per_slot: bool = True):
    """``exprs`` with their largest parts free of ``varying`` names replaced by fresh
    symbols; returns (exprs, part -> symbol).  ``per_slot``: a dot product counts as
    invariant (it is one number per element, whatever its operands carry)."""
    found: dict[sp.Expr, sp.Symbol] = {}
    names = _names_outside_dots if per_slot else (lambda e: {s.name for s in e.free_symbols})

    def visit(e):
        if _hoistable(e, varying, names):
            return found.setdefault(e, sp.Dummy(f"inv{len(found)}"))
        if e.is_Mul:  # the invariant factors of a product as one value: x/r * w[slot] is
            fixed = [a for a in e.args if not names(a) & varying]  # one multiply per slot
            if len(fixed) > 1 and _hoistable(sp.Mul(*fixed), varying, names):
                rest = [visit(a) for a in e.args if names(a) & varying]
                return sp.Mul(found.setdefault(sp.Mul(*fixed), sp.Dummy(f"inv{len(found)}")),
                              *rest)
        return e.func(*[visit(a) for a in e.args]) if e.args else e

    return [visit(e) for e in exprs], found


def _hoistable(e: sp.Expr, varying: set, names) -> bool:
    """Worth computing once outside the loop: not a leaf, no ``varying`` name."""
    # a select is not hoisted whole, its branches are: attention's masked d and o then share
    # one exp(s - m); a condition stays where its select reads it (caches hold floats)
    return not (e.is_Atom or e.is_number or isinstance(e, Dot | Where | Boolean)) and \
        not (names(e) & varying)


def _names_outside_dots(e: sp.Expr) -> set[str]:
    """Free symbol names of ``e``, except inside dot products (a dot is one number per
    element: it does not vary over the feature axis its operands carry)."""
    if isinstance(e, Dot):
        return set()
    if e.is_Symbol:
        return {e.name}
    return set().union(*(_names_outside_dots(a) for a in e.args)) if e.args else set()


def rule_dots(rule: FusionRule) -> list:
    """Every dot product the rule's components evaluate per element, in a fixed order."""
    return sorted({d for c in rule.components for e in component_exprs(c)
                   for d in e.atoms(Dot)}, key=str)
