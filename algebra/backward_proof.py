"""The proof of a backward cascade (``algebra.backward``): every gradient against
``sympy.diff`` of the multi-pass loss ``sum dy * y + dr * r + dot(do, o)``, the forward and
the backward unrolled at ``PROOF_LENGTHS`` symbolic elements, each feature vector at
``PROOF_FEATURES`` symbolic components.

Sums are symmetric in their elements, so three elements cover an element's own term and the
others'; a dot product is a sum over the features, so two components cover a feature's own
term and the others' (a gradient is proven component by component).  A selection (max,
top-k: ``algebra.backward_selections``) is proven at every fixed choice of the elements it
selects, where its value is the chosen elements' and the loss is smooth.  A product
(``algebra.backward_products``) is unrolled as the product of its factors, and a forward
output the backward reads (``algebra.backward_saved``) as its definition."""

from __future__ import annotations

import itertools

import sympy as sp

from .adjoint import RowSum, diff, results_in_order
from .cascade import POSITION, Cascade, N, Reduction
from .functions import Dot, Relu, Where
from .laws import LAWS

PROOF_LENGTHS = (1, 2, 3)  # unrolled element counts the gradients are proven at
PROOF_FEATURES = 2  # symbolic components of each feature vector


def is_zero(e: sp.Expr, domain: sp.Expr = sp.S.Zero) -> bool:
    """e = 0 wherever the derivatives exist: each select's condition taken as true and as
    false in turn (a case in which ``domain``, the loss, becomes undefined, such as a fully
    masked row's 0/0, is outside it; a loss undefined before any case is taken proves
    nothing), then the expanded numerator over one denominator (exact, and 10-20x faster
    than simplify on these sums of exponentials; hyperbolic functions written with exp
    first: as they are, 1 - tanh(u)**2 and cosh(u)**-2 never cancel, and trying cost a
    softcapped loss's proof 1.1 of 5.8 s), else sympy's simplify, then again with
    sign(u) = u / |u| (true for u != 0; at u = 0 neither |u| nor sqrt(u**2) has one)."""
    e, domain = _canonical(e), _canonical(domain)
    conditions = sorted({w.args[0] for w in (e + domain).atoms(Where)},
                        key=sp.default_sort_key)
    if conditions:  # a select is its branch wherever its condition is fixed
        return all(_zero_in_case(e, domain, _fixed(conditions, holds))
                   for holds in (True, False))
    return _cancels(e.rewrite(sp.exp) if e.has(*HYPERBOLIC) else e) or \
        sp.simplify(e) == 0 or sp.simplify(
        e.replace(sp.sign, lambda u: u / sp.Abs(u))) == 0


def _zero_in_case(e: sp.Expr, domain: sp.Expr, fixed: dict) -> bool:
    domain = _case(domain, fixed)
    return domain.has(sp.nan, sp.zoo) or is_zero(_case(e, fixed), domain)


HYPERBOLIC = (sp.tanh, sp.cosh, sp.sinh)  # 1 - tanh(u)**2 and cosh(u)**-2 meet in exp form


def _cancels(e: sp.Expr) -> bool:
    return sp.expand(sp.numer(sp.together(e))) == 0


# a comparison as ``u < 0`` or ``u <= 0``: one condition has one spelling whichever way its
# source wrote it (a nested kink's ``x - v > 0`` and ``v < x``), so a case fixes both
_AS_BELOW_ZERO = {sp.Lt: (sp.Lt, 1), sp.Le: (sp.Le, 1), sp.Gt: (sp.Lt, -1),
                  sp.Ge: (sp.Le, -1)}


def _canonical(e: sp.Expr) -> sp.Expr:
    """``e`` with each relu written as its select (``where(u > 0, u, 0)``: a relu inside a
    later kink's condition is then split like any select) and each select's comparison
    spelled ``u < 0`` or ``u <= 0``."""
    def spelled(w: Where) -> Where:
        kind, sign = _AS_BELOW_ZERO[type(w.args[0])]
        c = w.args[0]
        return Where(kind(sign * (c.lhs - c.rhs), 0), *w.args[1:])
    e = e.replace(Relu, lambda u: Where(sp.Gt(u, 0), u, 0))
    return e.replace(lambda w: isinstance(w, Where) and type(w.args[0]) in _AS_BELOW_ZERO,
                     spelled)


def _fixed(conditions: list, holds: bool) -> dict:
    """The first condition taken as ``holds``, and every other one that this decides: an
    unrolled causal mask's ``j <= pos`` for j = 0, 1, 2 are not independent (0 <= pos false
    makes 1 <= pos false), nor are a mean's ``x_0/2 - x_1/2 < 0`` and ``x_1/2 - x_0/2 < 0``;
    a case no input reaches proves nothing."""
    first, fixed = conditions[0], {conditions[0]: holds}
    u = first.lhs if isinstance(first, (sp.Lt, sp.Le)) else None
    if u is None:
        return fixed
    where = _region(first, u)
    where = where if holds else sp.S.Reals - where
    for c in conditions[1:]:
        region = _region(c, u) if isinstance(c, (sp.Lt, sp.Le)) else None
        if region is not None and where.is_subset(region):
            fixed[c] = True
        elif region is not None and where.intersect(region) is sp.S.EmptySet:
            fixed[c] = False
    return fixed


def _region(c: sp.Rel, u: sp.Expr) -> sp.Interval | None:
    """The values of ``u`` where ``c`` (``v < 0`` or ``v <= 0``) holds, if v is ``u`` or
    ``-u`` plus a number; else None."""
    is_open = isinstance(c, sp.Lt)
    for sign in (1, -1):
        shift = c.lhs - sign * u
        if shift.is_number:
            return (sp.Interval(-sp.oo, -shift, right_open=is_open) if sign == 1
                    else sp.Interval(shift, sp.oo, left_open=is_open))
    return None


def _case(e: sp.Expr, fixed: dict) -> sp.Expr:
    """``e`` with each select whose condition ``fixed`` decides replaced by that branch."""
    return e.replace(lambda w: isinstance(w, Where) and w.args[0] in fixed,
                     lambda w: w.args[1] if fixed[w.args[0]] else w.args[2])


def all_zero(values, domain: sp.Expr) -> bool:
    return all(is_zero(v, domain) for v in values)


def prove(c: Cascade, sym: dict[str, sp.Symbol], lines: list, up: dict[str, sp.Symbol],
          dots: dict, stabilisers: list[str], streams, params: dict[str, str],
          columns: list, selections=(), zero=()) -> tuple[tuple[str, bool], ...]:
    """The gradients against ``sympy.diff`` of the multi-pass loss, unrolled at each of
    ``PROOF_LENGTHS`` symbolic elements (module docstring); ``c`` has each selection
    written as its sum (``backward_selections.rewritten``); ``zero``: the parameters whose
    gradient is claimed to be 0."""
    # a stabiliser's adjoint simplified to 0 symbolically (``backward._sweep``): for every N, not
    # only the unrolled ones, which then hold it constant
    proofs = [(f"adjoint of {m} = 0 for every N: {m} only stabilises", True)
              for m in stabilisers]
    for n in PROOF_LENGTHS:
        held: dict[str, bool] = {}
        for case in _cases(selections, n):
            u = Unrolled(c, sym, lines, up, dots, n, set(stabilisers), case, selections)
            for claim, ok in _claims(u, sym, streams, params, columns, zero):
                held[claim] = held.get(claim, True) and ok
        proofs += held.items()
    return tuple(proofs)


def _claims(u: Unrolled, sym, streams, params, columns, zero=()):
    """(what is claimed, whether it holds) for every gradient at one unrolling."""
    loss, n = u.loss(), u.n
    for p in zero:
        g = u.gradient(loss, u.value_of(sym[p]))
        ok = all_zero(g if isinstance(g, tuple) else (g,), loss)
        yield f"d loss / d {p} = 0 at N = {n}{u.cases}", ok
    for s, g, e in streams:
        ok = all(is_zero(diff(loss, u.element(s, j)) - u.at(e, j), loss) for j in range(n))
        yield f"{g}[i] = d loss / d {s.name}[i] at N = {n}{u.cases}", ok
    for p, g in params.items():
        ok = all_zero(_minus(u.gradient(loss, u.value_of(sym[p])), u.value(g)), loss)
        yield f"{g} = d loss / d {p} at N = {n}{u.cases}", ok
    for s, g, e in columns:
        ok = all(all_zero(_minus(u.gradient(loss, u.element(s, j)), u.at(e, j)), loss)
                 for j in range(n))
        yield (f"{g}[i, :] = d loss / d {s.name}[i, :] summed over the rows, at N = {n}, "
               f"{PROOF_FEATURES} features", ok)


def _cases(selections, n: int) -> list[dict[str, tuple]]:
    """Every fixed choice of every selection at ``n`` elements: selector -> its values."""
    def component(s):
        return lambda k: sp.Symbol(f"{s.upstream}_c{k}", real=True)

    per_selection = [[(s.selector, v) for v in s.cases(n, component(s))] for s in selections]
    return [dict(choice) for choice in itertools.product(*per_selection)]


def _minus(a, b):
    return [x - y for x, y in zip(a, b, strict=True)] if isinstance(a, tuple) else [a - b]


class Unrolled:
    """The forward and backward cascades at ``n`` symbolic elements: every per-row value
    in closed form (a stabiliser stays a symbol: its own proof says nothing depends on
    it); a feature vector is a tuple of ``PROOF_FEATURES`` component symbols."""

    def __init__(self, c: Cascade, sym: dict, lines: list, up: dict, dots: dict, n: int,
                 stabilisers: set, selected: dict | None = None, selections=()):
        self.c, self.up, self.n = c, up, n
        self.selected = selected or {}  # selector -> its value at each element
        self.cases = (f", each of the {len(_cases(selections, n))} choices of "
                      f"{', '.join(s.result for s in selections)}") if selections else ""
        self.contracted = {s.result for s in selections if s.upstream}
        self.vectors = set(c.vector_inputs) | {d.name for d, _ in dots.values()}
        self.per_element = {s.name for s in c.streams} | {
            up[o].name for o in up if o in c.elementwise}
        self.env: dict[str, object] = {N.name: sp.Integer(n)}
        reductions = {r.name: r for r in c.reductions}
        for name in results_in_order(c):
            if name not in stabilisers:
                self.env[name] = (self.reduced(reductions[name]) if name in reductions
                                  else self.at(c.epilogues[name], 0))
        for o, (d, delta) in dots.items():
            self.env[delta.name] = _dot(self.value_of(d), self.env[o])
        for s in selections:
            if s.delta:
                self.env[s.delta] = self.env[s.result]  # the contraction, summed
        for g, e in lines:
            self.env[g] = self.at(e, 0)

    def element(self, s: sp.Symbol, j: int):
        return self._components(f"{s.name}_{j}", s.name)

    def value_of(self, s: sp.Symbol):
        """A per-row parameter or upstream: a symbol, or a vector's component symbols."""
        return self._components(s.name, s.name) if s.name in self.vectors else s

    def _components(self, base: str, name: str):
        if name in self.vectors:
            return tuple(sp.Symbol(f"{base}_c{k}", real=True) for k in range(PROOF_FEATURES))
        return sp.Symbol(base, real=True)

    def at(self, expr: sp.Expr, j: int):
        """``expr`` at element j, every per-row value in closed form."""
        if isinstance(expr, RowSum):
            return self.total(expr.args[0])
        if expr.is_Symbol:
            return self._symbol(expr, j)
        if not expr.args:
            return expr
        args = [self.at(a, j) for a in expr.args]
        if isinstance(expr, Dot):
            return _dot(*args)
        if not any(isinstance(a, tuple) for a in args):
            return expr.func(*args)
        if isinstance(expr, Where):
            return tuple(Where(args[0], *(_part(a, k) for a in args[1:]))
                         for k in range(PROOF_FEATURES))
        if expr.is_Add or expr.is_Mul:
            return tuple(expr.func(*(_part(a, k) for a in args)) for k in range(PROOF_FEATURES))
        raise ValueError(f"a feature vector inside {expr.func}: not linear")

    def _symbol(self, s: sp.Symbol, j: int):
        if s == POSITION:
            return sp.Integer(j)
        if s.name in self.selected:
            return self.selected[s.name][j]
        if s.name in self.c.elementwise:  # a forward output the backward reads: its definition
            return self.at(self.c.elementwise[s.name], j)
        if s.name in self.per_element:
            return self.element(s, j)
        if s.name in self.env:
            return self.env[s.name]
        return self.value_of(s)

    def reduced(self, r: Reduction) -> sp.Expr:
        """A reduction in closed form: the product of its body's values at the ``n``
        elements for a product, else their sum (a selection is a sum: ``rewritten``)."""
        if LAWS[r.op].family == "multiplicative":
            return sp.Mul(*(self.at(r.body, j) for j in range(self.n)))
        return self.total(r.body)

    def total(self, body: sp.Expr):
        terms = [self.at(body, j) for j in range(self.n)]
        if terms and isinstance(terms[0], tuple):
            return tuple(sp.Add(*(t[k] for t in terms)) for k in range(PROOF_FEATURES))
        return sp.Add(*terms)

    def value(self, name: str):
        return self.env[name]

    def gradient(self, loss: sp.Expr, wrt):
        return tuple(diff(loss, w) for w in wrt) if isinstance(wrt, tuple) else diff(loss, wrt)

    def loss(self) -> sp.Expr:
        """sum over the outputs of upstream * output (a dot product for a vector): its
        gradient is the backward's."""
        out = sp.S.Zero
        for o, d in self.up.items():
            if o in self.contracted:  # dot(dp, p): its sum holds the upstream already
                out += self.env[o]
            elif o in self.c.elementwise:
                out += self.total(d * self.c.elementwise[o])
            else:
                value = self.env[o]  # a tuple of components for a vector result
                out += _dot(self.value_of(d), value) if isinstance(value, tuple) else d * value
        return out


def _part(a, k: int):
    return a[k] if isinstance(a, tuple) else a


def _dot(a, b):
    return sp.Add(*(x * y for x, y in zip(a, b, strict=True)))
