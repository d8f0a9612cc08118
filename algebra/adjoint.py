"""The pieces of reverse-mode differentiation that the backward derivation
(``algebra.backward``) and its proof (``algebra.backward_proof``) share: the adjoint of a
per-row value, differentiation with torch's conventions, a sum over the stream as a node of
a backward line, and the order of a cascade's per-row results."""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .cascade import Cascade
from .errors import NoBackward
from .functions import Dot, Relu, Where

UNDERIVABLE = "d/d{name} of `{expr}` has no closed form in the spec language"


# sympy's simplify writes tanh' = 1 - tanh**2 as cosh**-2; the spec language has tanh only
SPELLED = {sp.cosh: lambda u: 1 / sp.sqrt(1 - sp.tanh(u) ** 2),
           sp.sinh: lambda u: sp.tanh(u) / sp.sqrt(1 - sp.tanh(u) ** 2)}


def spelled(e: sp.Expr) -> sp.Expr:
    """``e`` with the functions the spec language lacks written with those it has."""
    for f, form in SPELLED.items():
        e = e.replace(f, form)
    return e


@dataclass(frozen=True)
class Adjoint:
    """d loss / d R for a per-row value R: ``row + sum over the stream of body``."""

    row: sp.Expr = sp.S.Zero
    body: sp.Expr = sp.S.Zero

    def __add__(self, other: Adjoint) -> Adjoint:
        return Adjoint(self.row + other.row, self.body + other.body)

    def times(self, c: sp.Expr) -> Adjoint:
        return Adjoint(self.row * c, self.body * c)

    def vanishes(self, definitions: dict | None = None) -> bool:
        """Both parts simplify to 0, each per-row value of ``definitions`` (its symbol ->
        its epilogue) written as what it is first: a sink's ``d = d_sum + exp(a - m)``
        leaves ``m``'s adjoint ``o_sum*(d_sum + exp(a - m) - d)/d**2``, 0 only so."""
        row, body = self.row, self.body
        for _ in range(len(definitions or {})):  # an epilogue may read another
            row, body = row.xreplace(definitions), body.xreplace(definitions)
        return sp.simplify(row) == 0 and sp.simplify(body) == 0


def diff(expr: sp.Expr, s: sp.Symbol) -> sp.Expr:
    """d expr / d s with torch's conventions (module docstring): relu as a select, a
    select's condition held constant.  A feature vector ``s`` read by dot products gives a
    vector: d dot(s, k) / d s = k (each dot is a scalar unknown, then the chain rule)."""
    dots = {d: sp.Dummy("dot", real=True) for d in expr.atoms(Dot) if s in d.args}
    if dots:
        for d in dots:
            if not all(a.is_Symbol for a in d.args):
                raise NoBackward(UNDERIVABLE.format(name=s.name, expr=d))
        held = expr.xreplace(dots)
        back = {z: d for d, z in dots.items()}
        out = _diff(held, s) + sum((_diff(held, z) * sum(b for a, b in (d.args, d.args[::-1])
                                                         if a == s) for d, z in dots.items()),
                                   sp.S.Zero)
        return out.xreplace(back)
    return _diff(expr, s)


def _diff(expr: sp.Expr, s: sp.Symbol) -> sp.Expr:
    expr = expr.replace(Relu, lambda u: Where(u > 0, u, 0))
    frozen = {}

    def hold(w):
        if s not in w.args[0].free_symbols:
            return w
        k = sp.Dummy(f"held_{s.name}", real=True)
        frozen[k] = s
        return Where(w.args[0].subs(s, k), *w.args[1:])

    out = expr.replace(lambda e: isinstance(e, Where), hold).diff(s).subs(frozen)
    if out.has(sp.Derivative):
        raise NoBackward(UNDERIVABLE.format(name=s.name, expr=expr))
    return out


def ratio(db: sp.Expr, body: sp.Expr) -> sp.Expr:
    """db / body, branch by branch through selects on one condition (a masked exp's
    derivative is -1 times it on both branches; a branch 0 in both says nothing); nan where
    ``body`` is 0.

    Examples
    --------
    >>> x, m, p = sp.symbols("x m p", real=True)
    >>> ratio(-sp.exp(x - m), sp.exp(x - m))
    -1
    >>> ratio(Where(x > p, -sp.exp(x - m), 0), Where(x > p, sp.exp(x - m), 0))
    -1
    """
    if isinstance(body, Where) and isinstance(db, Where) and db.args[0] == body.args[0]:
        pairs = zip(db.args[1:], body.args[1:], strict=True)
        ratios = {ratio(d, b) for d, b in pairs if (d, b) != (0, 0)}
        if len(ratios) == 1:
            return ratios.pop()
    return sp.simplify(db / body) if body != 0 else sp.nan


class RowSum(sp.Function):
    """``sum(body)`` over the stream, as a node of a backward line (printed as the spec's
    reduction; unrolled by the proof)."""

    nargs = 1

    def _redfuser_spec(self, printer):
        return f"sum({printer._print(self.args[0])})"


def expressions_of(c: Cascade) -> list[sp.Expr]:
    """Every expression of the cascade: reduction bodies, epilogues, per-element outputs."""
    return [r.body for r in c.reductions] + [*c.epilogues.values(), *c.elementwise.values()]


def symbols_of(c: Cascade) -> dict[str, sp.Symbol]:
    """Every symbol the cascade's expressions use, by name, and a real symbol for each
    result that no expression reads."""
    out = {s.name: s for e in expressions_of(c) for s in e.free_symbols}
    for r in c.reductions:
        out.setdefault(r.name, r.symbol)
    for name in c.epilogues:
        out.setdefault(name, sp.Symbol(name, real=True))
    return out


def results_in_order(c: Cascade) -> list[str]:
    """Per-row results in dependence order (reductions and epilogues interleaved)."""
    defs = {r.name: r.body for r in c.reductions} | dict(c.epilogues)
    order: list[str] = []

    def visit(name):
        if name in order:
            return
        for dep in sorted(s.name for s in defs[name].free_symbols if s.name in defs):
            visit(dep)
        order.append(name)

    for name in defs:
        visit(name)
    return order
