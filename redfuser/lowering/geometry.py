"""What the lowering needs to know, decided before any IR is built (frozen data only).

``Geometry`` fixes the shapes of one call: flattened rows, stream length N, feature
length D, every input's own (broadcast) row axes, and which values carry the
feature axis.  Kernels are specialised per geometry (a small per-shape cache in
``kernel.Kernel``), which lets every loop bound be a constant.  ``geometry`` reads it off
inputs resolved by ``algebra.layout``; ``shape_geometry`` builds it from shapes alone (the
schedule search, the CLI).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np
import sympy as sp

from algebra.components import Component, LinearComponent, SelectComponent
from algebra.functions import Dot
from algebra.layout import Layout, resolve
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
    if isinstance(expr, Dot):
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
            if is_vec(expr, vec - {rule.count.name}):
                vec.add(name)
    return Geometry(tuple(layout.rows), layout.n, layout.d or 1, inputs, frozenset(vec))


def shape_geometry(rule, shapes: dict[str, tuple] | None = None, rows: tuple | None = None,
                   n: int | None = None, d: int | None = None) -> Geometry:
    """The geometry of inputs of the given shapes, without data.  Inputs not in ``shapes``
    take their kind's shape: streams (*rows, n) or (*rows, n, d), parameters scalars or
    (*rows, d) when they carry the feature axis; rows, n and d default to those of the
    first given stream (else (1,), 64 and 16).

    Examples
    --------
    >>> import redfuser
    >>> geo = shape_geometry(redfuser.derive("attention"),
    ...                      {"q": (8, 4, 64), "k": (8, 1, 256, 64), "v": (8, 1, 256, 64)})
    >>> geo.rows, geo.n, geo.d
    ((8, 4), 256, 64)
    >>> shape_geometry(redfuser.derive("rmsnorm"), {"x": (8, 256)}).inputs["g"].length
    256
    """
    c, shapes = rule.cascade, dict(shapes or {})
    streams = {s.name for s in c.streams}
    unknown = sorted(set(shapes) - streams - {p.name for p in c.params})
    if unknown:
        raise ValueError(f"unknown input(s) {unknown}: the spec reads "
                         f"{sorted(streams | {p.name for p in c.params})}")
    rows, n, d = _defaults(c, shapes, rows, n, d)
    arrays = {}
    for name in sorted(streams | {p.name for p in c.params}):
        vec = name in c.vector_inputs
        shape = shapes.get(name)
        if shape is None:
            shape = ((*rows, n) if name in streams else (*rows,) if vec else ()) + \
                ((d,) if vec else ())
        shape = tuple(int(s) for s in shape)
        arrays[name] = np.broadcast_to(np.float32(0.5), shape) if shape else 0.5
    return geometry(rule, resolve(c, arrays, dtype=np.float32))


def _defaults(c, shapes: dict, rows, n, d) -> tuple[tuple, int, int]:
    """rows, n, d from the first given stream where the caller did not say (None; rows also
    when empty), else (1,), 64 and 16.  A size the caller gave is checked, never replaced:
    n = 0 is a size, not "not given"."""
    for s in sorted(x.name for x in c.streams):
        shape = tuple(shapes.get(s, ()))
        if len(shape) >= 2 and s in c.vector_inputs:
            rows, n, d = rows or shape[:-2], _given(n, shape[-2]), _given(d, shape[-1])
        elif shape:
            rows, n = rows or shape[:-1], _given(n, shape[-1])
        if shape:
            break
    rows, n, d = tuple(rows or (1,)), _given(n, 64), _given(d, 16)
    for what, size in [*(("row axis", r) for r in rows), ("n", n), ("d", d)]:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"{what} must be a positive integer, not {size!r}")
    return tuple(int(r) for r in rows), int(n), int(d)


def _given(value, default):
    return default if value is None else value
