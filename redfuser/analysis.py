"""What the lowering needs to know, decided before any IR is built (frozen data only).

``Geometry`` fixes the shapes of one call: flattened rows, stream length N, feature
length D, every input's own (broadcast) row axes, and which values carry the
feature axis.  Kernels are specialised per geometry (a small per-shape cache in
``kernel.Kernel``), which lets every loop bound be a constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import sympy as sp

from algebra.components import COUNT, Component, LinearComponent, SelectComponent
from algebra.layout import Layout
from algebra.rule import FusionRule


@dataclass(frozen=True)
class InputGeom:
    """One input viewed as (R_in, L, F); ``strides`` maps each kernel row axis to its stride."""

    rows: tuple[int, ...]  # the input's own row axes, left-padded with 1s to the kernel's rank
    length: int  # L: N for streams, 1 for parameters
    width: int  # F: D for feature vectors, 1 otherwise

    @property
    def count(self) -> int:
        return prod(self.rows)

    @property
    def strides(self) -> tuple[int, ...]:
        out, step = [], 1
        for size in reversed(self.rows):
            out.append(step if size > 1 else 0)
            step *= size
        return tuple(reversed(out))


@dataclass(frozen=True)
class Geometry:
    """Static shapes of one kernel instance."""

    rows: tuple[int, ...]
    n: int
    d: int
    inputs: dict[str, InputGeom]
    vec: frozenset[str]  # inputs, state variables and results that carry the feature axis

    @property
    def r(self) -> int:
        return prod(self.rows)

    def width(self, name: str) -> int:
        return self.d if name in self.vec else 1

    def key(self) -> tuple:
        return (self.rows, self.n, self.d, tuple(sorted(
            (k, v.rows, v.length, v.width) for k, v in self.inputs.items())))


def is_vec(expr: sp.Expr, vec: set[str]) -> bool:
    """Does ``expr`` carry the feature axis? A dot product collapses it."""
    if type(expr).__name__ == "Dot":
        return False
    if expr.is_Symbol:
        return expr.name in vec
    return any(is_vec(a, vec) for a in expr.args)


def component_exprs(comp: Component) -> list[sp.Expr]:
    """The per-element expressions a component evaluates."""
    if isinstance(comp, LinearComponent):
        return list(comp.basis)
    if isinstance(comp, SelectComponent):
        return [comp.core]
    return [comp.factor]


def geometry(rule: FusionRule, layout: Layout) -> Geometry:
    """Shapes and feature-axis flags of ``rule`` called on inputs resolved to ``layout``."""
    rank = len(layout.rows)
    inputs = {}
    for name, a in layout.arrays.items():
        own = a.shape[:-2]
        inputs[name] = InputGeom((1,) * (rank - len(own)) + tuple(own), a.shape[-2], a.shape[-1])
    vec = {k for k, g in inputs.items() if g.width > 1}
    for comp in rule.components:
        anchors_vec = any(a.name in vec for a in comp.anchors)
        if anchors_vec or any(is_vec(e, vec) for e in component_exprs(comp)):
            vec |= {s.symbol.name for s in comp.state}
        for name, expr in rule.running.items():
            if is_vec(expr, vec - {COUNT.name}):
                vec.add(name)
    return Geometry(tuple(layout.rows), layout.n, layout.d or 1, inputs, frozenset(vec))
