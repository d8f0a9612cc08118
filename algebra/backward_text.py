"""Spec text of the cascades a backward reads and writes: how a symbol is spelled, and
the forward written with every reduction its own line (``algebra.backward``)."""

from __future__ import annotations

import sympy as sp

from .adjoint import results_in_order
from .backward_selections import Selection
from .cascade import Cascade
from .errors import NoBackward
from .laws import LAWS
from .printing import spec_text


def spelling(c: Cascade, per_element: set[str]):
    """How a symbol is spelled in a spec: a stream ``x[i]`` (``v[i, :]``), else its name."""
    def name(s: sp.Symbol) -> str:
        if s.name in c.vector_inputs and s.name in per_element:
            return f"{s.name}[i, :]"
        return f"{s.name}[i]" if s.name in per_element else s.name
    return name


def written(c: Cascade, selections: tuple[Selection, ...] = ()) -> str:
    """The cascade as spec text with every reduction its own named line (a hidden one,
    such as log_softmax's ``lse_sum``, becomes an output), and the index result each
    selection needs where the spec has none (``p_at = argmax(...)``).

    Examples
    --------
    >>> from algebra.spec import parse
    >>> print(written(parse("m = max(x[i])\\nlse = log(sum(exp(x[i] - m))) + m")))
    m = max(x[i])
    lse_sum = sum(exp(-m + x[i]))
    lse = m + log(lse_sum)
    """
    name, reductions = spelling(c, {s.name for s in c.streams}), {r.name: r for r in
                                                                   c.reductions}
    lines = []
    for result in results_in_order(c):
        if result in reductions:
            r = reductions[result]
            k = f", {r.k}" if r.k else ""
            lines.append(f"{result} = {r.op}({spec_text(r.body, name, NoBackward)}{k})")
        else:
            lines.append(f"{result} = {spec_text(c.epilogues[result], name, NoBackward)}")
    for s in selections:
        if s.adds_index:
            r, k = reductions[s.result], f", {s.k}" if s.k else ""
            lines.append(f"{s.index} = {LAWS[r.op].at}({spec_text(r.body, name, NoBackward)}{k})")
    lines += [f"{y}[i] = {spec_text(e, name, NoBackward)}" for y, e in c.elementwise.items()]
    return "\n".join(lines)
