"""Addition laws: the functions of a stream part plus an anchor part, f(g(x) + h(a)), that
have a finite-rank form, as data (``ADDITION_LAWS``), and the rewrites that bring a sum body
to them.

- ``exp`` is rank 1: exp(g + h) = exp(g) exp(h), so the state is scaled by exp(h' - h) when
  the anchors move (the online-softmax rescale).  ``b**e`` with a positive number b is
  exp(e log b) (``exp_form``): 2**(x - m) is rank 1 too.
- ``sin`` and ``cos`` are rank 2: a wave W(g + h) and its partner W(g + h + pi/2) rotate
  together, [W(g + h'), W(g + h' + pi/2)] = R(h' - h) [W(g + h), W(g + h + pi/2)] with R the
  rotation [[cos, sin], [-sin, cos]] (``rotation``).  The state keeps the wave at the running
  anchor, sin(x - m) rather than sin x cos m - cos x sin m, so it stays exact near x = m.
  Products and powers of waves are first written as sums of single waves (``wave_parts``).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp
from sympy.simplify.fu import TR8

from .errors import NotFusable

PHASE = sp.Dummy("phase", real=True)  # the anchor part h(a) inside a block's waves
MAX_WAVE_DEGREE = 8  # waves multiplied in one term: sin(u)**8 is already 5 rotating pairs


@dataclass(frozen=True)
class AdditionLaw:
    """How f(g(x) + h(a)) splits into stream functions times anchor functions."""

    rank: int  # state sums per Taylor coefficient (1: a scale, 2: a rotating pair)
    identity: str  # the theorem the re-anchoring matrix and its proof obligations rest on


ADDITION_LAWS = {
    sp.exp: AdditionLaw(1, "exp(g + h) = exp(g)*exp(h): the state is scaled by exp(h' - h)"),
    sp.sin: AdditionLaw(2, "sin(g + h) = sin(g)*cos(h) + cos(g)*sin(h): the pair (sin, cos) "
                           "at the anchor rotates by h' - h"),
    sp.cos: AdditionLaw(2, "cos(g + h) = cos(g)*cos(h) - sin(g)*sin(h): the pair (cos, -sin) "
                           "at the anchor rotates by h' - h"),
}
WAVES = tuple(f for f, law in ADDITION_LAWS.items() if law.rank == 2)


def mixes(e: sp.Expr, anchors: set, streams: set) -> bool:
    """Does ``e`` read both an anchor and a stream?"""
    free = e.free_symbols
    return bool(free & anchors) and bool(free & streams)


def exp_form(body: sp.Expr, anchors: set) -> sp.Expr:
    """``body`` with every b**e (b a positive number, e reading an anchor) as exp(e*log(b)),
    which the exp law re-anchors.

    Examples
    --------
    >>> x, m = sp.symbols("x m", real=True)
    >>> exp_form(2 ** (x - m) + 3 ** x, {m})
    3**x + exp((-m + x)*log(2))
    """
    return body.replace(
        lambda e: e.is_Pow and e.base.is_number and e.base.is_positive is True
        and bool(e.exp.free_symbols & anchors),
        lambda e: sp.exp(e.exp * sp.log(e.base)))


def is_wave(f: sp.Expr, anchors: set, streams: set) -> bool:
    """Is ``f`` a sin or cos (or a positive integer power of one) that mixes stream and
    anchors?"""
    base = f.base if f.is_Pow and f.exp.is_Integer and f.exp > 0 else f
    return isinstance(base, WAVES) and mixes(base, anchors, streams)


def _wave_degree(part: sp.Expr, anchors: set, streams: set) -> tuple[int, list[sp.Expr]]:
    waves = [f for f in sp.Mul.make_args(part) if is_wave(f, anchors, streams)]
    return sum(int(f.exp) if f.is_Pow else 1 for f in waves), waves


def wave_parts(name: str, rest: sp.Expr, anchors: set, streams: set) -> list[sp.Expr]:
    """``rest`` as a sum of parts with at most one wave each: products and powers of waves
    become sums of single waves (product-to-sum, sympy's TR8), repeated until every part has
    one (TR8 leaves (1 - cos(2u))**2 * sin(u) of sin(u)**5).  More than ``MAX_WAVE_DEGREE``
    waves in one term raise ``NotFusable``.

    Examples
    --------
    >>> x, m = sp.symbols("x m", real=True)
    >>> sorted(map(str, wave_parts("s", sp.sin(x - m) ** 2, {m}, {x})))
    ['-cos(2*m - 2*x)/2', '1/2']
    """
    todo, out = [rest], []
    while todo:
        part = todo.pop()
        degree, waves = _wave_degree(part, anchors, streams)
        if degree <= 1:
            out.append(part)
            continue
        if degree > MAX_WAVE_DEGREE:
            raise NotFusable(name, sp.Mul(*waves), f"multiplies {degree} waves: product-to-sum "
                             f"gives about {degree // 2 + 1} frequencies, each a rotating pair "
                             f"of state sums; more than the limit of {MAX_WAVE_DEGREE} waves")
        others = sp.Mul(*[f for f in sp.Mul.make_args(part) if f not in waves])
        for t in sp.Add.make_args(sp.expand(TR8(sp.Mul(*waves)))):
            if _wave_degree(t, anchors, streams)[0] >= degree:  # no progress: never loop
                raise NotFusable(name, sp.Mul(*waves), "is a product of waves that product-"
                                 "to-sum does not reduce to single waves")
            todo.append(others * t)
    return out


def rotation(theta: sp.Expr, new: dict, waves: bool) -> list[list[sp.Expr]]:
    """How a block's waves move with the anchors: W(theta' + q*pi/2) = sum_p R[q][p] *
    W(theta + p*pi/2), R the rotation by theta' - theta (``new`` maps each anchor to its new
    value); [[1]] for a block without waves.

    Examples
    --------
    >>> m, m1 = sp.symbols("m m1", real=True)
    >>> rotation(m, {m: m1}, True)
    [[cos(m - m1), -sin(m - m1)], [sin(m - m1), cos(m - m1)]]
    """
    if not waves:
        return [[sp.S.One]]
    delta = sp.expand(theta.subs(new, simultaneous=True) - theta)
    cos, sin = sp.cos(delta), sp.sin(delta)
    return [[cos, sin], [-sin, cos]]
