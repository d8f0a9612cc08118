"""A kernel's calling signature: every argument's name, shape and dtype, in argument order.

Inputs come first, sorted by name, each viewed as (R_in, L, F) (``Geometry.inputs``);
then the outputs in spec order: per-row results (R, width) and per-element outputs
(R, N, width).  A result's width is k for a top-k, D on the feature axis, else 1; an
arg-reduction's result is int64.  Per-element outputs and feature-vector results
(``stored_results``: attention's ``o``) are stored as ``geo.out_dtype``; per-row statistics
are stored in the compute dtype (``geo.compute``: float32, or float64).  Every consumer
(the PrimFunc builder, ``Kernel``'s output allocation, the TensorIR and Relax rewrites)
reads the widths and dtypes from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from algebra.cascade import carries_feature_axis
from algebra.laws import LAWS
from algebra.layout import vector_results
from algebra.rule import FusionRule
from algebra.state import StateKind

from .geometry import Geometry

F32, I32, I64 = "float32", "int32", "int64"


@dataclass(frozen=True)
class Arg:
    """One kernel argument."""

    name: str
    shape: tuple[int, ...]
    dtype: str = F32
    elementwise: bool = False  # a per-element output (R, N, width)

    @property
    def width(self) -> int:
        return self.shape[-1]


@dataclass(frozen=True)
class Signature:
    """The kernel's arguments: ``inputs`` then ``outputs``; ``internal``: the per-row
    results no caller reads, kept in the kernel's own scratch (the per-element outputs and
    the kept results read them)."""

    inputs: tuple[Arg, ...]
    outputs: tuple[Arg, ...]
    internal: tuple[Arg, ...] = ()

    @property
    def results(self) -> tuple[Arg, ...]:
        return tuple(a for a in self.outputs if not a.elementwise)

    @property
    def elementwise(self) -> tuple[Arg, ...]:
        return tuple(a for a in self.outputs if a.elementwise)


def signature(rule: FusionRule, geo: Geometry, keep: frozenset | None = None) -> Signature:
    """The arguments of ``rule``'s kernel at ``geo``; with ``keep``, only the per-row results
    named in it are outputs (a Relax call that reads the softmax alone), the others become
    ``internal``.  Per-element outputs are always outputs.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("moe_routing")
    >>> geo = shape_geometry(rule, {"x": (4, 256)})
    >>> [(a.name, a.shape, a.dtype) for a in signature(rule, geo).outputs][2:]
    [('p', (4, 8), 'float32'), ('e', (4, 8), 'int64')]
    >>> [a.name for a in signature(rule, geo, keep=frozenset({"e"})).internal]
    ['m', 'd', 'p']
    >>> import dataclasses
    >>> rule = redfuser.derive("attention")
    >>> geo = shape_geometry(rule, {"q": (8, 64), "k": (8, 256, 64), "v": (8, 256, 64)})
    >>> geo = dataclasses.replace(geo, out_dtype="bfloat16")
    >>> [(a.name, a.dtype) for a in signature(rule, geo).outputs]
    [('m', 'float32'), ('d', 'float32'), ('o', 'bfloat16')]
    """
    inputs = tuple(Arg(name, (g.count, g.length, g.width), g.dtype) for name, g in
                   sorted(geo.inputs.items()))
    outputs, internal = [], []
    for name in rule.outputs:
        if name in rule.cascade.elementwise:
            wide = carries_feature_axis(rule.cascade.elementwise[name], set(geo.vec))
            width = geo.d if wide else 1
            outputs.append(Arg(name, (geo.r, geo.n, width), geo.out_dtype, elementwise=True))
        else:
            width = result_width(rule, geo, name)
            if keep is None or name in keep:
                outputs.append(Arg(name, (geo.r, width), output_dtype(rule, geo, name)))
            else:  # no caller reads it: kept as the kernel computes it
                internal.append(Arg(name, (geo.r, width), result_dtype(rule, name, geo.compute)))
    return Signature(inputs, tuple(outputs), tuple(internal))


def param_shape(arg: Arg, geo: Geometry, inputs: bool) -> tuple:
    """The shape a dynamic kernel declares for ``arg`` (an input when ``inputs``): the row
    axes kept apart, (*own rows, L, F) for inputs and (*rows, ...) for outputs, so that TVM
    binds every row variable and N from the arguments' shapes; its body reads the flattened
    shape of ``signature`` through an alias of the same memory.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("attention")
    >>> geo = shape_geometry(rule, {"q": (8, 4, 64), "k": (8, 1, 256, 64), "v": (8, 1, 256, 64)})
    >>> sig = signature(rule, geo)
    >>> param_shape(sig.inputs[0], geo, True), param_shape(sig.outputs[-1], geo, False)
    ((8, 1, 256, 64), (8, 4, 64))
    """
    if inputs:
        g = geo.inputs[arg.name]
        return (*g.rows, g.length, g.width)
    return (*geo.rows, *arg.shape[1:])


def call_shape(rule: FusionRule, geo: Geometry, arg: Arg, is_input: bool) -> tuple:
    """The shape a ``Kernel`` call passes for ``arg``: the caller's own (``algebra.layout``'s
    convention), so that a call hands its arrays over and returns the kernel's as they are,
    with no reshape (0.15 us each; 2 us for a torch tensor) and with the row axes apart, from
    which a dynamic kernel binds its shape variables.  Inputs (*rows[, N][, D]): N for a
    stream, D for a feature vector; outputs (*rows[, D | k]) and (*rows, N[, D]).  (A
    feature axis of size 1 is left out: the call reshapes that rare case.)

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("attention")
    >>> geo = shape_geometry(rule, {"q": (8, 4, 64), "k": (8, 1, 256, 64), "v": (8, 1, 256, 64),
    ...                             "scale": ()})
    >>> sig = signature(rule, geo)
    >>> [call_shape(rule, geo, a, True) for a in sig.inputs][:2], call_shape(rule, geo,
    ...                                                                 sig.outputs[-1], False)
    ([(8, 1, 256, 64), (8, 4, 64)], (8, 4, 64))
    """
    feature = lambda vec: (geo.d,) if vec else ()  # noqa: E731
    if is_input:
        g = geo.inputs[arg.name]
        streamed = any(s.name == arg.name for s in rule.cascade.streams)
        return (*g.rows, *((g.length,) if streamed else ()), *feature(g.width > 1))
    return output_shape(rule, arg.name, geo.rows, geo.n, feature(arg.width > 1))


def output_shape(rule: FusionRule, name: str, rows: tuple, n, feature: tuple) -> tuple:
    """The shape of output ``name`` with row axes ``rows``, stream length ``n`` and feature
    axis ``feature`` (``(D,)`` or ``()``): (*rows, N, *feature) for a per-element output,
    (*rows, k) for a top-k, else (*rows, *feature).  The one place an output's shape is
    worked out (``call_shape``'s kernel view, the user's shape of ``redfuser.call``).

    Examples
    --------
    >>> import redfuser
    >>> rule = redfuser.derive("moe_routing")
    >>> output_shape(rule, "e", (2, 3), 256, ()), output_shape(rule, "m", (2, 3), 256, ())
    ((2, 3, 8), (2, 3))
    """
    if name in rule.cascade.elementwise:
        return (*rows, n, *feature)
    shape = rule.cascade.shapes.get(name)
    if shape is not None and shape.k:
        return (*rows, shape.k)
    return (*rows, *feature)


def call_shapes(rule: FusionRule, geo: Geometry, keep: frozenset | None = None) -> list[tuple]:
    """Every argument's ``call_shape``, in argument order (``signature`` with ``keep``)."""
    sig = signature(rule, geo, keep)
    return [call_shape(rule, geo, a, True) for a in sig.inputs] + \
        [call_shape(rule, geo, a, False) for a in sig.outputs]


def result_width(rule: FusionRule, geo: Geometry, name: str) -> int:
    """Slots of a per-row result: k for a top-k, D on the feature axis, else 1."""
    shape = rule.cascade.shapes.get(name)
    return shape.k if shape is not None and shape.k else geo.width(name)


def result_dtype(rule: FusionRule, name: str, compute: str = F32) -> str:
    """The dtype the kernel computes and keeps a per-row result in (its own scratch, the
    per-row buffers of the unfused and staged passes): int64 for the result of an
    arg-reduction (argmax, argtopk, ...), else the kernel's ``compute`` dtype."""
    red = next((r for r in rule.cascade.reductions if r.name == name), None)
    return I64 if red is not None and StateKind(LAWS[red.op].returns).is_index else compute


def output_dtype(rule: FusionRule, geo: Geometry, name: str) -> str:
    """The dtype output ``name``, a per-row result, is stored in: ``geo.out_dtype`` for a
    feature-vector result (``stored_results``), as per-element outputs are; else
    ``result_dtype`` (statistics in the compute dtype, indices int64).

    Examples
    --------
    >>> import dataclasses, redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("rmsnorm_gemm")
    >>> geo = shape_geometry(rule, {"x": (4, 256), "w": (256, 32)})
    >>> geo = dataclasses.replace(geo, out_dtype="float16")
    >>> output_dtype(rule, geo, "y"), output_dtype(rule, geo, "r")
    ('float16', 'float32')
    """
    if name in stored_results(rule):
        return geo.out_dtype
    return result_dtype(rule, name, geo.compute)


def stored_results(rule: FusionRule) -> frozenset[str]:
    """The per-row results stored as the per-element outputs are (``geo.out_dtype``): those
    that carry the feature axis (attention's ``o``, a GEMM cascade's ``y``; by the spec,
    whatever D is) and that no other statement of the cascade reads.  What a reduction,
    an epilogue or a per-element output is computed from is a statistic of the cascade (a
    later stage or pass reads it), and stays in the compute dtype, as ``m``, ``d`` and
    ``lse`` do; a top-k's values (width k) are no feature vector.

    Examples
    --------
    >>> import redfuser
    >>> sorted(stored_results(redfuser.derive("attention")))
    ['o']
    >>> sorted(stored_results(redfuser.derive("mu = sum(x[i, :]) / N\\n"
    ...                                       "var = sum((x[i, :] - mu)**2) / N")))
    ['var']
    """
    c = rule.cascade
    vector = vector_results(c, c.vector_inputs) - set(c.vector_inputs) - set(c.elementwise)
    read = {s.name for r in c.reductions for s in r.body.free_symbols}
    read |= {s.name for n, e in c.epilogues.items() for s in e.free_symbols if s.name != n}
    read |= {s.name for e in c.elementwise.values() for s in e.free_symbols}
    return frozenset(vector - read)


def rule_k(rule: FusionRule, name: str) -> int:
    """k of the top-k component that holds state ``name``."""
    return next(c.k for c in rule.components for s in c.state if s.symbol.name == name)
