"""Fresh names: the engine's own names (the count, state columns, hidden results, the
symbols of its proofs) never equal a name of the spec.

The rule, its numpy run and its kernels look values up by name (state registers, inputs,
results share one namespace per row), so a state column called like a parameter would
silently read the wrong value.  Every invented name is therefore built from a readable
base and made fresh against every identifier of the spec text.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass

import sympy as sp

FRESH_MARK = "_"  # appended until a name is free: n -> n_ -> n__ (readable, and an identifier)


def fresh(base: str, taken: set[str]) -> str:
    """``base``, or ``base`` with marks appended, whichever is first not in ``taken``; the
    name returned is added to ``taken`` so that the next call invents another.

    Examples
    --------
    >>> taken = {"n", "x"}
    >>> fresh("n", taken), fresh("n", taken), fresh("d", taken)
    ('n_', 'n__', 'd')
    """
    name = base
    while name in taken:
        name += FRESH_MARK
    taken.add(name)
    return name


def spec_names(tree: ast.AST, reserved: Iterable[str]) -> set[str]:
    """Every identifier a spec can spell: the names it reads or assigns, plus ``reserved``.

    Examples
    --------
    >>> sorted(spec_names(ast.parse("m = max(x[i]); t = m + t_max"), ["N"]))
    ['N', 'i', 'm', 'max', 't', 't_max', 'x']
    """
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | set(reserved)


@dataclass(frozen=True)
class Names:
    """What a construction needs to name its state: the count, and the names already taken
    (the spec's and every name invented so far), which new names are made fresh against;
    and the inputs carrying the feature axis (a sum of those keeps no anchor factor in its
    state: ``separate.state_factor``)."""

    count: sp.Symbol
    taken: set[str]
    vector: frozenset[str] = frozenset()

    def symbol(self, base: str, **assumptions) -> sp.Symbol:
        return sp.Symbol(fresh(base, self.taken), **assumptions)
