"""Stage 4, derive: one fused component per reduction, then the rule's running values.

For each reduction the family of its law (``laws.LAWS``) picks the construction:
finite-rank re-anchoring for sums, monotone commutation for selections, and
products as a log-sum and a product of signs.  Every construction returns the proof
obligations it relies on; ``prove`` (stage 5) checks them before a rule exists.
"""

from __future__ import annotations

import dataclasses

import sympy as sp

from .addition import ADDITION_LAWS, rotation
from .cascade import POSITION, Cascade, N, Reduction, carries_feature_axis
from .components import (
    Component,
    LinearComponent,
    ProductComponent,
    SelectComponent,
    StateVar,
    U,
    primed,
)
from .errors import NotFusable
from .functions import Where
from .laws import LAWS
from .limits import charged_to
from .names import Names, fresh
from .prove import Obligation
from .selects import masked
from .separate import (
    Block,
    check_selects,
    linear_blocks,
    monotone_core,
    multiplicative_split,
    polar,
    taylor_indices,
)


def derive_components(cascade: Cascade) -> tuple[Component, ...]:
    """Fused components of every reduction, in dependence order."""
    streams = set(cascade.streams) | {POSITION}
    family = {"linear": _linear, "selecting": _select, "multiplicative": _product}
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


# Step 1. sum: finite-rank re-anchoring -------------------------------------------------
def _linear(r: Reduction, anchors: set, streams: set, names: Names) -> LinearComponent:
    # a block whose terms cancel contributes nothing (sum(x - x) is a sum of zeros); a
    # feature-axis state moves its anchor factors to finalize (``separate.kept_factor``)
    keep = not carries_feature_axis(r.body, names.vector)
    blocks = [b for b in linear_blocks(r.name, r.body, anchors, streams, keep)
              if b.kernel() != 0]
    columns: list[sp.Symbol] = []
    basis: list[sp.Expr] = []
    entries: dict[tuple[sp.Symbol, sp.Symbol], sp.Expr] = {}
    finalize = sp.S.Zero
    for block in blocks:
        psis, matrix, c0 = _block_columns(r.name, block, anchors, streams)
        cols: list[sp.Symbol] = []
        for psi in psis:
            cols.append(_column(r.name, psi, len(columns) + len(cols), names))
        for (ci, cj), v in matrix.items():
            entries[(cols[ci], cols[cj])] = v
        for c, psi in zip(cols, psis, strict=True):
            if c not in columns:
                columns.append(c)
                basis.append(psi)
        term = block.coeff * c0 * cols[0]
        if block.mask is not sp.true and block.reads(anchors):
            # an empty selection sums to exactly 0 whatever the anchors; the state alone cannot
            # tell it from elements at a non-finite anchor (exp(-inf - -inf) is NaN), so a count
            # of the selected elements decides at finalize
            count = _count_column(r.name, block.mask, columns, basis, entries, names)
            term = Where(sp.Gt(count, 0), term, sp.S.Zero)
        finalize += term
    index = {c: k for k, c in enumerate(columns)}
    A = sp.zeros(len(columns))
    for (ci, cj), v in entries.items():
        A[index[ci], index[cj]] = v
    state = tuple(StateVar(c, sp.S.Zero, _meaning(psi, r.anchors))
                  for c, psi in zip(columns, basis, strict=True) if c != names.count)
    obligations = _linear_obligations(r, columns, basis, A, finalize, names)
    case = _linear_case(r, A, [b.coeff for b in blocks if b.coeff != 1], blocks)
    masks = sorted({str(b.mask) for b in blocks if b.mask is not sp.true})
    if masks:
        case += ("; where(): the sums run over the elements of " + ", ".join(masks) +
                 " (an anchored one with its count, so an empty selection is exactly 0)")
    guards = frozenset(a.name for b in blocks for a in b.kept.free_symbols)
    return LinearComponent(r, case, state, r.anchors, finalize, obligations,
                           columns=tuple(columns), basis=tuple(basis), matrix=A, guards=guards)


def _column(name: str, psi: sp.Expr, k: int, names: Names) -> sp.Symbol:
    """The state symbol of the reduction's k-th column: the count for psi = 1, the reduction's
    own name for its first (no other value has that name), else a fresh ``<name>_<k>``."""
    if psi == 1:
        return names.count
    if k == 0:
        return sp.Symbol(name, real=True)
    return names.symbol(f"{name}_{k}", real=True)


def _count_column(name: str, mask, columns: list, basis: list, entries: dict, names: Names):
    """The column counting the elements of ``mask`` (one already there, or a new one: an
    anchor-free sum, so its row of the re-anchoring matrix is the identity)."""
    psi = masked(mask, sp.S.One)
    if psi in basis:
        return columns[basis.index(psi)]
    col = names.symbol(f"{name}_count", real=True)
    columns.append(col)
    basis.append(psi)
    entries[(col, col)] = sp.S.One
    return col


def _linear_case(r: Reduction, A: sp.Matrix, coeffs: list, blocks: list[Block]) -> str:
    changes = f"when {_names(r.anchors)} change{'s' if len(r.anchors) == 1 else ''}"
    if A == sp.eye(A.rows):
        case = "plain sum" + (" (the state reads no earlier result)" if r.anchors else "")
    elif A.rows == 1:
        case = f"rank-1 re-anchoring: the state is scaled by {A[0, 0]} {changes}"
    else:
        case = (f"finite-rank re-anchoring (rank {A.rows}): the state vector is mapped by a "
                f"derived {A.rows}x{A.rows} matrix A({_names(r.anchors)} -> new) {changes}")
    waves = sorted({w.func for b in blocks for _, _, w in b.terms if w != 1}, key=str)
    for f in waves:
        case += f"; {ADDITION_LAWS[f].identity}"
    kept = [b.kept for b in blocks if b.kept != 1]
    if kept:
        case += ("; anchor-only factor " + ", ".join(map(str, kept)) + " kept in the state "
                 "(the spec's own normalised terms), re-anchored by its ratio")
    if coeffs:
        case += "; anchor-only factor " + ", ".join(map(str, coeffs)) + " applied at finalize"
    return case


def _content(t: sp.Expr, streams: set) -> tuple[sp.Expr, sp.Expr]:
    """t = c * psi with c a number and psi primitive, signed so that psi is positive where
    the stream dominates (the state reads sum(x - mean), not sum(mean - x))."""
    c, psi = t.as_content_primitive()
    # a small probe: stream values a little above the anchors (large ones can take sympy
    # forever on towers such as 2**(x**x)); the sign choice is cosmetic, so failure is fine
    probe = {s: (sp.Integer(2) + sp.Rational(k, 8) if s in streams else sp.Rational(1, 2 + k))
             for k, s in enumerate(sorted(psi.free_symbols, key=str))}
    try:
        value = psi.subs(probe).evalf(5)
        negative = bool(value.is_negative) if value.is_number else None
    except (ArithmeticError, TypeError, ValueError):
        negative = None
    if negative is None:
        negative = psi.could_extract_minus_sign()
    return (-c, -psi) if negative else (c, psi)


def _block_columns(name: str, block: Block, anchors: set, streams: set):
    """State columns of one block: the Taylor coefficients T_gq = c_gq * psi_gq (q = 1: the
    wave's partner), and the matrix T_gq(a') = exp(beta(a') - beta(a)) *
    sum_{h >= g} binom(h, g) (a' - a)**(h - g) sum_p R_qp T_hp(a).  Coefficients with one psi
    (two anchors whose top coefficients both equal 1) share a column: its row is any one of
    theirs, and the entries into it add up."""
    new = {a: primed(a) for a in anchors}
    scale = sp.exp(sp.factor_terms(sp.expand(block.beta.subs(new, simultaneous=True) -
                                             block.beta))) * \
        block.kept.subs(new, simultaneous=True) / block.kept
    rot = rotation(block.theta, new, block.quarters != (0,))
    content, column, psis = {}, {}, []
    for g in taylor_indices(name, block, anchors):
        for q in block.quarters:
            t = block.kernel(g, q)
            if t == 0:  # nothing to keep (and nothing for a row to read)
                continue
            c, psi = _content(t, streams)
            psi = block.masked(sp.factor_terms(psi))  # (x - m)/N: see separate._exp
            if psi not in psis:
                psis.append(psi)
            key = (tuple(sorted(g.items(), key=str)), q)
            content[key], column[key] = c, psis.index(psi)
    matrix: dict[tuple[int, int], sp.Expr] = {}
    rows = set()
    for (g, q), j in column.items():
        if j in rows:  # a coinciding coefficient: its column already has a row
            continue
        rows.add(j)
        for (h, p), k in column.items():
            gd, hd = dict(g), dict(h)
            if rot[q][p] == 0 or any(hd.get(a, 0) < kg for a, kg in gd.items()):
                continue
            entry = scale * rot[q][p] * content[(h, p)] / content[(g, q)]
            for a, ka in hd.items():
                kg = gd.get(a, 0)
                entry *= sp.binomial(ka, kg) * (primed(a) - a) ** (ka - kg)
            matrix[(j, k)] = matrix.get((j, k), sp.S.Zero) + entry
    return psis, matrix, content[((), 0)]


def _meaning(psi: sp.Expr, anchors) -> str:
    at = psi.free_symbols & set(anchors)
    return f"sum of {psi}" + (f" at the running {_names(sorted(at, key=str))}" if at else "")


def _names(symbols) -> str:
    return ", ".join(str(s) for s in symbols)


def _linear_obligations(r, columns, basis, A, finalize, names: Names) -> tuple[Obligation, ...]:
    one = {c: psi for c, psi in zip(columns, basis, strict=True)}  # the state of one element
    obls = [Obligation(f"{r.name}: decomposition", "finalize of a one-element state is the body",
                       finalize.subs(one, simultaneous=True), r.body)]
    if not r.anchors:
        return tuple(obls)
    new = {a: primed(a) for a in r.anchors}
    psi = sp.Matrix(basis)
    obls.append(Obligation(f"{r.name}: re-anchoring", "psi(x, a') = A(a, a') psi(x, a)",
                           psi.subs(new, simultaneous=True), A * psi))
    obls.append(Obligation(f"{r.name}: identity", "A(a, a) = I (an unmoved anchor keeps "
                           "the state)", A.subs({v: k for k, v in new.items()}),
                           sp.eye(A.rows)))
    # three anchor points, named fresh: a parameter called m_1 must not become one of them
    s0, s1, s2 = ({a: names.symbol(a.name + t, **a.assumptions0) for a in r.anchors}
                  for t in ("_0", "_1", "_2"))

    def at(src, dst):
        return A.subs({**{a: src[a] for a in r.anchors}, **{new[a]: dst[a] for a in r.anchors}},
                      simultaneous=True)

    obls.append(Obligation(f"{r.name}: composition", "A(a1, a2) A(a0, a1) = A(a0, a2): merges "
                           "in any tree order agree", at(s1, s2) * at(s0, s1), at(s0, s2)))
    return tuple(obls)


# Step 2. max/min/arg*/topk: monotone commutation ---------------------------------------
_SIGN_WORDS = {"positive": "strictly increasing", "negative": "strictly decreasing",
               "nonnegative": "non-decreasing", "nonpositive": "non-increasing"}


def _select(r: Reduction, anchors: set, streams: set, names: Names) -> SelectComponent:
    law = LAWS[r.op]
    if anchors:
        g, F, u = monotone_core(r.name, r.body, anchors, streams)
        F = F.subs(u, U)
    else:
        g, F = r.body, U
    strict = law.returns != "value" and law.returns != "values_k"
    sign = _monotone_sign(r, g, F, strict)
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
        word = _SIGN_WORDS[sign]
        obligations = (
            Obligation(f"{r.name}: factorization", "the body is F(g(x), a) with g anchor-free",
                       F.subs(U, g), r.body),
            Obligation(f"{r.name}: monotone", f"F is {word} in g, so {r.op} commutes with it",
                       _derivative(F, g), sign=sign))
        swap = "" if direction == law.direction else " (direction swapped)"
        u = sp.Symbol(fresh("u", set(names.taken)), real=True)  # only shown: named apart
        case = (f"monotone commutation: F({u}) = {F.subs(U, u)} is {word} in g = {g}, so "
                f"{r.op}(F(g)) = F({r.op}(g)){swap}; the dependence on {_names(r.anchors)} "
                "disappears")
    return SelectComponent(r, case, tuple(state), r.anchors, finalize, obligations,
                           core=g, outer=F, direction=direction, k=k)


def _derivative(F: sp.Expr, g: sp.Expr) -> sp.Expr:
    """dF/du, with u known positive when g is (u only takes the values of g)."""
    dF = sp.diff(F, U)
    return dF.subs(U, sp.Dummy(U.name, positive=True)) if g.is_positive else dF


def _monotone_sign(r: Reduction, g, F, strict: bool) -> str:
    dF = _derivative(F, g)
    signs = ("positive", "negative") if strict else ("positive", "negative", "nonnegative",
                                                     "nonpositive")
    for sign in signs:
        if Obligation("", "", dF, sign=sign).check():
            return sign
    need = "strictly monotone (an index is returned, so ties must stay ties)" if strict \
        else "monotone"
    raise NotFusable(r.name, F.subs(U, g), f"is not provably {need} in g = {g} for every value "
                     f"of {_names(r.anchors)} (dF/dg = {dF}), so {r.op} does not commute "
                     "with it")


# Step 3. prod: a log-domain sum and a product of signs -------------------------------
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
    lin = _linear(log_r, anchors | set(derived.values()), streams, names)
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
