"""The laws of each reduction, as data (in the spirit of Halide's AssociativeOpsTable).

Every reduction the spec language knows is one ``Law`` entry: its identity, the
binary merge of two partial results, and the *family* that says which rewrite
lets a body depending on earlier results commute with it:

- ``linear`` (sum): sum(c * f) = c * sum(f) for c free of the stream, and
  sum(A @ phi) = A @ sum(phi) for a matrix A free of the stream: finite-rank
  re-anchoring.
- ``multiplicative`` (prod): prod(c * f) = c**N * prod(f); the engine keeps it as
  prod(sign) * exp(sum(log|c f|)), a sum, so that no partial product leaves the range.
- ``selecting`` (max, min, argmax, argmin, topk, argtopk): the result is one of
  the inputs, so for F non-decreasing in u, max_i F(g_i) = F(max_i g_i)
  (strictly increasing when an index is returned, so that ties stay ties);
  a decreasing F swaps the direction.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .functions import Maximum, Minimum


@dataclass(frozen=True)
class Law:
    """One reduction operator: identity, merge, algebraic family, what it returns."""

    name: str
    identity: sp.Expr
    family: str  # "linear" | "multiplicative" | "selecting"
    direction: int = 0  # selecting only: +1 keeps the largest, -1 the smallest
    returns: str = "value"  # "value" | "index" | "values_k" | "indices_k"
    at: str = ""  # a value law that selects: the law returning where (its subgradient's way)

    @property
    def takes_k(self) -> bool:
        return self.returns.endswith("_k")

    def merge(self, a: sp.Expr, b: sp.Expr) -> sp.Expr:
        """Combine two partial values of a value-returning, scalar reduction."""
        if self.family == "linear":
            return a + b
        if self.family == "multiplicative":
            return a * b
        return Maximum(a, b) if self.direction > 0 else Minimum(a, b)


oo = sp.oo
LAWS: dict[str, Law] = {
    "sum": Law("sum", sp.S.Zero, "linear"),  # 0, a + b; sum(c*f) = c*sum(f)
    "prod": Law("prod", sp.S.One, "multiplicative"),  # 1, a * b; prod(c*f) = c**N*prod(f)
    "max": Law("max", -oo, "selecting", +1, at="argmax"),  # -inf, max(a, b); max(F(g)) = F(max g)
    "min": Law("min", oo, "selecting", -1, at="argmin"),  # +inf, min(a, b); min(F(g)) = F(min g)
    "argmax": Law("argmax", -oo, "selecting", +1, "index"),  # first index of the max
    "argmin": Law("argmin", oo, "selecting", -1, "index"),  # first index of the min
    "topk": Law("topk", -oo, "selecting", +1, "values_k", at="argtopk"),  # k largest, descending
    "argtopk": Law("argtopk", -oo, "selecting", +1, "indices_k"),  # their indices
}
