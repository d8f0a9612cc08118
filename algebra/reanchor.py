"""Stage 4 for sums: a fused ``LinearComponent`` by finite-rank re-anchoring.

The body's blocks (``algebra.separate.linear_blocks``) give the state columns, the Taylor
coefficients of each block at the running anchors, and the matrix A(a, a') that moves them
when the anchors move; the component carries the obligations it relies on
(decomposition, re-anchoring, identity and composition of A), which ``prove`` checks.
"""

from __future__ import annotations

import sympy as sp

from .addition import ADDITION_LAWS, rotation
from .cascade import Reduction, carries_feature_axis
from .components import LinearComponent
from .functions import Where
from .names import Names
from .prove import Obligation
from .selects import masked
from .separate import Block, linear_blocks, taylor_indices
from .state import StateVar, primed


def linear_component(r: Reduction, anchors: set, streams: set, names: Names) -> LinearComponent:
    """The fused component of a sum: its state columns, re-anchoring matrix and obligations."""
    # a block whose terms cancel contributes nothing (sum(x - x) is a sum of zeros); a
    # feature-axis state moves its anchor factors to finalize (``separate.state_factor``)
    in_state = not carries_feature_axis(r.body, names.vector)
    blocks = [b for b in linear_blocks(r.name, r.body, anchors, streams, in_state)
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
    changes = f"when {listed(r.anchors)} change{'s' if len(r.anchors) == 1 else ''}"
    if A == sp.eye(A.rows):
        case = "plain sum" + (" (the state reads no earlier result)" if r.anchors else "")
    elif A.rows == 1:
        case = f"rank-1 re-anchoring: the state is scaled by {A[0, 0]} {changes}"
    else:
        case = (f"finite-rank re-anchoring (rank {A.rows}): the state vector is mapped by a "
                f"derived {A.rows}x{A.rows} matrix A({listed(r.anchors)} -> new) {changes}")
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
    return f"sum of {psi}" + (f" at the running {listed(sorted(at, key=str))}" if at else "")


def listed(symbols) -> str:
    """Symbols as a comma-separated list, for the texts of cases and refusals."""
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
