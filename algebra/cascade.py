"""What a lifted spec is: the ``Cascade`` of reductions over one stream, its ``Reduction``s
and value ``Shape``s, and the names every stage shares (the stream index ``i``, the stream
length ``N``).  ``spec.py`` builds it from text; derivation, reference, layout and lowering
read it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

import sympy as sp

from .errors import SpecError
from .functions import Dot
from .laws import LAWS
from .names import fresh

INDEX, LENGTH = "i", "N"  # the stream index and the stream length
N = sp.Symbol(LENGTH, positive=True, integer=True)
POSITION = sp.Symbol(INDEX, nonnegative=True, integer=True)
COUNT_BASE = "n"  # the running count of elements: n, unless the spec itself uses that name


@dataclass(frozen=True)
class Shape:
    """Shape of a per-element or per-row value: vec True/False/None(unknown), or k values."""

    vec: bool | None = False
    k: int | None = None

    def join(self, other: Shape, node: ast.AST) -> Shape:
        if self.k and other.k and self.k != other.k:
            raise SpecError.at(node, f"shape mismatch: {self.k} values combined with "
                                     f"{other.k} values")
        if (self.k and other.vec) or (other.k and self.vec):
            raise SpecError.at(node, "shape mismatch: top-k values combined with a "
                                     "feature-axis vector")
        unknown = None in (self.vec, other.vec)
        vec = True if (self.vec or other.vec) else (None if unknown else False)
        return Shape(vec, self.k or other.k)


@dataclass(frozen=True)
class Reduction:
    """One reduction over the stream: ``name = op(body[, k])``; anchors are earlier results."""

    name: str
    op: str
    body: sp.Expr
    k: int | None
    anchors: tuple[sp.Symbol, ...]
    line: int
    col: int

    @property
    def symbol(self) -> sp.Symbol:
        return sp.Symbol(self.name, **result_assumptions(self.op, self.body))


@dataclass(frozen=True)
class Cascade:
    """A lifted spec: inputs, reductions in dependence order, epilogues and per-element outputs."""

    text: str
    streams: tuple[sp.Symbol, ...]
    params: tuple[sp.Symbol, ...]
    vector_inputs: frozenset[str]
    reductions: tuple[Reduction, ...]
    epilogues: dict[str, sp.Expr]  # result name -> expression over reduction results
    elementwise: dict[str, sp.Expr]  # per-element output -> expression over streams/results
    outputs: tuple[str, ...]  # spec order
    shapes: dict[str, Shape] = field(default_factory=dict)
    names: frozenset[str] = frozenset()  # every name the spec spells (and its hidden results)

    @property
    def count(self) -> sp.Symbol:
        """The running count of elements folded into a state (N at the end), named fresh
        against the spec's names."""
        return sp.Symbol(fresh(COUNT_BASE, set(self.names)), integer=True, nonnegative=True)

    def taken(self) -> set[str]:
        """The names no invented state column may take: the spec's and the count's."""
        return set(self.names) | {self.count.name}

    @property
    def results(self) -> dict[str, sp.Symbol]:
        """Every named per-row value (reductions and epilogues) as its sympy symbol."""
        syms = {r.name: r.symbol for r in self.reductions}
        for name, expr in self.epilogues.items():
            syms[name] = sp.Symbol(name, **epilogue_assumptions(expr))
        return syms


def result_assumptions(op: str, body: sp.Expr) -> dict:
    law = LAWS[op]
    if law.returns in ("index", "indices_k"):
        return {"integer": True, "nonnegative": True}
    if body.is_positive and law.family in ("linear", "multiplicative", "selecting"):
        return {"positive": True}
    return {"real": True}


def epilogue_assumptions(expr: sp.Expr) -> dict:
    return {"positive": True} if expr.is_positive else {"real": True}


def carries_feature_axis(expr: sp.Expr, vector: set[str] | frozenset[str]) -> bool:
    """Does ``expr`` read a feature-axis vector (outside a dot product, which collapses it)?"""
    if isinstance(expr, Dot):
        return False
    if expr.is_Symbol:
        return expr.name in vector
    return any(carries_feature_axis(a, vector) for a in expr.args)
