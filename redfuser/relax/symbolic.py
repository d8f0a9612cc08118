"""Relax functions with symbolic shapes (``torch.export.Dim``, ``tir.Var`` in struct info).

The lifter reads integer shapes, so a function with shape variables is lifted at *probe*
values: each variable bound to a prime that divides no static dimension of the function.
A size the lifter derives from the variables is then a product of their probes and static
factors, which ``unprobe`` reads back as an expression of the variables.  The block is
lifted at two sets of probes; a group is fused only where both give the same spec and the
same shapes read back (a size such as ``L + 1``, or a constant baked from a length, reads
back differently and refuses the group with the reason), and the splice proves that every
reshape keeps its element count for all values (``redfuser.tvm.ir.provably_equal``).  The
kernel is built once for every length (``Plan.dynamic``) and called with the function's
own shape variables, so the output struct info keeps them.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

from ..report import GroupReport
from ..tvm.graph import GenericConst, relax
from .frag import Unliftable
from .group import skipped_entries
from .rewrite import (
    check_kernel,
    derive_spec,
    dynamic_call_shapes,
    dynamic_kernel_for,
    splice_checked,
)

PROBE_FROM = 11  # primes from here: model sizes are mostly products of 2, 3, 5 and 7
RUNS = 2  # probe sets; a group must lift to the same spec and shapes at each


def symbolic_vars(func) -> list:
    """The shape variables a Relax function defines (sorted by name: a stable order)."""
    return sorted(relax.analysis.defined_symbolic_vars(func), key=lambda v: v.name)


def probe_sets(func, variables: list) -> list[dict]:
    """RUNS maps variable -> distinct prime, no prime dividing a static size of ``func``."""
    sizes = _static_sizes(func)
    primes, p = [], PROBE_FROM
    while len(primes) < RUNS * len(variables):
        if all(p % q for q in range(2, int(p ** 0.5) + 1)) and not any(s % p == 0
                                                                      for s in sizes):
            primes.append(p)
        p += 1
    k = len(variables)
    return [dict(zip(variables, primes[r * k:(r + 1) * k], strict=True)) for r in range(RUNS)]


def unprobe(value: int, probes: dict):
    """A size lifted at ``probes`` as an expression of the variables (an int if static).

    Examples
    --------
    >>> from redfuser.tvm.ir import shape_var
    >>> n = shape_var("n")
    >>> str(unprobe(13 * 13 * 64, {n: 13})), unprobe(64, {n: 13})
    ('n * n * T.int64(64)', 64)
    """
    factors, rest = [], int(value)
    for var, p in probes.items():
        while rest and rest % p == 0:
            rest //= p
            factors.append(var)
    if not factors:
        return rest
    expr = functools.reduce(operator.mul, factors)
    return expr if rest == 1 else expr * rest


def fuse_symbolic(mod, gv, func, index: int, fname: str, driver: tuple,
                  check_build: bool = True, target: str = "cpu") -> tuple:
    """Fuse the groups of dataflow block ``index`` of ``func`` (which has shape
    variables): (module, report entries).  ``driver``: its (plan_block, fresh name);
    ``check_build`` compiles each kernel alone first, as the driver's option says;
    ``target``: the backend that builds the kernels."""
    plan_block, fresh = driver
    probes = probe_sets(func, symbolic_vars(func))
    runs = []
    for probe in probes:
        spec = func.bind_symbolic_vars(probe)
        runs.append((probe, _var_map(spec, func), *plan_block(spec, spec.body.blocks[index])))
    (probe, names, lifter, groups), entries = runs[0], []
    entries += skipped_entries(fname, lifter, groups)
    others = [r[3] for r in runs[1:]]
    for k, group in enumerate(groups):
        twins = [g[k] if k < len(g) else None for g in others]
        mod, entry = _apply(mod, gv, index, fname, (group, probe, names), twins, runs,
                            (fresh, check_build, target))
        entries.append(entry)
    return mod, entries


def _apply(mod, gv, index: int, fname: str, lifted: tuple, twins: list, runs, how: tuple):
    (group, probe, names), (fresh, check_build, target) = lifted, how
    entry = dict(function=fname, values=group.values, ops=group.ops, spec=group.spec)
    rule, reason = derive_spec(group.spec)
    if rule is None:
        return mod, GroupReport(fused=False, reason=reason, **entry)
    name = fresh(mod, f"redfuser_{fname}")

    def make():
        kernel = _kernel(group, rule, name, probe, names, target)
        for twin, other in zip(twins, runs[1:], strict=True):
            _same_at_other_probes(kernel, group, twin, rule, other[0])
        if check_build:
            check_kernel(kernel)
        return kernel, _original(group, probe, names)

    return splice_checked(mod, gv, index, name, entry, make)


def _kernel(group, rule, name: str, probe: dict, names: dict, target: str):
    """The dynamic kernel for backend ``target``, its inputs read from the original
    function's values."""
    kernel = dynamic_kernel_for(group, rule, name, lambda v: unprobe(v, probe), target)
    inputs = tuple((nm, dataclasses.replace(inp, source=_source(inp.source, names)), shape)
                   for nm, inp, shape in kernel.inputs)
    return dataclasses.replace(kernel, inputs=inputs)


def _same_at_other_probes(kernel, group, twin, rule, probe: dict):
    """The group lifted at other probe values gives the same spec and shapes, or the group
    depends on the value of a length and is refused."""
    if twin is None or twin.spec != group.spec:
        raise Unliftable("the spec depends on the value of a symbolic dimension (lifted at "
                         "two sets of probe values, it differs)")
    inputs, outputs = dynamic_call_shapes(twin, rule, lambda v: unprobe(v, probe))
    ours = [s for _, _, s in kernel.inputs] + [s for _, s, _ in kernel.outputs]
    theirs = [s for _, _, s in inputs] + [s for _, s, _ in outputs]
    bad = [(str(a), str(b)) for a, b in zip(ours, theirs, strict=True) if str(a) != str(b)]
    if bad:
        raise Unliftable(f"a size is not a product of shape variables and constants "
                         f"({bad[0][0]} at one set of probe values, {bad[0][1]} at another)")


def _original(group, probe: dict, names: dict):
    """The group with its sinks (and their tuple fields' shapes) in the original function."""
    sinks = []
    for var, node in group.sinks:
        fields = tuple(dataclasses.replace(f, shape=tuple(unprobe(v, probe) for v in f.shape))
                       for f in node.fields)
        sinks.append((_var(var, names), dataclasses.replace(node, fields=fields)))
    outputs = {_var(v, names): outs for v, outs in group.outputs.items()}
    casts = {_var(v, names): _var(c, names) for v, c in group.casts.items()}
    return dataclasses.replace(group, sinks=sinks, outputs=outputs, casts=casts)


def _var_map(spec, orig) -> dict:
    """Each variable of the probe-bound copy -> the original's (same structure, in order)."""
    out = dict(zip(spec.params, orig.params, strict=True))
    for bs, bo in zip(spec.body.blocks, orig.body.blocks, strict=True):
        out.update((x.var, y.var) for x, y in zip(bs.bindings, bo.bindings, strict=True))
    return out


def _var(var, names: dict):
    if var not in names:
        raise Unliftable(f"{var.name} has no counterpart in the original function")
    return names[var]


def _source(expr, names: dict):
    """An input's Relax value in the original function (a variable, or a constant, whose
    shape is static)."""
    if isinstance(expr, relax.Var):
        return _var(expr, names)
    if isinstance(expr, GenericConst):
        return expr
    raise Unliftable(f"input {type(expr).__name__} cannot be read in the original function")


def _static_sizes(func) -> set[int]:
    sizes = set()

    def visit(ty):
        if isinstance(ty, relax.TensorType) and ty.shape is not None:
            sizes.update(int(v.value) for v in ty.shape.values if hasattr(v, "value"))
        for field in getattr(ty, "fields", ()):
            visit(field)

    for p in func.params:
        visit(p.ty)
    for block in func.body.blocks:
        for b in block.bindings:
            visit(b.var.ty)
    return {s for s in sizes if s > 1}
