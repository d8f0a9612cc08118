"""Selects (``where(cond, a, b)``) as the algebra sees them: lifted to the top, split by case.

Three laws, each exact under select semantics (the branch not taken never reaches the
result, so they hold for inf and NaN in it too):

- *lifting*: ``f(..., where(c, a, b), ...) = where(c, f(..., a, ...), f(..., b, ...))`` for
  any elementwise ``f``; inside branch ``a`` the condition ``c`` is known true (and false in
  ``b``).  ``lift`` applies it until every select sits at the top of an expression, so a
  reduction body is a tree of selects over select-free *leaves*.  It never crosses a dot
  product: a dot sums over the feature axis, and a condition that varies along that axis
  does not commute with the sum.
- *cases*: an identity between expressions with selects holds iff it holds under every
  truth assignment of their conditions (``cases``); proof obligations are checked that way.
- *leaves*: ``where(c, a, b)`` is ``a`` on the elements where ``c`` holds and ``b`` on the
  others, so a sum of it is the sum of ``a`` over the first set plus the sum of ``b`` over
  the second (``leaves`` gives each leaf with its *mask*, the conjunction of its path).
"""

from __future__ import annotations

from collections.abc import Iterator

import sympy as sp
from sympy.logic.boolalg import Boolean

from .functions import Dot, Where
from .ieee import FLOAT_CLASSES, IsNaN, as_written, ieee_not

MAX_CONDITIONS = 6  # distinct conditions in one expression: 2**6 cases at most to prove


def has_select(e: sp.Basic) -> bool:
    return any(isinstance(n, Where) for n in sp.preorder_traversal(e))


def lift(e: sp.Basic) -> sp.Basic:
    """``e`` with every select moved to the top (outside dot products: left in place).

    Examples
    --------
    >>> s, m = sp.symbols("s m", real=True)
    >>> lift(sp.exp(Where(s > 0, s - m, -sp.oo)))
    where(s > 0, exp(-m + s), 0)
    >>> lift(sp.exp(Where(s > 0, s, -sp.oo) - m))  # exp(-inf - m) is NaN at m = -inf
    where(s > 0, exp(-m + s), exp(-m + as_written(-oo)))
    """
    if not has_select(e) or isinstance(e, Dot) or not e.args:
        return e
    if isinstance(e, Where):
        c, a, b = e.args
        c = lift(c)  # a condition built on a select becomes plain logic
        return Where(c, lift(a.xreplace({c: sp.true})), lift(b.xreplace({c: sp.false})))
    args = [lift(a) for a in e.args]
    for k, a in enumerate(args):
        if isinstance(a, Where):
            c, x, y = a.args
            taken, other = (as_written(e.func, *args[:k], v, *args[k + 1:]) for v in (x, y))
            taken, other = lift(taken.xreplace({c: sp.true})), lift(other.xreplace({c: sp.false}))
            if isinstance(e, Boolean):  # a condition built on a select: plain logic
                return sp.Or(sp.And(c, taken), sp.And(ieee_not(c), other))
            return Where(c, taken, other)
    return e.func(*args)


def conditions(e: sp.Basic) -> list[Boolean]:
    """The conditions of the selects in ``e`` (inside dot products too), in a fixed order."""
    found = {n.args[0] for n in sp.preorder_traversal(e) if isinstance(n, Where)}
    return sorted(found, key=sp.default_sort_key)


def _atoms(e: sp.Basic) -> list[Boolean]:
    """Comparisons and float-class tests (isinf, isfinite) inside select conditions that
    contain no select themselves: the independent facts a case split assigns."""
    out = set()
    for c in conditions(e):
        for n in sp.preorder_traversal(c):
            if isinstance(n, (sp.core.relational.Relational, *FLOAT_CLASSES)) and \
                    not has_select(n):
                out.add(_canonical(n))
    return sorted(out, key=sp.default_sort_key)


def _canonical(r: Boolean) -> Boolean:
    """One of a comparison and its negation (x <= 1/2 and x > 1/2 are one fact, not two
    independent ones: a case split that assigned both True would prove an identity in a
    case that cannot happen, and fail where the identity is right)."""
    if not isinstance(r, sp.core.relational.Relational):  # isinf(x): its negation is Not
        return r
    return min(r, r.negated, key=sp.default_sort_key)


def cases(e: sp.Basic) -> Iterator[sp.Basic]:
    """``e`` under every truth assignment of its comparisons (selects resolved away where the
    assignment decides them); a comparison and its negation get opposite values.  Other
    assignments that cannot happen (x < 0 and x > 1) are included: proving more cases than
    needed is sound.

    Examples
    --------
    >>> x = sp.Symbol("x", real=True)
    >>> list(cases(Where(x > 0, x, 0) + 1))
    [1, x + 1]
    """
    atoms = _atoms(e)
    if not atoms:
        yield e
        return
    atom = next((a for a in atoms if isinstance(a, IsNaN)), atoms[0])  # NaN decides more
    for value in (sp.true, sp.false):
        negated = atom.negated if isinstance(atom, sp.core.relational.Relational) else ~atom
        known = {atom: value, negated: ~value}
        if isinstance(atom, IsNaN) and value is sp.true:
            known.update(_at_nan(e, atom.args[0]))
        yield from cases(e.xreplace(known))


def _at_nan(e: sp.Basic, v: sp.Expr) -> dict:
    """The comparisons of ``v`` decided by ``v`` being NaN: ``!=`` true, every other false
    (so that a case split never assigns ``isnan(t)`` and ``i <= t`` both true)."""
    return {r: sp.true if isinstance(r, sp.Ne) else sp.false
            for r in e.atoms(sp.core.relational.Relational) if v in r.args}


def leaves(e: sp.Expr, mask: Boolean = sp.true) -> list[tuple[Boolean, sp.Expr]]:
    """(mask, leaf) for each select-free leaf of a lifted select tree; the mask of an else
    branch is the IEEE negation of its condition (a NaN takes the else branch of ``x > 0``).

    Examples
    --------
    >>> x = sp.Symbol("x", real=True)
    >>> leaves(Where(x > 0, sp.exp(x), 0))
    [(x > 0, exp(x)), (isnan(x) | (x <= 0), 0)]
    """
    if not isinstance(e, Where):
        return [(mask, e)]
    c, a, b = e.args
    return leaves(a, sp.And(mask, c)) + leaves(b, sp.And(mask, ieee_not(c)))


def masked(mask: Boolean, value: sp.Expr) -> sp.Expr:
    """``value`` on the elements of ``mask``, 0 elsewhere."""
    return Where(mask, value, sp.S.Zero)


def common_out(e: sp.Expr) -> sp.Expr:
    """``where(c, a * f, b * f)`` as ``f * where(c, a, b)`` for every factor ``f`` the branches
    share (exact under select semantics: a NaN in f reaches the result either way).

    Examples
    --------
    >>> x, w, t = sp.symbols("x w t", real=True)
    >>> common_out(Where(x > t, 2 * w * sp.exp(x), -w * sp.exp(x)))
    w*exp(x)*where(x > t, 2, -1)
    """
    if not isinstance(e, Where):
        return e
    c, a, b = (e.args[0], *(sp.factor_terms(common_out(x)) for x in e.args[1:]))
    shared = set(sp.Mul.make_args(a)) & set(sp.Mul.make_args(b)) - {sp.S.One}
    if not shared or a == 0 or b == 0:
        return Where(c, a, b)
    def rest(x):
        return sp.Mul(*(f for f in sp.Mul.make_args(x) if f not in shared))

    return sp.Mul(*shared) * Where(c, rest(a), rest(b))
