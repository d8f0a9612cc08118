"""Skips: conditions under which an element cannot change the state, so whole blocks of
elements where they hold need not be read at all.

Law: if, with a select's condition ``c`` set false, every component's element term is its
family's identity (a sum's basis is 0 in every column, a max's candidate is -inf, a min's
+inf, a product's factor is 1), then an element on which ``c`` is false leaves the state
exactly as it was (the identity of each merge), and so does any block of such elements.
Masks are where this pays: causal attention's ``where(i <= pos, s, -inf)`` makes every key
after the query's position such an element.  Selections that return an index are excluded:
a row whose every element is skipped would return no index where the reference returns the
first one; so are rules that count their elements (``N``).
"""

from __future__ import annotations

import sympy as sp
from sympy.logic.boolalg import Boolean

from .cascade import INDEX
from .components import LinearComponent, ProductComponent, SelectComponent
from .functions import Where

# sympy's relations as the spec spells them
RELATIONS = {sp.LessThan: "<=", sp.StrictLessThan: "<", sp.GreaterThan: ">=",
             sp.StrictGreaterThan: ">"}


def skip_conditions(rule) -> list[Boolean]:
    """The select conditions ``c`` of ``rule``'s element terms such that an element with
    ``c`` false leaves every component unchanged (see the module docstring).  None for a
    rule that counts its elements (``N`` in it counts the skipped ones too).

    Examples
    --------
    >>> from algebra import derive
    >>> skip_conditions(derive("causal_attention"))
    [i <= pos]
    >>> skip_conditions(derive("softmax"))
    []
    """
    terms = [_element_terms(c) for c in rule.components]
    if rule.uses_count or any(t is None for t in terms):
        return []
    conds = {w.args[0] for ts in terms for t, _ in ts for w in sp.preorder_traversal(t)
             if isinstance(w, Where)}
    return sorted((c for c in conds if all(sp.simplify(t.xreplace({c: sp.false})) == ident
                                           for ts in terms for t, ident in ts)), key=str)


def _element_terms(comp) -> list[tuple[sp.Expr, sp.Expr]] | None:
    """(an element's term, the identity it must reduce to) for each part of ``comp``; None
    where no element of the component may be skipped."""
    if isinstance(comp, LinearComponent):
        return [(b, sp.S.Zero) for b in comp.basis]
    if isinstance(comp, SelectComponent) and comp.k == 1 and len(comp.state) == 1:
        return [(comp.core, -sp.oo if comp.direction > 0 else sp.oo)]
    if isinstance(comp, ProductComponent):
        return [(comp.factor, sp.S.One)]
    return None


def index_bound(cond) -> tuple[str, sp.Expr] | None:
    """(op, e) for a condition ``i op e`` with ``e`` free of the index (either side),
    else None.

    Examples
    --------
    >>> i, pos = sp.symbols("i pos", real=True)
    >>> index_bound(pos >= i), index_bound(i <= pos + i)
    (('<=', pos), None)
    """
    if type(cond) not in RELATIONS:
        return None
    if getattr(cond.lhs, "name", None) == INDEX:
        rel = cond
    elif getattr(cond.rhs, "name", None) == INDEX:
        rel = cond.reversed
    else:
        return None
    if any(s.name == INDEX for s in rel.rhs.free_symbols):
        return None
    return RELATIONS[type(rel)], rel.rhs
