"""A backward through the scores: gradients that are sums of (a coefficient per row and
position) x (one vector), where the vectors meet only in dot products.

Attention's derived backward sums, over the keys ``i`` of a row, and, in the other
orientation, over the rows ``r`` of a key,

    dq[r]  = sum_i c[r, i] * k[i, :]     c = -scale * (delta - dot(do, v[i, :])) * p / d
    dk[i]  = sum_r c[r, i] * q[r, :]     (the same c)
    dv[i]  = sum_r p[r, i] / d[r] * do[r, :]

where each coefficient reads the row's and the position's scalars and the dot products
``dot(q, k[i, :])`` and ``dot(do, v[i, :])``: the scores.  Over a block of positions, each
score is one matrix product (rows x block), the coefficients one elementwise map over the
block (``block``: a kernel of its own), and each gradient one more product, ``C @ K`` into
the rows' gradient, ``C.T @ Q`` into the block's: FlashAttention's backward, with every
coefficient the engine's.  That is five products where the row and column kernels each
recompute both scores (eight).

Law: each gradient's summand is ``coefficient * u`` for one vector ``u`` (checked here by
the proof's ``is_zero``: the summand less ``coefficient * u`` is 0, case by case of its
selects, with the scores as symbols),
and the summands are the proven backward's (``Backward.spec`` and ``Backward.columns``);
the block map is the same expressions at position ``i + first``.

Examples
--------
>>> from algebra import derive
>>> t = through_scores(derive("attention").backward())
>>> sorted(t.scores.items())
[('s', ('do', 'v')), ('s_', ('q', 'k'))]
>>> [(x.gradient, x.coefficient, x.vector) for x in t.terms]  # doctest: +NORMALIZE_WHITESPACE
[('dq', 'c', 'k'), ('dscale', 'c_', ''), ('dk', 'c', 'q'), ('dv', 'c__', 'do')]
>>> print(t.block)
c[i] = -scale*(delta - s[i])*exp(-m + s_[i]*scale)/d
c_[i] = s_[i]*(-delta + s[i])*exp(-m + s_[i]*scale)/d
c__[i] = exp(-m + s_[i]*scale)/d
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .adjoint import results_in_order
from .backward import ROLES, Backward
from .backward_proof import is_zero
from .backward_text import spelling
from .cascade import POSITION, Cascade, N
from .errors import NoBackward
from .functions import Dot, Where
from .names import fresh
from .printing import spec_text
from .skip import index_bound
from .spec import parse


@dataclass(frozen=True)
class Term:
    """``gradient`` = the sum of ``coefficient`` (an output of the block map) times
    ``vector``: over the positions (``rows``: ``C @ vector``, a shared stream's block) or
    over the rows (``C.T @ vector``, a per-row vector); no vector: a row's sum of C."""

    gradient: str
    coefficient: str
    vector: str
    rows: bool


@dataclass(frozen=True)
class ThroughScores:
    """``scores``: each score's name -> (per-row vector, shared stream) of its dot
    product; ``terms`` the gradients; ``lines`` each coefficient as a line of a map over one
    block of positions (its streams the scores; ``first`` the block's first position,
    ``length`` the forward's N); ``reads`` the per-row scalars the map reads."""

    scores: dict[str, tuple[str, str]]
    terms: tuple[Term, ...]
    lines: dict[str, str]
    first: str
    length: str
    reads: tuple[str, ...]
    masks: tuple[tuple[str, sp.Expr], ...] = ()  # ``i op e``: false, every coefficient is 0

    @property
    def block(self) -> str:
        """The map of every coefficient."""
        return self.block_of(tuple(self.lines))

    def block_of(self, coefficients: tuple[str, ...]) -> str:
        """The map of these coefficients alone (a learned scale's only where wanted)."""
        return "\n".join(self.lines[c] for c in coefficients)


def through_scores(b: Backward) -> ThroughScores | None:
    """The scores form of ``b`` (module docstring), or None where a summand is not one
    coefficient times one vector, reads a stream outside the scores, or ``b`` did not
    prove."""
    if not (b.proven and b.spec and b.columns):
        return None
    rows, columns = parse(b.spec), parse(b.columns)
    vectors = set(rows.vector_inputs) | set(columns.vector_inputs)
    taken = set(rows.names) | set(columns.names)
    swap = {sp.Symbol(p, real=True): POSITION if ROLES[r] == ROLES["position"] else N
            for p, r in b.column_params.items()}
    per_row = {p.name for p in rows.params} - vectors  # the forward's per-row scalars
    scores: dict[frozenset, sp.Symbol] = {}
    found = [_term(r.name, r.body.xreplace(swap), along, c, per_row, scores, taken)
             for c, along in ((rows, True), (columns, False)) for r in c.reductions]
    if any(f is None for f in found) or any(r.op != "sum" for c in (rows, columns)
                                            for r in c.reductions):
        return None
    shared = {s.name for s in rows.streams}
    pairs = {s.name: tuple(sorted(k, key=lambda n: n in shared)) for k, s in scores.items()}
    if any(len(p) != 2 or p[0] in shared or p[1] not in shared for p in pairs.values()):
        return None  # a score of two per-row vectors, or of two streams
    return _assembled(found, pairs, per_row, taken)


def _term(gradient: str, body: sp.Expr, along: bool, c: Cascade, per_row: set,
          scores: dict, taken: set) -> tuple[str, sp.Expr, str, bool] | None:
    """(gradient, coefficient, vector, along the positions) of one summand of ``c``, with
    its dot products as score symbols (named in ``scores``), or None."""
    for dot in sorted(body.atoms(Dot), key=str):  # names in one order on every run
        key = frozenset(a.name for a in dot.args)
        if key not in scores:
            scores[key] = sp.Symbol(fresh("s", taken), real=True)
            taken.add(scores[key].name)
    body = body.xreplace({d: scores[frozenset(a.name for a in d.args)]
                          for d in body.atoms(Dot)})
    outside = [s for s in body.free_symbols if s.name in c.vector_inputs]
    if len(outside) > 1 or (outside and outside[0] not in c.streams):
        return None  # two vectors, or a vector every summand of a row shares
    u = outside[0] if outside else sp.S.One
    coefficient = body.xreplace({u: sp.S.One})
    if not is_zero(body - coefficient * u):
        return None  # not one coefficient times u
    known = per_row | {s.name for s in scores.values()} | {POSITION.name, N.name}
    if any(s.name not in known for s in coefficient.free_symbols):
        return None  # a stream of the positions outside the scores (a per-key bias)
    return gradient, coefficient, u.name if outside else "", along


def _assembled(found: list, scores: dict[str, tuple[str, str]], per_row: set,
               taken: set) -> ThroughScores:
    """The terms, each distinct coefficient once in the block map (dk's is dq's)."""
    first, length = (sp.Symbol(fresh(n, taken), integer=True, nonnegative=True)
                     for n in ("first", "length"))
    outputs: list[tuple[str, sp.Expr]] = []
    terms = []
    for gradient, coefficient, vector, along in found:
        name = next((n for n, e in outputs if is_zero(e - coefficient)), None)
        if name is None:
            name = fresh("c", taken | {n for n, _ in outputs})
            outputs.append((name, coefficient))
        terms.append(Term(gradient, name, vector, along))

    def spell(s: sp.Symbol) -> str:
        return f"{s.name}[i]" if s.name in scores else s.name

    shift = {POSITION: POSITION + first, N: length}
    lines = {n: f"{n}[i] = {spec_text(e.xreplace(shift), spell, NoBackward)}"
             for n, e in outputs}
    reads = sorted({s.name for _, e in outputs for s in e.free_symbols} & per_row)
    return ThroughScores(scores, tuple(terms), lines, first.name, length.name, tuple(reads),
                         _masks([e for _, e in outputs], per_row))


def _masks(coefficients: list[sp.Expr], per_row: set) -> tuple[tuple[str, sp.Expr], ...]:
    """(op, e) for each select condition ``i op e`` (``e`` of per-row values) false on
    which every coefficient is 0: a (row, key) pair where it is false adds nothing."""
    conds = sorted({w.args[0] for e in coefficients for w in e.atoms(Where)}, key=str)
    out = []
    for cond in conds:
        found = index_bound(cond)
        if found is None or any(s.name not in per_row for s in found[1].free_symbols):
            continue
        if all(is_zero(e.xreplace({cond: sp.false})) for e in coefficients):
            out.append(found)
    return tuple(out)


def forward_on_scores(b: Backward, t: ThroughScores) -> str | None:
    """The forward of ``b`` with each of ``t``'s scores a stream of its own (``s[i]``): its
    per-row results from scores already computed, so that a forward that multiplies the
    scores out (``redfuser.torch_loss``) runs its reductions and its backward's block map
    on the one product.  None where a result reads a vector outside the scores or the
    forward has a per-element output.

    Law: a score symbol is its dot product (``xreplace`` of each ``dot(a, b)`` by the score
    of the same pair), so the results are the forward's own.

    Examples
    --------
    >>> from algebra import derive
    >>> b = derive("linear_cross_entropy").backward()
    >>> print(forward_on_scores(b, through_scores(b)))
    m = max(s[i])
    lse_sum = sum(exp(-m + s[i]))
    loss_sum = sum(where(i == label, s[i], 0))
    lse = m + log(lse_sum)
    loss = -loss_sum + lse
    """
    c = parse(b.forward_spec)
    if c.elementwise:
        return None
    named = {frozenset(pair): sp.Symbol(name, real=True) for name, pair in t.scores.items()}
    bodies = {r.name: r for r in c.reductions}
    lines = []
    name = spelling(c, set(t.scores) | {s.name for s in c.streams})
    for result in results_in_order(c):
        r = bodies.get(result)
        body = r.body if r else c.epilogues[result]
        dots = {d: named.get(frozenset(a.name for a in d.args)) for d in body.atoms(Dot)}
        if None in dots.values():
            return None  # a dot product that is not one of the scores
        body = body.xreplace(dots)
        if any(s.name in c.vector_inputs for s in body.free_symbols):
            return None
        text = spec_text(body, name, NoBackward)
        lines.append(f"{result} = {r.op}({text}{f', {r.k}' if r.k else ''})" if r else
                     f"{result} = {text}")
    return "\n".join(lines)
