"""Analyses of a rule's expressions the emitter uses to compute things once: the parts
that do not vary over an axis (hoisted out of its loop), the dot products, and the
scores (what a selection ranks, which later reductions read again)."""

from __future__ import annotations

import dataclasses

import sympy as sp
from sympy.logic.boolalg import Boolean

from algebra.families import element_exprs, with_element_exprs
from algebra.functions import Dot, Where
from algebra.rule import FusionRule


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
    return sorted({d for c in rule.components for e in element_exprs(c)
                   for d in e.atoms(Dot)}, key=str)


def rule_scores(rule: FusionRule) -> tuple[sp.Expr, ...]:
    """What the rule's selections rank that is computed rather than read: attention's
    ``scale*dot(q, k)``, and each branch of a masked score ``where(c, s, -inf)``.  The
    running max of such a score and the ``exp(s - m)`` terms must see one value per
    element: computed twice, a compiler may round it once and fuse it into the
    subtraction the other time (an FMA), and at |s| = 1e6 the two differ by 0.5."""
    found = set()
    for comp in rule.components:
        if comp.family.selects:
            found |= _computed(comp.core)
    return tuple(sorted(found, key=str))


def _computed(e: sp.Expr) -> set:
    if isinstance(e, Where):
        return _computed(e.args[1]) | _computed(e.args[2])
    return set() if e.is_Atom or isinstance(e, Dot) else {e}


def score_symbol(k: int) -> sp.Symbol:
    """The symbol standing for score ``k`` ('@' never occurs in a spec name)."""
    return sp.Symbol(f"score@{k}", real=True)


def with_scores(rule: FusionRule, scores) -> tuple[FusionRule, dict[str, sp.Expr]]:
    """``rule`` with every score in its per-element expressions replaced by a symbol (the
    largest first), and symbol name -> score."""
    table = {score_symbol(k): e for k, e in enumerate(scores)}
    if not table:
        return rule, {}
    order = sorted(((e, sym) for sym, e in table.items()), key=lambda p: -sp.count_ops(p[0]))

    def sub(e):
        return _replaced(e, order)

    comps = tuple(_substituted(c, sub) for c in rule.components)
    cascade = dataclasses.replace(rule.cascade, elementwise={
        k: sub(e) for k, e in rule.cascade.elementwise.items()})
    return dataclasses.replace(rule, cascade=cascade, components=comps, _cache={}), \
        {sym.name: e for sym, e in table.items()}


def _replaced(e: sp.Expr, order) -> sp.Expr:
    """``e`` with each score of ``order`` [(score, symbol)] replaced where it occurs as a
    subtree or as a subset of a sum's terms, and nowhere else.  Not ``subs``: sympy
    substitutes a sum into a sum it only overlaps (``(x/4 - m).subs(x/4 - L, s)`` is
    ``s + L - m``), which in float32 computes x/4 - L + L: x is lost for L = 1e30."""
    for score, symbol in order:
        if e == score:
            return symbol
    if e.is_Add:
        terms, found = list(e.args), []
        for score, symbol in order:
            parts = list(score.args) if score.is_Add else [score]
            if all(terms.count(t) >= parts.count(t) for t in parts):
                for t in parts:
                    terms.remove(t)
                found.append(symbol)
        return sp.Add(*[_replaced(t, order) for t in terms], *found)
    if e.args and not e.is_Atom:
        return e.func(*[_replaced(a, order) for a in e.args])
    return e


def _substituted(comp, sub):
    return with_element_exprs(comp, tuple(sub(e) for e in element_exprs(comp)))
