"""What the lowering needs to know, decided before any IR is built (frozen data only).

``Geometry`` fixes the shapes of one call: flattened rows, stream length N, feature
length D, every input's own (broadcast) row axes, and which values carry the
feature axis.  Kernels are specialised per geometry (a small per-shape cache in
``kernel.Kernel``), which lets every loop bound be a constant.  ``geometry`` reads it off
inputs resolved by ``algebra.layout``; ``shape_geometry`` builds it from shapes alone (the
schedule search, the CLI).

A *symbolic* geometry (``symbolic_geometry``) has the same fields with the row axes and N
replaced by TIR shape variables: one kernel built on it serves every row count and stream
length of one ``dynamic_key`` (rank, D, which input axes broadcast, the feature-axis flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from algebra.cascade import carries_feature_axis
from algebra.dtypes import COMPUTE, array_dtype, compute_of, widest
from algebra.families import element_exprs
from algebra.layout import Layout, resolve
from algebra.rule import FusionRule


@dataclass(frozen=True)
class InputGeom:
    """One input viewed as (R_in, L, F); ``strides`` maps each kernel row axis to its stride."""

    rows: tuple[int, ...]  # the input's own row axes, left-padded with 1s to the kernel's rank
    length: int  # L: N for streams, 1 for parameters
    width: int  # F: D for feature vectors, 1 otherwise
    dtype: str = COMPUTE.name  # its dtype (``algebra.dtypes``): loads convert it to the compute one

    @property
    def count(self) -> int:
        return prod(self.rows)

    @property
    def strides(self) -> tuple[int, ...]:
        out, step = [], 1
        for size in reversed(self.rows):
            out.append(0 if is_one(size) else step)
            step *= size
        return tuple(reversed(out))


def is_one(size) -> bool:
    """A row axis of size 1 (a broadcast one); a shape variable is never known to be 1."""
    return isinstance(size, int) and size == 1


def is_streamed(length) -> bool:
    """Does an input of this length vary along the stream (N > 1, or a symbolic N)?"""
    return not isinstance(length, int) or length > 1


def same_rows(a: tuple, b: tuple) -> bool:
    """Equal row axes: equal sizes, or the same shape variable."""
    return len(a) == len(b) and all(x == y if isinstance(x, int) and isinstance(y, int)
                                    else x is y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class Geometry:
    """Static shapes of one kernel instance."""

    rows: tuple[int, ...]
    n: int
    d: int
    inputs: dict[str, InputGeom]
    vec: frozenset[str]  # inputs, state variables and results that carry the feature axis
    # the storage dtype of per-element outputs and feature-vector results (statistics: compute)
    out_dtype: str = COMPUTE.name
    # what the kernel computes in, and stores its per-row statistics in (``algebra.dtypes``)
    compute: str = COMPUTE.name

    @property
    def r(self) -> int:
        return prod(self.rows)

    def width(self, name: str) -> int:
        return self.d if name in self.vec else 1

    def key(self) -> tuple:
        """What a kernel built for this geometry depends on (caches never mix dtypes)."""
        return (*self.shape_key(), self.compute)

    def shape_key(self) -> tuple:
        """``key`` without the compute dtype: the shapes and storage dtypes (a tuning record
        holds the compute dtype in a field of its own, ``tune.db.entry_key``)."""
        return (self.rows, self.n, self.d, self.out_dtype, tuple(sorted(
            (k, v.rows, v.length, v.width, v.dtype) for k, v in self.inputs.items())))

    @property
    def static(self) -> bool:
        """Are every row axis and N integers (False for a ``symbolic_geometry``)?"""
        return isinstance(self.n, int) and all(isinstance(r, int) for r in self.rows)


def broadcast_axes(geo: Geometry, name: str) -> tuple[bool, ...]:
    """Per kernel row axis: does input ``name`` broadcast along it (size 1 where the kernel's
    axis is not)?  An axis of size 1 everywhere counts as not broadcast."""
    g = geo.inputs[name]
    return tuple(is_one(own) and not is_one(size) for own, size in zip(g.rows, geo.rows,
                                                                       strict=True))


def dynamic_key(rule: FusionRule, geo: Geometry) -> tuple:
    """What a kernel built on ``symbolic_geometry`` depends on: the rank of the rows, D, the
    feature-axis flags and, per input, its broadcast axes and kind (stream or parameter)."""
    streams = {s.name for s in rule.cascade.streams}
    return (len(geo.rows), geo.d, geo.vec, geo.out_dtype, geo.compute, tuple(sorted(
        (k, broadcast_axes(geo, k), k in streams, v.width, v.dtype)
        for k, v in geo.inputs.items())))


def fits(key: tuple, rule: FusionRule, geo: Geometry) -> bool:
    """Can a kernel built for ``dynamic_key`` ``key`` run a call of ``geo``?  Where the key
    broadcasts an input the call's axis must be 1 there; elsewhere the input must span the
    kernel's axis.  (A decode call with one query, L = 1, fits the kernel built for L > 1
    whose K/V broadcast over the queries.)

    Examples
    --------
    >>> import redfuser
    >>> rule = redfuser.derive("attention")
    >>> def geo(l):
    ...     return shape_geometry(rule, {"q": (2, l, 8), "k": (2, 1, 9, 8), "v": (2, 1, 9, 8)})
    >>> fits(dynamic_key(rule, geo(4)), rule, geo(1)), fits(dynamic_key(rule, geo(1)), rule, geo(4))
    (True, False)
    """
    rank, d, vec, out_dtype, compute, inputs = key
    if (rank, d, vec, out_dtype, compute) != (len(geo.rows), geo.d, geo.vec, geo.out_dtype,
                                              geo.compute):
        return False
    streams = {s.name for s in rule.cascade.streams}
    for name, bcast, stream, width, dtype in inputs:
        g = geo.inputs.get(name)
        if g is None or (stream, width, dtype) != (name in streams, g.width, g.dtype):
            return False
        if any(own != (1 if b else size) for own, b, size in zip(g.rows, bcast, geo.rows,
                                                                 strict=True)):
            return False
    return len(inputs) == len(geo.inputs)


def symbolic_geometry(rule: FusionRule, geo: Geometry, rows: tuple, n) -> Geometry:
    """``geo`` with its row axes replaced by ``rows`` and N by ``n`` (TIR shape variables):
    each input keeps size 1 on its broadcast axes and reads the kernel's variable on the
    others; streams are ``n`` long, parameters 1 (by kind, not by size: at N = 1 a stream
    and a parameter have the same shape)."""
    if len(rows) != len(geo.rows):
        raise ValueError(f"{len(rows)} row variables for {len(geo.rows)} row axes")
    streams = {s.name for s in rule.cascade.streams}
    inputs = {k: InputGeom(tuple(1 if b else v for b, v in zip(broadcast_axes(geo, k), rows,
                                                              strict=True)),
                           n if k in streams else 1, g.width, g.dtype)
              for k, g in geo.inputs.items()}
    return Geometry(tuple(rows), n, geo.d, inputs, geo.vec, geo.out_dtype, geo.compute)


def geometry(rule: FusionRule, layout: Layout, out_dtype: str | None = None,
             compute: str | None = None) -> Geometry:
    """Shapes, storage dtypes and feature-axis flags of ``rule`` called on inputs resolved to
    ``layout``; per-element outputs are stored as ``out_dtype``, by default as the streams
    are (torch's convention: bfloat16 in, bfloat16 out; ``algebra.dtypes.widest``); the
    kernel computes in ``compute``, by default float64 where an input is float64, else
    float32 (``algebra.dtypes.compute_of``)."""
    rank = len(layout.rows)
    inputs = {}
    for name, a in layout.arrays.items():
        own = a.shape[:-2]
        inputs[name] = InputGeom((1,) * (rank - len(own)) + tuple(own), a.shape[-2],
                                 a.shape[-1], a.dtype.name)
    if out_dtype is None:
        out_dtype = widest(array_dtype(inputs[s.name].dtype)
                           for s in rule.cascade.streams).name
    if compute is None:
        compute = compute_of(array_dtype(g.dtype) for g in inputs.values()).name
    vec = {k for k, g in inputs.items() if g.width > 1}
    for comp in rule.components:
        anchors_vec = any(a.name in vec for a in comp.anchors)
        if anchors_vec or any(carries_feature_axis(e, vec) for e in element_exprs(comp)):
            vec |= {s.symbol.name for s in comp.state}
        for name, expr in rule.running.items():
            if carries_feature_axis(expr, vec - {rule.count.name}):
                vec.add(name)
    return Geometry(tuple(layout.rows), layout.n, layout.d or 1, inputs, frozenset(vec),
                    out_dtype, compute)


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
