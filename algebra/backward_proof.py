"""The proof of a backward cascade (``algebra.backward``): every gradient against
``sympy.diff`` of the multi-pass loss ``sum dy * y + dr * r``, the forward and the backward
unrolled at ``PROOF_LENGTHS`` symbolic elements."""

from __future__ import annotations

import sympy as sp

from .adjoint import RowSum, diff, results_in_order
from .cascade import POSITION, Cascade, N

PROOF_LENGTHS = (1, 2, 3)  # unrolled element counts the gradients are proven at


def is_zero(e: sp.Expr) -> bool:
    """e = 0 wherever the derivatives exist: sympy's simplify, then again with
    sign(u) = u / |u| (true for u != 0; at u = 0 neither |u| nor sqrt(u**2) has one)."""
    return sp.simplify(e) == 0 or sp.simplify(
        e.replace(sp.sign, lambda u: u / sp.Abs(u))) == 0


def prove(c: Cascade, sym: dict[str, sp.Symbol], lines: list, up: dict[str, sp.Symbol],
          stabilisers: list[str], streams, params: dict[str, str]) -> tuple[tuple[str, bool], ...]:
    """The gradients against ``sympy.diff`` of the multi-pass loss, unrolled at each of
    ``PROOF_LENGTHS`` symbolic elements (module docstring)."""
    # a stabiliser's adjoint simplified to 0 symbolically (``backward._sweep``): for every N, not
    # only the unrolled ones, which then hold it constant
    proofs = [(f"adjoint of {m} = 0 for every N: {m} only stabilises", True)
              for m in stabilisers]
    for n in PROOF_LENGTHS:
        u = Unrolled(c, sym, lines, up, n, set(stabilisers))
        loss = u.loss()
        for s, g, e in streams:
            ok = all(is_zero(diff(loss, u.element(s, j)) - u.at(e, j)) for j in range(n))
            proofs.append((f"{g}[i] = d loss / d {s.name}[i] at N = {n}", ok))
        for p, g in params.items():
            ok = is_zero(diff(loss, sym[p]) - u.value(g))
            proofs.append((f"{g} = d loss / d {p} at N = {n}", ok))
    return tuple(proofs)


class Unrolled:
    """The forward and backward cascades at ``n`` symbolic elements: every per-row value
    in closed form (a stabiliser stays a symbol: its own proof says nothing depends on
    it)."""

    def __init__(self, c: Cascade, sym: dict, lines: list, up: dict, n: int, stabilisers: set):
        self.c, self.sym, self.up, self.n = c, sym, up, n
        self.per_element = [*c.streams, *(up[o] for o in up if o in c.elementwise)]
        self.env = {N: sp.Integer(n)}
        reductions = {r.name: r for r in c.reductions}
        for name in results_in_order(c):
            if name in stabilisers:
                continue
            expr = reductions[name].body if name in reductions else c.epilogues[name]
            self.env[sym[name]] = (self.total(expr) if name in reductions
                                      else expr.subs(self.env))
        for g, e in lines:
            self.env[sp.Symbol(g, real=True)] = self.closed(e)

    def element(self, s: sp.Symbol, j: int) -> sp.Symbol:
        return sp.Symbol(f"{s.name}_{j}", real=True)

    def at(self, expr: sp.Expr, j: int) -> sp.Expr:
        """``expr`` at element j, every per-row value in closed form."""
        here = {s: self.element(s, j) for s in self.per_element} | {POSITION: sp.Integer(j)}
        return expr.subs(here).subs(self.env)

    def total(self, body: sp.Expr) -> sp.Expr:
        return sp.Add(*(self.at(body, j) for j in range(self.n)))

    def closed(self, expr: sp.Expr) -> sp.Expr:
        return expr.replace(lambda e: isinstance(e, RowSum), lambda e: self.total(e.args[0])) \
            .subs(self.env)

    def value(self, name: str) -> sp.Expr:
        return self.env[sp.Symbol(name, real=True)]

    def loss(self) -> sp.Expr:
        """sum over the outputs of upstream * output: its gradient is the backward's."""
        out = sp.S.Zero
        for o, d in self.up.items():
            if o in self.c.elementwise:
                out += self.total(d * self.c.elementwise[o])
            else:
                out += d * self.env[self.sym[o]]
        return out
