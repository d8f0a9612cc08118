"""Stage 4, derive: one fused component per reduction, then the rule's running values.

For each reduction the family of its law (``laws.LAWS``) picks the construction:
finite-rank re-anchoring for sums (``algebra.reanchor``), monotone commutation for
selections, and products as a log-sum and a product of signs.  Every construction returns
the proof obligations it relies on; ``prove`` (stage 5) checks them before a rule exists.
"""

from __future__ import annotations

import dataclasses

import sympy as sp

from .cascade import POSITION, Cascade, N, Reduction
from .components import (
    Component,
    LinearComponent,
    ProductComponent,
    SelectComponent,
    U,
)
from .errors import NotFusable
from .laws import LAWS
from .limits import charged_to
from .names import Names, fresh
from .prove import Obligation
from .reanchor import linear_component, listed
from .refusals import check_selects
from .separate import monotone_core, multiplicative_split, polar
from .state import StateVar, primed


def derive_components(cascade: Cascade) -> tuple[Component, ...]:
    """Fused components of every reduction, in dependence order."""
    streams = set(cascade.streams) | {POSITION}
    family = {"linear": linear_component, "selecting": _select, "multiplicative": _product}
    names = Names(cascade.count, cascade.taken(), cascade.vector_inputs)
    out: list[Component] = []
    for r in cascade.reductions:
        with charged_to(r):  # the time budget (limits) running out here is r's NotFusable
            check_selects(r.name, r.body, set(r.anchors), LAWS[r.op].family)
            made = family[LAWS[r.op].family](r, set(r.anchors), streams, names)
            out.extend(made if isinstance(made, tuple) else (made,))  # a product makes two
    return tuple(out)


def running_values(cascade: Cascade, components) -> dict[str, sp.Expr]:
    """Every result as an expression of the state (N -> n): the running anchors.

    Any anchor value makes the re-anchoring exact; using the count n of elements seen
    so far instead of N keeps a running mean equal to the mean of what was seen,
    which is what keeps the anchored sums small (Welford/Chan).  At the end n = N.
    """
    results, count = cascade.results, cascade.count
    last = {c.reduction.name: k for k, c in enumerate(components)}  # a product has two
    out: dict[str, sp.Expr] = {}
    for k, comp in enumerate(components):
        name = comp.reduction.name
        out[name] = comp.finalize.subs({N: count}).subs(
            {a: out[a.name] for a in comp.anchors}, simultaneous=True)
        if k != last[name]:  # the sign of a product, before its value: not the result yet
            continue
        for epi, expr in cascade.epilogues.items():
            if epi not in out and expr.free_symbols & set(results.values()) <= {
                    results[k] for k in out}:
                out[epi] = expr.subs({N: count}).subs(
                    {results[k]: v for k, v in out.items()}, simultaneous=True)
    return out


# max/min/arg*/topk: monotone commutation ---------------------------------------
_SIGN_WORDS = {"positive": "strictly increasing", "negative": "strictly decreasing",
               "nonnegative": "non-decreasing", "nonpositive": "non-increasing"}
# a weak sign whose derivative vanishes only at isolated points still orders strictly
_STRICT_WORDS = {"nonnegative": "strictly increasing (dF/dg >= 0, 0 at isolated g)",
                 "nonpositive": "strictly decreasing (dF/dg <= 0, 0 at isolated g)"}


def _select(r: Reduction, anchors: set, streams: set, names: Names) -> SelectComponent:
    law = LAWS[r.op]
    if anchors:
        g, F, u = monotone_core(r.name, r.body, anchors, streams)
        F = F.subs(u, U)
    else:
        g, F = r.body, U
    strict = law.returns != "value" and law.returns != "values_k"
    sign, isolated = _monotone_sign(r, g, F, strict)
    direction = law.direction * (1 if sign in ("positive", "nonnegative") else -1)
    k = r.k or 1
    value = sp.Symbol(r.name, real=True) if law.returns in ("value", "values_k") else \
        names.symbol(r.name + "_best", real=True)
    ident = law.identity if direction == law.direction else -law.identity
    state = [StateVar(value, ident, f"{'largest' if direction > 0 else 'smallest'} "
                      f"{str(r.k) + ' ' if r.k else ''}{g}", "values_k" if r.k else "value")]
    if law.returns in ("index", "indices_k"):
        state.append(StateVar(sp.Symbol(r.name, integer=True), sp.oo,  # "no index yet"
                              "index of " + state[0].meaning + " (first on ties)",
                              "indices_k" if r.k else "index"))
        finalize = state[1].symbol
    else:
        finalize = F.subs(U, value)
    obligations = ()
    case = f"plain {r.op}"
    if anchors:
        word = _SIGN_WORDS[sign] if not isolated else _STRICT_WORDS[sign]
        obligations = (
            Obligation(f"{r.name}: factorization", "the body is F(g(x), a) with g anchor-free",
                       F.subs(U, g), r.body),
            Obligation(f"{r.name}: monotone", f"F is {word} in g, so {r.op} commutes with it",
                       _derivative(F, g), sign=sign), *isolated)
        swap = "" if direction == law.direction else " (direction swapped)"
        u = sp.Symbol(fresh("u", set(names.taken)), real=True)  # only shown: named apart
        case = (f"monotone commutation: F({u}) = {F.subs(U, u)} is {word} in g = {g}, so "
                f"{r.op}(F(g)) = F({r.op}(g)){swap}; the dependence on {listed(r.anchors)} "
                "disappears")
    return SelectComponent(r, case, tuple(state), r.anchors, finalize, obligations,
                           core=g, outer=F, direction=direction, k=k)


def _derivative(F: sp.Expr, g: sp.Expr) -> sp.Expr:
    """dF/du, with u known positive when g is (u only takes the values of g)."""
    dF = sp.diff(F, U)
    return dF.subs(U, sp.Dummy(U.name, positive=True)) if g.is_positive else dF


def _monotone_sign(r: Reduction, g, F, strict: bool) -> tuple[str, tuple[Obligation, ...]]:
    """The sign of dF/dg, and where a strict sign is needed but dF/dg only keeps its sign
    weakly, the obligation that its zeros are isolated (so F is still strictly monotone)."""
    dF = _derivative(F, g)
    for sign in ("positive", "negative", "nonnegative", "nonpositive"):
        if Obligation("", "", dF, sign=sign).check():
            isolated = _isolated_zeros(r, F, sign) if strict and sign in _STRICT_WORDS else ()
            if not strict or sign not in _STRICT_WORDS or isolated:
                return sign, isolated
    need = "strictly monotone (an index is returned, so ties must stay ties)" if strict \
        else "monotone"
    raise NotFusable(r.name, F.subs(U, g), f"is not provably {need} in g = {g} for every value "
                     f"of {listed(r.anchors)} (dF/dg = {dF}), so {r.op} does not commute "
                     "with it")


def _isolated_zeros(r: Reduction, F: sp.Expr, sign: str) -> tuple[Obligation, ...]:
    """Where dF/du is a polynomial in u whose leading coefficient is a number, it vanishes at
    finitely many u for every value of the anchors, so a weakly monotone F is strictly
    monotone ((x - m)**3: its derivative 3*(x - m)**2 is 0 only at x = m)."""
    dF = sp.diff(F, U)
    if not dF.is_polynomial(U) or dF == 0:
        return ()
    lead = sp.Poly(dF, U).LC()
    if not lead.is_number:
        return ()
    return (Obligation(f"{r.name}: isolated zeros", "dF/dg is a polynomial in g with a constant "
                       "leading coefficient: it vanishes at finitely many g", lead,
                       sign="positive" if sign == "nonnegative" else "negative"),)


# prod: a log-domain sum and a product of signs -------------------------------
def _product(r: Reduction, anchors: set, streams: set,
             names: Names) -> tuple[Component, ...]:
    """prod(C(a) G(x)) kept in a form that cannot leave the float range where the product
    does not: L = sum(log|C(a) G(x)|), a sum like any other (exp(x - m) factors make it the
    re-anchored sum(x - m), which stays at the running anchor), and S = prod(sign(G(x))),
    which only takes the values +-1, 0, +-inf and NaN; the value is
    S * sign(C(a))**n * exp(L).  C(a)**n * prod(G) overflows for twelve factors of 1e10
    (prod(exp(x - m)) with x = 10: exp(120) = inf times exp(-120) = 0); exp(L) is exp(0)."""
    coeff, G = multiplicative_split(r.name, r.body, anchors, streams)
    factorization = Obligation(f"{r.name}: factorization", "body = C(a) * G(x)", coeff * G,
                               r.body)
    if G == 0:  # prod(0): nothing to take the log of, and nothing to overflow
        state = (StateVar(sp.Symbol(r.name, real=True), sp.S.One, "product of 0"),)
        return (ProductComponent(r, "plain product (of zeros)", state, (), state[0].symbol,
                                 (factorization,), factor=G),)
    sign_g, log_g, atoms = polar(G)
    sign_c, log_c, atoms_c = polar(coeff)
    lin = _log_sum(r, log_g + log_c, {a for a in atoms_c if a in anchors}, anchors, streams,
                   names)
    value, out = sp.exp(lin.finalize), []
    if sign_g != 1:
        sym = sp.Symbol(f"{r.name}.sign", real=True)  # '.': never a spec name
        out.append(ProductComponent(r, f"product of the signs {sign_g}",
                                    (StateVar(sym, sp.S.One, f"product of {sign_g}"),), (),
                                    sym, (), factor=sign_g))
        value = sym * value
    if sign_c != 1:
        value = sign_c ** names.count * value
    obligations = (factorization, *_polar_obligations(r.name, coeff * G, sign_g * sign_c,
                                                      log_g + log_c, atoms | atoms_c),
                   *lin.obligations)
    case = ("log-domain product: prod(body) = prod(sign(body)) * exp(sum(log|body|)), in "
            f"range whatever the factors; the log-sum: {lin.case}")
    return (*out, dataclasses.replace(lin, reduction=r, case=case, finalize=value,
                                      obligations=obligations))


def _log_sum(r: Reduction, body, logged: set, anchors: set, streams: set,
             names: Names) -> LinearComponent:
    """The sum of log|body| at the running anchors.  A term log|m| of an anchor m is shifted
    like an anchor of its own (the state sums log|x| - log|m| at the running m, re-anchored by
    adding n*(log|m| - log|m'|)), so the sum stays near 0 when the factors are near 1: twelve
    terms log(100) - log(100) cancel exactly, which sum(log|x|) - n*log|m| at finalize
    misses by 1e-4.  The obligations are proven for the shifted term as a free variable,
    so they hold for log|m|; the state is held away from m = 0 (a guarded anchor)."""
    derived = {sp.log(sp.Abs(a)): sp.Symbol(f"log|{a}|", real=True)
               for a in sorted(logged, key=str)}
    log_r = dataclasses.replace(r, name=f"{r.name}.log", op="sum", body=body.xreplace(derived),
                                anchors=r.anchors + tuple(derived.values()))
    lin = linear_component(log_r, anchors | set(derived.values()), streams, names)
    back = {**{v: k for k, v in derived.items()},
            **{primed(v): k.xreplace({a: primed(a) for a in logged}) for k, v in derived.items()}}
    return dataclasses.replace(
        lin, anchors=r.anchors, basis=tuple(b.xreplace(back) for b in lin.basis),
        matrix=lin.matrix.xreplace(back), finalize=lin.finalize.xreplace(back),
        guards=lin.guards | {a.name for a in logged})


def _polar_obligations(name: str, body, sign, log_abs, atoms) -> list[Obligation]:
    """body = sign * exp(log_abs): per atom a, sign(a) * exp(log|a|) = a; and the whole, with
    each sign(a) written a * exp(-log|a|) (which the atom identity licenses).  The atom
    identity is a law of every real value, proven on a real symbol standing for the atom:
    sympy cannot decide it on sqrt(x) + r / x, which it does not know to be real (in
    float32 it is real or NaN, and NaN is NaN on both sides)."""
    t = sp.Dummy("a", real=True)
    out = [Obligation(f"{name}: polar form of {a}", "sign(a) * exp(log|a|) = a for real a",
                      sp.sign(t) * sp.exp(sp.log(sp.Abs(t))), t)
           for a in sorted(atoms, key=sp.default_sort_key)]
    per_atom = {sp.sign(a): a * sp.exp(-sp.log(sp.Abs(a))) for a in atoms}
    out.append(Obligation(f"{name}: polar form", "body = sign * exp(sum of log|factor|)",
                          sign.xreplace(per_atom) * sp.exp(log_abs), body))
    return out
