"""Stage 3, separate: split a reduction body into stream parts and anchor parts.

Three analyses, one per algebraic family of ``laws.LAWS``:

- ``linear_blocks`` (sum): body = sum_b C_b(a) * K_b(x, a), where C_b depends on the
  anchors only (its powers of anchors stay in the state, the rest moves to finalize:
  ``state_factor``) and K_b = sum_t exp(alpha_t(x) + beta_b(a)) * P_t(x, a)
  * W_t(gamma_t(x) + theta_b(a)) with each P_t a polynomial in the anchors and W_t a wave
  (sin, cos, or none).  The exponential keeps its anchor part (that is what keeps exp() in
  range); the polynomial keeps its shifted form (that is what keeps variance stable); the
  wave keeps its phase (sin(x - m), not sin x cos m - cos x sin m, stays exact near x = m).
  ``algebra.addition.ADDITION_LAWS`` is the table of the functions of a stream part plus an
  anchor part that split this way, with the identity each relies on.
- ``monotone_core`` (max/min/arg*/topk): body = F(g(x), a) for one anchor-free g.
- ``multiplicative_split`` (prod): body = C(a) * G(x), then ``polar`` writes each as
  sign * exp(log|.|), whose log-sum is a linear body like any other.

A body with selects (``where``) is first checked by ``refusals.check_selects``: a select
whose condition reads the stream and parameters only is separable (each leaf of the select
tree is separated on its own, and its state sums run over the elements of its mask: see
``algebra.selects``); a condition that reads an anchor is refused.

Anything else raises ``NotFusable`` naming the smallest offending sub-expression
(``refusals.culprit``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import sympy as sp

from .addition import PHASE, exp_form, is_wave, mixes, wave_parts
from .errors import NotFusable
from .refusals import WHY, culprit
from .selects import common_out, leaves, masked


@dataclass(frozen=True)
class Block:
    """Terms sharing one anchor-only factor ``coeff``, one exponent anchor part ``beta`` and
    one wave phase ``theta`` (0 without waves)."""

    coeff: sp.Expr  # anchor-only factor applied at finalize (see ``state_factor``)
    beta: sp.Expr
    terms: tuple[tuple[sp.Expr, sp.Expr, sp.Expr], ...]  # (alpha_t(x), P_t(x, a), W_t(PHASE))
    mask: sp.Basic = sp.true  # the elements the block sums over (a select's leaf)
    theta: sp.Expr = sp.S.Zero
    kept: sp.Expr = sp.S.One  # anchor-only factor kept in the state, re-anchored by its ratio

    @property
    def quarters(self) -> tuple[int, ...]:
        """The wave phases each Taylor coefficient needs: W(theta) and W(theta + pi/2)."""
        return (0, 1) if any(w != 1 for _, _, w in self.terms) else (0,)

    def masked(self, value: sp.Expr) -> sp.Expr:
        """``value`` on the block's elements, 0 on the others."""
        return value if self.mask is sp.true else masked(self.mask, value)

    def reads(self, anchors: set) -> bool:
        """Does the block depend on an anchor (re-anchored, or an anchor factor)?"""
        free = (self.coeff.free_symbols | self.beta.free_symbols | self.theta.free_symbols |
                self.kept.free_symbols)
        for _, poly, _ in self.terms:
            free |= poly.free_symbols
        return bool(free & anchors)

    def kernel(self, deriv: dict[sp.Symbol, int] | None = None, quarter: int = 0) -> sp.Expr:
        """sum_t exp(alpha_t + beta) * d^deriv P_t / deriv! * W_t(theta + quarter*pi/2)
        (the Taylor coefficient T_deriv; quarter 1 is its wave's partner)."""
        total = sp.S.Zero
        phase = self.theta + quarter * sp.pi / 2
        for alpha, poly, wave in self.terms:
            for a, k in (deriv or {}).items():
                poly = sp.diff(poly, a, k) / sp.factorial(k)
            total += _exp(alpha + self.beta) * poly * wave.subs(PHASE, phase)
        return self.kept * total


def _exp(e: sp.Expr) -> sp.Expr:
    """exp(e) with e's common factors pulled out: exp((x - m)/T), not exp(x/T - m/T), which a
    kernel contracts into fma(x, 1/T, -m/T) that misses 0 at x = m by an ulp of m/T (2e23 at
    3e30, and exp of that overflows)."""
    return sp.S.One if e == 0 else sp.exp(sp.factor_terms(e))


def _split_terms(e: sp.Expr, has_exp) -> list[tuple[sp.Expr, sp.Expr]]:
    """Distribute ``e`` into (exponent, rest) terms, opening only sums and products for
    which ``has_exp`` holds."""
    if isinstance(e, sp.exp):
        return [(e.args[0], sp.S.One)]
    if e.is_Add and has_exp(e):
        return [t for arg in e.args for t in _split_terms(arg, has_exp)]
    if e.is_Mul and has_exp(e):
        out = [(sp.S.Zero, sp.S.One)]
        for arg in e.args:
            out = [(x1 + x2, r1 * r2) for (x1, r1), (x2, r2) in
                   product(out, _split_terms(arg, has_exp))]
        return out
    if e.is_Pow and e.exp.is_Integer and e.exp > 0 and has_exp(e.base):
        return _split_terms(sp.Mul(*[e.base] * int(e.exp), evaluate=False), has_exp)
    if e.is_Pow and isinstance(e.base, sp.exp):  # exp(a)**p == exp(p*a)
        return [(e.base.args[0] * e.exp, sp.S.One)]
    return [(sp.S.Zero, e)]


def _split_exponent(expo, anchors, streams, name) -> tuple[sp.Expr, sp.Expr]:
    return _split_argument(sp.exp, expo, anchors, streams, name)


def _split_argument(func, arg, anchors, streams, name) -> tuple[sp.Expr, sp.Expr]:
    """``arg`` of ``func`` (an exp or a wave) as stream part + anchor part (an addition law
    applies to nothing else)."""
    stream, anchor = sp.S.Zero, sp.S.Zero
    for t in sp.Add.make_args(sp.expand(arg)):
        if mixes(t, anchors, streams):
            raise NotFusable(name, func(arg), WHY[func])
        if t.free_symbols & streams:
            stream += t
        else:
            anchor += t
    return stream, anchor


def linear_blocks(name: str, body: sp.Expr, anchors: set, streams: set,
                  in_state: bool = True) -> list[Block]:
    """Decompose a sum body into blocks ``C_b(a) * sum_t exp(alpha_t + beta_b) * P_t * W_t``;
    ``in_state``: powers of the anchors stay in the state (``state_factor``).

    Examples
    --------
    >>> x, m, d = sp.symbols("x m d", real=True)
    >>> [(b.coeff, b.beta, b.terms)
    ...  for b in linear_blocks("o", sp.exp(x - m) / (d + 1), {m, d}, {x})]
    [(1/(d + 1), -m, ((x, 1, 1),))]
    >>> [(b.kept, b.coeff) for b in linear_blocks("o", sp.exp(x - m) / d, {m, d}, {x})]
    [(1/d, 1)]
    >>> [(b.theta, b.quarters) for b in linear_blocks("s", sp.sin(x - m), {m}, {x})]
    [(m, (0, 1))]
    """

    def has_exp(e):
        return any(mixes(f, anchors, streams) or f.free_symbols & anchors
                   for f in e.atoms(sp.exp))

    def opens(e):  # sums holding an exp, and products whose anchors are not polynomial:
        # (b + g*(x - mean)/sqrt(var)) * w distributes into separable terms
        return has_exp(e) or (mixes(e, anchors, streams) and
                              not e.is_polynomial(*(e.free_symbols & anchors)))

    groups: dict[tuple, dict[tuple, sp.Expr]] = {}
    # with no anchor nothing is re-anchored: the sum runs as written, one select per element
    # (the branches' common factors taken out: a vector factor multiplies the chosen scalar)
    # instead of one sum per leaf
    pieces = [(sp.true, common_out(body))] if not anchors else leaves(exp_form(body, anchors))
    for mask, leaf in pieces:
        for expo, rest in _split_terms(leaf, opens):
            for part in wave_parts(name, rest, anchors, streams):
                _add_term(name, expo, part, mask, anchors, streams, groups, in_state)
    return [Block(c, b, tuple((a, p, w) for (a, w), p in t.items()), mask, theta, kept)
            for (c, b, theta, mask, kept), t in groups.items()]


def _add_term(name, expo, rest, mask, anchors, streams, groups, in_state):
    """Add one term exp(expo) * rest of a select-free leaf (summed over the elements of
    ``mask``) to its block."""
    alpha, beta = _split_exponent(expo, anchors, streams, name)
    coeff, poly, wave, theta = sp.S.One, sp.S.One, sp.S.One, sp.S.Zero
    if alpha == 0:  # exp of anchors alone: a plain anchor factor, finalize takes it
        coeff, beta = _exp(beta), sp.S.Zero
    for f in sp.Mul.make_args(rest):
        if not f.free_symbols & anchors:
            poly *= f
        elif not f.free_symbols & streams:
            coeff *= f
        elif f.is_polynomial(*(f.free_symbols & anchors)):
            poly *= f
        elif is_wave(f, anchors, streams):  # one per term (``_wave_parts``)
            gamma, theta = _split_argument(f.func, f.args[0], anchors, streams, name)
            wave = f.func(gamma + PHASE)
        else:
            raise NotFusable(name, *culprit(f, anchors, streams))
    kept, coeff = state_factor(coeff, anchors) if in_state else (sp.S.One, coeff)
    terms = groups.setdefault((coeff, beta, theta, mask, kept), {})
    terms[(alpha, wave)] = terms.get((alpha, wave), sp.S.Zero) + poly


def state_factor(coeff: sp.Expr, anchors: set) -> tuple[sp.Expr, sp.Expr]:
    """Split an anchor-only factor into (kept in the state, applied at finalize).

    Moving a factor C(a) out of a sum (sum(C(a) K) = C(a) sum(K)) changes the range the state
    lives in: the user who wrote sum((x / m)**2) keeps every term near 1, and sum(x**2)
    overflows float32 at 2e19.  So the state keeps the spec's own terms wherever the
    re-anchoring stays exact: integer powers of the anchors themselves (m**-2, 1/d, m),
    re-anchored by their ratio (m / m')**2; where the anchor is 0 or not finite the state is
    held at 1 instead (``guarded_anchors``).  Any other factor (1/(v + eps), log(m)) has
    zeros or poles the state could not step over exactly, and moves to finalize (so does
    every factor of a feature-axis state, whose D-vector would be rescaled at every move).

    Examples
    --------
    >>> m, d, e = sp.symbols("m d e", real=True)
    >>> state_factor(2 / (m**2 * (d + e)), {m, d})
    (m**(-2), 2/(d + e))
    """
    kept = sp.S.One
    for f in sp.Mul.make_args(coeff):
        base, e = (f.base, f.exp) if f.is_Pow else (f, sp.S.One)
        if base in anchors and e.is_Integer:
            kept *= f
    return kept, coeff / kept


MAX_RANK = 16  # state sums per block: beyond this a "one pass" costs more than it saves


def taylor_indices(name: str, block: Block, anchors: set) -> list[dict[sp.Symbol, int]]:
    """Multi-indices of the nonzero Taylor coefficients of the block in its polynomial anchors."""
    poly_anchors = sorted({a for _, p, _ in block.terms for a in p.free_symbols & anchors},
                          key=str)
    degree = {a: max(sp.degree(p, a) for _, p, _ in block.terms) for a in poly_anchors}
    size = len(block.quarters)
    for a in poly_anchors:
        size *= degree[a] + 1
    if size > MAX_RANK:
        culprit_term = max((p for _, p, _ in block.terms), key=lambda p: sp.count_ops(p))
        raise NotFusable(name, culprit_term, f"needs {size} state sums to re-anchor (degrees "
                         f"{degree} in the anchors), more than the limit of {MAX_RANK}")
    out = []
    for ks in product(*(range(degree[a] + 1) for a in poly_anchors)):
        idx = {a: k for a, k in zip(poly_anchors, ks, strict=True) if k}
        if block.kernel(idx) != 0:
            out.append(idx)
    return out


def monotone_core(name: str, body: sp.Expr, anchors: set, streams: set):
    """Write ``body = F(g(x), a)`` with g anchor-free; returns (g, F, u) or raises NotFusable.

    Examples
    --------
    >>> x, m, d = sp.symbols("x m d", real=True)
    >>> g, F, u = monotone_core("t", sp.exp(x - m) / d, {m, d}, {x})
    >>> g, F.subs(u, sp.Symbol("u"))
    (x, exp(-m + u)/d)
    """
    u = sp.Dummy("u", real=True)
    cores: set[sp.Expr] = set()

    def walk(e):
        if not e.free_symbols & anchors:
            if e.free_symbols & streams:
                cores.add(e)
                return u
            return e
        if e.is_Atom:
            return e
        if e.is_Add or e.is_Mul:
            free = [a for a in e.args if not a.free_symbols & anchors]
            rest = [walk(a) for a in e.args if a.free_symbols & anchors]
            return e.func(*rest, walk(e.func(*free))) if free else e.func(*rest)
        return e.func(*[walk(a) for a in e.args])

    F = walk(body)
    if len(cores) != 1:
        parts = ", ".join(f"`{c}`" for c in sorted(cores, key=str))
        raise NotFusable(name, body, f"reads the stream through several parts ({parts}) "
                                     "mixed with the anchors, so it is not a monotone function "
                                     "of one stream quantity g(x)")
    return cores.pop(), F, u


def multiplicative_split(name: str, body: sp.Expr, anchors: set, streams: set):
    """Write ``body = C(a) * G(x)`` (exp factors split in their exponent); else NotFusable."""
    coeff, rest = sp.S.One, sp.S.One
    for f in sp.Mul.make_args(sp.powsimp(exp_form(body, anchors))):  # 2**(x - m) splits too
        if isinstance(f, sp.exp) and mixes(f, anchors, streams):
            alpha, beta = _split_exponent(f.args[0], anchors, streams, name)
            coeff, rest = coeff * sp.exp(beta), rest * sp.exp(alpha)
        elif not f.free_symbols & anchors:
            rest *= f
        elif not f.free_symbols & streams:
            coeff *= f
        else:
            raise NotFusable(name, f, "is not a product of a stream factor and an anchor "
                                      "factor, so prod() cannot pull the anchor out")
    return coeff, rest


def polar(f: sp.Expr) -> tuple[sp.Expr, sp.Expr, set[sp.Expr]]:
    """``f = sign * exp(log_magnitude)``, opened through products, integer powers and
    exponentials: returns (sign, log_magnitude, atoms), each atom ``a`` entering as
    ``sign(a)`` and ``log(Abs(a))`` (the identity ``sign(a) * exp(log|a|) = a`` per atom is
    what a product's proof checks).  A non-integer power stays an atom: sqrt(x) of a
    negative x is NaN, which log(Abs(sqrt(x))) keeps and (1/2) log|x| would not.

    Examples
    --------
    >>> x, m = sp.symbols("x m", real=True)
    >>> sign, log_abs, atoms = polar(sp.exp(x - m) * x**2 / m)
    >>> sign, log_abs == x - m + 2 * sp.log(sp.Abs(x)) - sp.log(sp.Abs(m)), sorted(atoms, key=str)
    (sign(x)**2/sign(m), True, [m, x])
    """
    if f.is_Mul:
        parts = [polar(a) for a in f.args]
        return (sp.Mul(*(p[0] for p in parts)), sp.Add(*(p[1] for p in parts)),
                set().union(*(p[2] for p in parts)))
    if f.is_Pow and f.exp.is_Integer:
        sign, log_abs, atoms = polar(f.base)
        return sign ** f.exp, f.exp * log_abs, atoms
    if isinstance(f, sp.exp):
        return sp.S.One, f.args[0], set()
    if f.is_number and f.is_positive:
        return sp.S.One, sp.log(f), set()
    return sp.sign(f), sp.log(sp.Abs(f)), {f}
