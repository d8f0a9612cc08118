"""Refusals of stage 3: why a reduction body does not separate, said of its smallest part.

``culprit`` finds the smallest sub-expression that mixes the stream and the anchors in a
way no law separates, and the reason, from a table keyed by sympy class (data, not
branches); ``check_selects`` refuses the selects (``where``) no law separates.  Each
surfaces as ``NotFusable`` naming the reduction, the sub-expression and why.
"""

from __future__ import annotations

import sympy as sp
from sympy.codegen.cfunctions import expm1

from .addition import WAVES, mixes
from .errors import NotFusable
from .functions import Clip, Maximum, Minimum, Relu, Round
from .selects import conditions, has_select

# Why each kind of node blocks separation, keyed by sympy class: data, not branches.
WHY = {
    Round: "is piecewise constant in its argument: no identity re-anchors it, which blocks "
           "exact fusion",
    sp.floor: "is piecewise constant: no identity re-anchors it, which blocks exact fusion",
    sp.ceiling: "is piecewise constant: no identity re-anchors it, which blocks exact fusion",
    sp.sign: "is piecewise constant: no identity re-anchors it, which blocks exact fusion",
    Relu: "is piecewise linear with a kink that moves with the anchor: not separable "
          "(no finite sum of G(x)*H(anchor) equals it)",
    sp.Abs: "has a kink that moves with the anchor: not separable (no finite sum of "
            "G(x)*H(anchor) equals it)",
    Clip: "has kinks at its bounds that move with the anchor: not separable (no finite sum "
          "of G(x)*H(anchor) equals it)",
    Maximum: "switches branch where the anchor crosses the stream: not separable",
    Minimum: "switches branch where the anchor crosses the stream: not separable",
    sp.exp: "has an exponent that does not split into a stream part plus an anchor part",
    sp.sin: "has an argument that does not split into a stream part plus an anchor part "
            "(only sin(g(x) + h(a)) has the rank-2 form sin g cos h + cos g sin h)",
    sp.cos: "has an argument that does not split into a stream part plus an anchor part "
            "(only cos(g(x) + h(a)) has the rank-2 form cos g cos h - sin g sin h)",
    expm1: "is exp(e) - 1, a rank-2 form, but that form cancels exp(e) against the count and "
           "loses the accuracy near e = 0 that expm1 is for: write exp(...) - 1 to fuse it",
    sp.Pow: "is not a polynomial in the anchor: a power, root or quotient of a stream-and-"
            "anchor expression has no finite-rank G(x)*H(anchor) form",
}


_NUMBER_BASE = {  # is the base 0?  (a positive base was rewritten exp(e*log(b)) and fused)
    False: "is a power of a negative number with an exponent that varies: it is not a real "
           "number between integer exponents (numpy gives NaN), so no real state can hold it",
    True: "is a power of 0: 0, 1 or inf as the exponent's sign changes, piecewise constant, "
          "so no identity re-anchors it",
}


def check_selects(name: str, body: sp.Expr, anchors: set, family: str):
    """Refuse the selects no law separates: a condition that reads an anchor (which elements
    are selected would change whenever the anchor moves, so no state of the elements seen so
    far could be re-anchored), and selects in a selecting or multiplicative body that reads
    anchors (the empty selection has no exact finalize without a count of its elements).

    Examples
    --------
    >>> from algebra.functions import Where
    >>> x, m = sp.symbols("x m", real=True)
    >>> check_selects("c", Where(x > m, 1, 0), {m}, "linear")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    algebra.errors.NotFusable: reduction 'c' cannot be fused: `x > m` is the condition ...
    """
    for cond in conditions(body):
        if cond.free_symbols & anchors:
            used = ", ".join(sorted(str(a) for a in cond.free_symbols & anchors))
            raise NotFusable(name, cond, f"is the condition of a where() and reads the earlier "
                             f"result(s) {used}: which elements are selected changes whenever "
                             "the running value moves, so the select is not separable (only a "
                             "condition on the stream, i and parameters is); an epilogue "
                             "where(cond, sum(a), sum(b)) can select on results")
    if family != "linear" and anchors and has_select(body):
        raise NotFusable(name, body, "is a where() inside a max/min/arg*/topk/prod body that "
                         "also reads earlier results: not supported (the select is separable "
                         "only in sums, or in such bodies that read no earlier result, e.g. "
                         "max(where(i <= pos, s, -inf)))")


def _separable(e: sp.Expr, anchors: set, streams: set) -> bool:
    """True when e is built from stream-only and anchor-only parts by +, *, positive integer
    powers, polynomials in the anchors and exponentials of separable exponents."""
    if not mixes(e, anchors, streams) or e.is_polynomial(*(e.free_symbols & anchors)):
        return True
    if e.is_Add or e.is_Mul:
        return all(_separable(a, anchors, streams) for a in e.args)
    if e.is_Pow and e.exp.is_Integer and e.exp > 0:
        return _separable(e.base, anchors, streams)
    if isinstance(e, (sp.exp, *WAVES)):
        return all(not mixes(t, anchors, streams) for t in sp.Add.make_args(sp.expand(e.args[0])))
    return False


def culprit(e: sp.Expr, anchors: set, streams: set) -> tuple[sp.Expr, str]:
    """The smallest sub-expression of ``e`` that mixes stream and anchor non-separably."""
    for arg in e.args:
        if not _separable(arg, anchors, streams):
            return culprit(arg, anchors, streams)
    if e.is_Pow and e.base.is_number:  # b > 0 was rewritten exp(e*log(b)) and separated
        return e, _NUMBER_BASE[bool(e.base.is_zero)]
    why = next((w for cls, w in WHY.items() if isinstance(e, cls)),
               f"({type(e).__name__} of a stream-and-anchor expression) is not separable: "
               "it has no finite-rank G(x)*H(anchor) form")
    return e, why
