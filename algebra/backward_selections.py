"""Selections in a backward cascade (``algebra.backward``): the subgradient of max, min and
top-k.

A selecting reduction ``R = max(b)`` (``topk(b, k)``) is one of its body's values, at the
element(s) its index law (``argmax``, ``argtopk``: ``Law.at``) returns.  Wherever that
choice is fixed, which is everywhere but on ties, ``R = sum(sel[i] * b)`` with ``sel`` a
constant per element, so its gradient is the sum's: ``sel`` is one at the selected element
(a max whose adjoint is not 0: the outputs depend on it, greedy decoding's probability),
or, for a k-result contracted with its upstream ``dp`` (``dot(dp, p)``, as a vector result
is), ``dp[k]`` at the k-th selected element and 0 elsewhere.  That is torch's convention
for ``max(dim)`` and ``topk``: the gradient goes to the element whose index the forward
returns, and on ties to that one only (ours is the lowest index).  The backward reads
``sel`` as a per-element input that the caller scatters from the saved index (the forward
saves it: an index result of the spec over the same body, or one added to it); a
contracted k-result's value ``dot(dp, p)`` is a per-row number from the saved output.

The proof (``algebra.backward_proof``) unrolls each selection at every fixed choice: an
injective map of ``min(k, PROOF_SELECTED, N)`` slots onto the N symbolic elements.

Examples
--------
>>> from algebra.spec import parse
>>> c = parse("m = max(x[i])\\nd = sum(exp(x[i] - m))\\np = topk(exp(x[i] - m) / d, 8)")
>>> s = contracted_selections(c, ("p",), {"p": sp.Symbol("dp", real=True)}, set())[0]
>>> print(s)
sel_p[i] = dp[k] at the element p_at[k] selected, else 0
>>> rewritten(c, (s,)).reductions[-1].body
sel_p*exp(-m + x)/d
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import sympy as sp

from .cascade import Cascade, Reduction
from .laws import LAWS
from .names import fresh

PROOF_SELECTED = 2  # selected slots a proof case fixes: a slot's own term and another's


@dataclass(frozen=True)
class Selection:
    """One selecting reduction differentiated as ``sum(selector[i] * body)``."""

    result: str  # the selecting reduction
    selector: str  # the backward's per-element input
    index: str  # the forward result saying where it selected (saved)
    adds_index: bool  # the forward gains that result (its spec has none over this body)
    k: int | None  # the top-k's k; None for a max/min
    upstream: str = ""  # a contracted k-result's upstream (dp[k] routed to index[k])
    delta: str = ""  # the per-row symbol of dot(upstream, result)

    def __str__(self) -> str:
        if self.upstream:
            return (f"{self.selector}[i] = {self.upstream}[k] at the element {self.index}[k] "
                    "selected, else 0")
        return f"{self.selector}[i] = 1 at the element {self.index} selected, else 0"

    def cases(self, n: int, symbol) -> list[tuple[sp.Expr, ...]]:
        """The selector's values at ``n`` elements, one tuple per fixed choice; ``symbol(k)``
        is the k-th component of the upstream."""
        slots = min(self.k or 1, PROOF_SELECTED, n)
        out = []
        for chosen in itertools.permutations(range(n), slots):
            values = [sp.S.Zero] * n
            for slot, j in enumerate(chosen):
                values[j] = symbol(slot) if self.upstream else sp.S.One
            out.append(tuple(values))
        return out


def selection(c: Cascade, red: Reduction, taken: set[str], upstream: str = "") -> Selection:
    """``red`` as a selection, its index found among the forward's results or named anew."""
    at = LAWS[red.op].at
    same = [r.name for r in c.reductions
            if r.op == at and r.k == red.k and sp.simplify(r.body - red.body) == 0]
    index = same[0] if same else _name(f"{red.name}_at", taken)
    selector = _name(f"sel_{red.name}", taken)
    delta = _name(f"delta_{red.name}", taken) if upstream else ""
    return Selection(red.name, selector, index, not same, red.k, upstream, delta)


def _name(base: str, taken: set[str]) -> str:
    out = fresh(base, taken)
    taken.add(out)
    return out


def contracted_selections(c: Cascade, outputs, up: dict[str, sp.Symbol],
                          taken: set[str]) -> list[Selection]:
    """A selection for each differentiated k-result (contracted with its upstream)."""
    reductions = {r.name: r for r in c.reductions}
    return [selection(c, reductions[o], taken, up[o].name) for o in outputs
            if o in reductions and LAWS[reductions[o].op].takes_k]


def rewritten(c: Cascade, selections) -> Cascade:
    """``c`` with each selection's reduction written ``sum(selector * body)``."""
    by_result = {s.result: s for s in selections}

    def sum_of(r: Reduction) -> Reduction:
        s = by_result[r.name]
        return dataclasses.replace(r, op="sum", k=None,
                                   body=sp.Symbol(s.selector, real=True) * r.body)

    return dataclasses.replace(c, reductions=tuple(sum_of(r) if r.name in by_result else r
                                                   for r in c.reductions))
