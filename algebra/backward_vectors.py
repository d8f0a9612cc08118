"""Feature vectors in a backward cascade (``algebra.backward``): vector results contracted
with their upstream gradient, and gradients summed over the rows written in the other
orientation.

*Contraction.*  A vector result (attention's ``o = sum(p * v[i, :]) / d``) is linear in one
feature vector per term, so the loss it adds, ``dot(do, o)``, is a scalar cascade: each
vector reduction and epilogue it reads becomes ``dot(do, .)`` pushed inward
(``v -> dot(do, v)``, selects branch by branch).  The scalar sweep then differentiates
that, and its value ``dot(do, o)`` is a per-row number computed from the saved output
before the kernels run (FlashAttention's ``delta = rowsum(dO * O)``); a hidden vector sum it
read (``o_sum``) is solved from the output's epilogue (``o_sum = o * d``), so it is never
saved.

*The other orientation.*  The gradient of a stream shared by the rows (keys and values:
``dk[i, :]``, ``dv[i, :]``) is a sum over the rows.  Written with the rows as the stream it is
an ordinary cascade: each forward stream (and the stream position) becomes a per-row value
of the new rows, and each per-row value (queries, upstreams, saved results) a stream.  The
same engine derives, proves and lowers it: one kernel per key row, a fixed summation order,
so two runs give identical bits (FlashAttention-2's backward loops over key blocks for the
same reason).

Examples
--------
>>> from algebra.spec import parse
>>> c = parse("s = dot(q, k[i, :])\\nm = max(s)\\nd = sum(exp(s - m))\\n"
...           "o = sum(exp(s - m) * v[i, :]) / d")
>>> k, seeds, dots = contracted(c, ("o",), {"o": sp.Symbol("do", real=True)}, set())
>>> k.reductions[-1].body, dict(seeds), dots["o"]
(dot(do, v)*exp(-m + dot(q, k)), {'o': 1}, (do, delta))
"""

from __future__ import annotations

import dataclasses

import sympy as sp

from . import layout
from .adjoint import RowSum
from .cascade import LENGTH, POSITION, Cascade, N, Shape, carries_feature_axis
from .errors import NoBackward
from .functions import Dot, Where
from .names import fresh

# Functions simplify must not rewrite: each is held as an opaque symbol while it runs.
OPAQUE = (
    # abs' with torch's abs'(0) = 0: simplify writes it as a Piecewise of u / |u| and
    # Eq(u, 0), which no select case fixes (mad's backward: unproven after 38 s)
    sp.sign,
    # tanh' = 1 - tanh**2: simplify writes it with cosh and sinh, which the spec language
    # spells with tanh again as sinh(2u) = tanh(2u) / sqrt(1 - tanh(2u)**2): 0 / 0 once
    # tanh rounds to 1 (a softcap's dc was inf past |u| = 4.5 in float32)
    sp.tanh,
)

NOT_LINEAR = ("vector result {name}: `{expr}` is not linear in one feature vector per term "
              "(only such results are contracted with their upstream gradient)")


def vector_results(c: Cascade) -> set[str]:
    """The per-row results that carry the feature axis."""
    return layout.vector_results(c, c.vector_inputs) - set(c.vector_inputs) - set(c.elementwise)


def contract(e: sp.Expr, w: sp.Symbol, inputs: set[str], results: set[str],
             name: str) -> sp.Expr:
    """``dot(w, e)`` pushed inward, for ``e`` linear in one feature vector per term (an
    input in ``inputs``, or a vector result in ``results``, whose name stands for its own
    contraction).

    Examples
    --------
    >>> v, s, do, o = sp.symbols("v s do o", real=True)
    >>> contract(sp.exp(s) * v + 2 * v, do, {"v"}, set(), "o_sum")
    dot(do, v)*exp(s) + 2*dot(do, v)
    >>> contract(o / s, do, {"v"}, {"o"}, "y")
    o/s
    """
    if not carries_feature_axis(e, inputs | results):
        if e == 0:
            return sp.S.Zero
        raise NoBackward(NOT_LINEAR.format(name=name, expr=e))
    if e.is_Symbol:
        return e if e.name in results else Dot(w, e)
    if e.is_Add:
        return sp.Add(*(contract(a, w, inputs, results, name) for a in e.args))
    if e.is_Mul:
        vec = [a for a in e.args if carries_feature_axis(a, inputs | results)]
        if len(vec) == 1:
            rest = sp.Mul(*(a for a in e.args if a is not vec[0]))
            return rest * contract(vec[0], w, inputs, results, name)
    if isinstance(e, Where):
        return Where(e.args[0], *(contract(a, w, inputs, results, name) for a in e.args[1:]))
    raise NoBackward(NOT_LINEAR.format(name=name, expr=e))


def contracted(c: Cascade, outputs: tuple[str, ...], upstream: dict[str, sp.Symbol],
               taken: set[str]):
    """(the scalar cascade, the seed of each output's adjoint, and for each vector output
    (its upstream, the symbol of ``dot(upstream, output)``)); ``upstream`` names each
    output's gradient input."""
    vec = vector_results(c)
    seeds = {o: (sp.S.One if o in vec else upstream[o]) for o in outputs}
    if not vec:
        return c, seeds, {}
    owner = _owners(c, outputs, vec)
    reductions = tuple(dataclasses.replace(r, body=_contracted(r.body, r.name, owner, upstream,
                                                               c, vec))
                       if r.name in vec else r for r in c.reductions)
    epilogues = {n: _contracted(e, n, owner, upstream, c, vec) if n in vec else e
                 for n, e in c.epilogues.items()}
    shapes = {n: Shape(False) if n in vec else s for n, s in c.shapes.items()}
    dots = {}
    for o in outputs:
        if o in vec:
            name = fresh("delta", taken)
            taken.add(name)
            dots[o] = (upstream[o], sp.Symbol(name, real=True))
    return dataclasses.replace(c, reductions=reductions, epilogues=epilogues,
                               shapes=shapes), seeds, dots


def _contracted(e, name, owner, upstream, c: Cascade, vec: set[str]):
    if name not in owner:
        raise NoBackward(f"vector result {name} is read by no differentiated vector output "
                         "(only those are contracted)")
    return contract(e, upstream[owner[name]], set(c.vector_inputs), vec, name)


def _owners(c: Cascade, outputs, vec: set[str]) -> dict[str, str]:
    """Each vector result -> the one differentiated vector output that reads it."""
    defs = {r.name: r.body for r in c.reductions} | dict(c.epilogues)
    owner: dict[str, str] = {}
    for o in outputs:
        if o not in vec:
            continue
        todo = [o]
        while todo:
            r = todo.pop()
            if r in owner and owner[r] != o:
                raise NoBackward(f"vector result {r} is read by two differentiated outputs "
                                 f"({owner[r]}, {o}): each needs its own contraction")
            owner[r] = o
            todo += [s.name for s in defs[r].free_symbols if s.name in vec]
    return owner


def solved_hidden(c: Cascade, dots: dict, expr: sp.Expr) -> sp.Expr:
    """``expr`` with each contracted vector output written as its ``delta`` symbol and each
    hidden vector sum it read solved from the output's epilogue (o_sum = o * d)."""
    vec = vector_results(c)
    for o, (_, delta) in dots.items():
        by_name = {s.name: s for s in expr.free_symbols}
        if o in by_name:
            expr = expr.xreplace({by_name[o]: delta})
        for s in c.epilogues.get(o, sp.S.Zero).free_symbols:
            if s.name in vec and s.name in by_name:
                sol = sp.solve(sp.Eq(delta, c.epilogues[o]), s)
                if len(sol) != 1:
                    raise NoBackward(f"the hidden vector sum {s.name} cannot be solved from "
                                     f"{o} = {c.epilogues[o]}")
                expr = expr.xreplace({by_name[s.name]: sol[0]})
    return expr


def simplified(e: sp.Expr, tidy=sp.simplify) -> sp.Expr:
    """``tidy(e)`` (sympy's simplify), with the selects of one condition gathered into one,
    each branch simplified apart: simplify on a select spends most of its time testing the
    relational condition numerically (``i <= pos``: 1.4 of causal_attention's 3.3 s
    backward), which the branches do not hold.  Where a branch is written every select of
    that condition takes it, so both cases are the cases the proof takes
    (``backward_proof.is_zero``).  The functions of ``OPAQUE`` are held as they are, each
    for the reason its row gives.

    Examples
    --------
    >>> i, p, x = sp.symbols("i pos x", real=True)
    >>> simplified(x * Where(i <= p, x, 0) + Where(i <= p, 1, 0))
    where(i <= pos, x**2 + 1, 0)
    >>> simplified(-2 * sp.sign(p - x) / 2)
    -sign(pos - x)
    """
    opaque = {s: sp.Dummy(type(s).__name__, real=True) for s in e.atoms(*OPAQUE)}
    if opaque:
        held = simplified(e.xreplace(opaque), tidy)
        return held.xreplace({d: s for s, d in opaque.items()})
    conditions = {w.args[0] for w in e.atoms(Where)}
    if len(conditions) != 1:
        return tidy(e)
    (c,) = conditions
    taken, other = (tidy(e.replace(lambda w: isinstance(w, Where) and w.args[0] == c,
                                   lambda w, k=k: w.args[k])) for k in (1, 2))
    return taken if taken == other else Where(c, taken, other)


def tidied(e: sp.Expr) -> sp.Expr:
    """Simplified again once ``delta`` stands for what the sweep wrote in two pieces, and
    the selects of one condition gathered into one (a masked attention's dq: one
    ``where(i <= pos, ..., 0)`` around the term, not one per factor)."""
    if e.has(RowSum):
        return e.replace(lambda x: isinstance(x, RowSum), lambda x: RowSum(tidied(x.args[0])))
    return simplified(e, lambda x: sp.factor_terms(sp.simplify(x)))


ROLES = {"position": "the position i of the forward's stream",
         "length": "the forward's stream length N"}


def column_text(c: Cascade, grads: list[tuple[str, sp.Expr]], per_row: set[str],
                vectors: set[str], taken: set[str], printer) -> tuple[str, dict[str, str]]:
    """The gradients summed over the rows as a cascade whose stream is the rows: the shared
    streams and the position become per-row values (the position a parameter named
    ``at``, the forward's N one named ``n_stream``), names in ``per_row`` (per-row values,
    and streams each row holds its own of) become streams.  Returns the spec text and the
    new parameters {name: its role in ``ROLES``}."""
    at, length = fresh("at", taken), fresh(LENGTH.lower() + "_stream", taken)
    taken |= {at, length}
    swap = {POSITION: sp.Symbol(at, real=True), N: sp.Symbol(length, positive=True)}

    def spell(s: sp.Symbol) -> str:
        if s.name in per_row:
            return f"{s.name}[i, :]" if s.name in vectors else f"{s.name}[i]"
        return s.name

    lines = [f"{g} = sum({printer(e.xreplace(swap), spell)})" for g, e in grads]
    used = {s for _, e in grads for s in e.free_symbols}
    roles = {at: (POSITION, "position"), length: (N, "length")}
    return "\n".join(lines), {p: role for p, (s, role) in roles.items() if s in used}
