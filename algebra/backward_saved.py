"""Per-element outputs a backward reads from the forward instead of recomputing them.

The reverse sweep (``algebra.backward``) writes every per-element value of the forward in
closed form, from the stream and the saved per-row results: softmax's backward recomputes
``exp(x[i] - m) / d`` in each of its two passes over the row.  A per-element output the
caller differentiates is one the forward returned and the caller holds (torch's autograd
graph keeps it: saving it costs no memory), so the backward may read it as a stream
instead, as torch's own softmax backward reads y (``dx = y * (dy - sum(dy * y))``).

Decided by rule, not by name: the output's closed form is substituted into the backward's
lines (sympy ``subs``, which matches sub-products of a product: ``exp(x - m) / d**2`` is
``y / d``; a transcendental factor left alone is y over the closed form's per-row factors:
``g_d * exp(x - m)`` is ``g_d * d * y``), and the substitution is kept only where it pays
for the stream it adds:

- every transcendental of the closed form the backward computed per element (softmax's
  ``exp(x[i] - m)``) is gone from it, or
- the per-element work (``work``: the streams read, then the operations on per-element
  values) is strictly less.  A stream read comes first: these row kernels are bound by
  memory, where one more row of floats to load costs more than a few products of values
  already loaded, so an output read in addition to the stream it is computed from pays
  only by a transcendental.

l2_normalize's ``y = x / r`` and rmsnorm's ``y = x * g / r`` keep their recompute: their
backward reads x anyway (``dx`` has a term in x), and y would save one product at the cost
of a third stream; layernorm's ``y = xhat * g + b`` appears in no line of its backward.
An output the caller does not differentiate (only a per-row result is) is recomputed: the
caller need not hold it.

Nothing new is trusted: the proof (``algebra.backward_proof``) unrolls a read output as its
definition, so the gradients are proven as they are written, reading it.
"""

from __future__ import annotations

import sympy as sp
from sympy.codegen.cfunctions import expm1, log1p

from .cascade import Cascade
from .functions import Sigmoid, Softplus

# the functions whose per-element evaluation is the backward's cost (a few dozen flops
# each, where a product or a select is one)
TRANSCENDENTAL = (sp.exp, sp.log, sp.tanh, sp.sinh, sp.cosh, sp.sin, sp.cos, sp.erf,
                  Sigmoid, Softplus, log1p, expm1)


def read_outputs(c: Cascade, outputs: tuple[str, ...], lines: list, streams: list,
                 per_element: set[sp.Symbol]) -> tuple[list, list, tuple[str, ...]]:
    """``lines`` (name, per-row expression) and ``streams`` (stream, gradient name,
    per-element expression) with each per-element output of ``outputs`` read where that
    pays (module docstring), and the outputs read.

    Examples
    --------
    >>> from algebra.spec import parse
    >>> c = parse("m = max(x[i])\\nd = sum(exp(x[i] - m))\\ny[i] = exp(x[i] - m) / d")
    >>> d, m, x = sorted(c.elementwise["y"].free_symbols, key=str)
    >>> dy = sp.Symbol("dy", real=True)
    >>> streams = [(x, "dx", dy * sp.exp(x - m) / d)]
    >>> read_outputs(c, ("y",), [], streams, {x, dy})
    ([], [(x, 'dx', dy*y)], ('y',))
    """
    read: list[str] = []
    for name in (o for o in outputs if o in c.elementwise):
        y, form = sp.Symbol(name, real=True), c.elementwise[name]
        new_lines = [(g, _read(e, form, y, per_element)) for g, e in lines]
        new_streams = [(s, g, _read(e, form, y, per_element)) for s, g, e in streams]
        before = [e for _, e in lines] + [e for _, _, e in streams]
        after = [e for _, e in new_lines] + [e for _, _, e in new_streams]
        if any(e.has(y) for e in after) and _pays(form, before, after, per_element | {y}):
            lines, streams, per_element = new_lines, new_streams, per_element | {y}
            read.append(name)
    return lines, streams, tuple(read)


def _read(e: sp.Expr, form: sp.Expr, y: sp.Symbol, per_element: set[sp.Symbol]) -> sp.Expr:
    """``e`` reading ``y`` for its closed form ``form``: ``subs`` matches ``form`` and its
    sub-products; a transcendental factor of ``form`` whose other factors are per-row is
    then read as y over them wherever it is left (``g_d * exp(x - m)``, with
    ``y = exp(x - m) / d``, is ``g_d * y * d``)."""
    e = e.subs(form, y)
    factors = sp.Mul.make_args(form)
    rests = {t: sp.Mul(*(f for f in factors if f != t)) for t in factors
             if t in _transcendentals([t], per_element)}
    return e.xreplace({t: y / rest for t, rest in rests.items()
                       if not rest.free_symbols & per_element})


def _pays(form: sp.Expr, before: list, after: list, per_element: set[sp.Symbol]) -> bool:
    """Every transcendental of ``form`` that ``before`` computed is gone, or the work is
    strictly less."""
    costly = _transcendentals([form], per_element) & _transcendentals(before, per_element)
    if costly and not costly & _transcendentals(after, per_element):
        return True
    return work(after, per_element) < work(before, per_element)


def _transcendentals(exprs: list, per_element: set[sp.Symbol]) -> set[sp.Expr]:
    """The per-element transcendental calls and non-integer powers (a square root) in
    ``exprs``."""
    found = set()
    for e in exprs:
        found |= e.atoms(*TRANSCENDENTAL)
        found |= {p for p in e.atoms(sp.Pow) if not p.exp.is_Integer}
    return {t for t in found if t.free_symbols & per_element}


def work(exprs: list, per_element: set[sp.Symbol]) -> tuple[int, int]:
    """(the per-element values ``exprs`` read, their operations per element), to compare
    in that order (module docstring): a subexpression of per-row values alone is computed
    once a row (not counted), and a sum or product of k per-element terms and per-row ones
    is k operations.

    Examples
    --------
    >>> x, y, dy, r = sp.symbols("x y dy r", real=True)
    >>> work([dy * x / r**2, dy * x], {x, y, dy}), work([dy * y / r, dy * x], {x, y, dy})
    ((2, 3), (3, 3))
    """
    loads = set().union(*(e.free_symbols & per_element for e in exprs))
    return len(loads), sum(_operations(e, per_element) for e in exprs)


def _operations(e: sp.Expr, per_element: set[sp.Symbol]) -> int:
    varying = [a for a in e.args if a.free_symbols & per_element]
    if not varying:  # a symbol, a number, or per-row values only
        return 0
    own = len(varying) - (len(varying) == len(e.args)) if e.is_Add or e.is_Mul else 1
    return own + sum(_operations(a, per_element) for a in varying)
