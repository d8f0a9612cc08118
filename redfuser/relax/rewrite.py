"""Replacing a group: its fused PrimFunc, one call_tir, and the checks that keep a module whole.

Each group is applied to a copy of the module; the copy is kept only if the kernel built
and the module is well formed, so a module is never left half rewritten.  The group's
inputs are reshaped to the kernel's (R_in, L, F) convention, its outputs reshaped back
and bound to the very Relax variables they replace, so every other binding is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

import numpy as np

from algebra import NotFusable, SpecError, derive
from algebra.dtypes import COMPUTE, STORAGE, argument_dtype, numpy_dtype
from algebra.layout import Layout

from ..lowering import Geometry, backend, build_primfunc, geometry, signature
from ..lowering.signature import param_shape
from ..plans import plan_for
from ..report import GroupReport
from ..tvm.graph import relax
from ..tvm.ir import provably_equal, with_root_block
from ..tvm.runtime import build
from ..tvm.target import target_in_scope
from .frag import Unliftable
from .group import BindingGroup
from .values import shape_of


@lru_cache(maxsize=512)
def derive_spec(spec: str) -> tuple:
    """(rule, "") or (None, why not); the engine's refusals become reasons (cached: a
    derivation depends on the text only)."""
    try:
        return derive(spec), ""
    except (NotFusable, SpecError) as e:
        return None, f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - any engine failure leaves the group alone
        return None, f"derivation failed: {type(e).__name__}: {e}"


@dataclass(frozen=True)
class FusedFunc:
    """A fused PrimFunc and how a Relax call reaches it."""

    name: str
    func: object
    inputs: tuple  # (spec name, Input, (R_in, L, F)) in the PrimFunc's order
    outputs: tuple  # (spec name, shape, dtype) in the PrimFunc's order
    plan: object
    tuned: bool = False  # the plan came from the tuning database
    target: str = "cpu"  # the backend that built it


def group_geometry(group: BindingGroup, rule) -> Geometry:
    """The kernel's shapes for the group's values (the array convention of layout.py)."""
    frag = group.frag
    names = sorted(s.name for s in (*rule.cascade.streams, *rule.cascade.params))
    arrays = {}
    for nm in names:
        inp = frag.inputs[nm]
        tail = (frag.n if inp.kind == "stream" else 1, frag.d if inp.vector else 1)
        # shapes and storage dtypes only
        arrays[nm] = np.broadcast_to(np.zeros((), numpy_dtype(inp.dtype)), inp.rows + tail)
    vector = frozenset(nm for nm in names if frag.inputs[nm].vector)
    # every output float32, as the Relax values the kernel replaces are, unless the model
    # casts the per-element ones down (``group.narrowed``)
    return geometry(rule, Layout(frag.frame, frag.n, frag.d, np.dtype(np.float32), arrays,
                                 vector), group.out_dtype)


def kernel_for(group: BindingGroup, rule, name: str, tuned: bool = True,
               target: str = "cpu") -> FusedFunc:
    """The PrimFunc of ``rule`` on the group's shapes for backend ``target``, following the
    tuning database's plan for them when it has one (``redfuser tune --model``;
    ``tuned=False``: the hand-written plan)."""
    geo = group_geometry(group, rule)
    choice = plan_for(rule, geo, target, tune=None if tuned else False)
    plan = choice.plan
    func = _relax_callee(build_primfunc(rule, geo, plan, name, target, keep=group.read))
    inputs = tuple((nm, group.frag.inputs[nm], (g.count, g.length, g.width))
                   for nm, g in sorted(geo.inputs.items()))
    outputs = tuple((a.name, a.shape, argument_dtype(a.dtype))
                    for a in signature(rule, geo, group.read).outputs)
    return FusedFunc(name, func, inputs, outputs, plan, choice.tuned, target)


def dynamic_kernel_for(group: BindingGroup, rule, name: str, dims,
                       target: str = "cpu") -> FusedFunc:
    """The kernel of ``rule`` for every row count and N (``Plan.dynamic``) for backend
    ``target``, from a group lifted at probe values of the shape variables
    (``symbolic.py``); ``dims`` maps a probe-valued size back to its expression of the
    variables, for the call's shapes."""
    geo = group_geometry(group, rule)
    plan = plan_for(rule, geo, target, dynamic=True).plan
    # static row axes stay static: fewer shape variables in every index (LLVM took 160 s
    # on attention with rows (1, H, L) all symbolic, 6 s with only L)
    fixed = frozenset(k for k, size in enumerate(geo.rows) if isinstance(dims(size), int))
    func = _relax_callee(build_primfunc(rule, geo, plan, name, target, fixed, group.read))
    return FusedFunc(name, func, *dynamic_call_shapes(group, rule, dims), plan, target=target)


def dynamic_call_shapes(group: BindingGroup, rule, dims) -> tuple[tuple, tuple]:
    """(inputs, outputs) of ``FusedFunc`` for the dynamic kernel of ``group``: every
    argument's shape with its row axes apart (``signature.param_shape``), through ``dims``."""
    geo = group_geometry(group, rule)
    sig = signature(rule, geo, group.read)
    inputs = tuple((a.name, group.frag.inputs[a.name],
                    tuple(dims(v) for v in param_shape(a, geo, True))) for a in sig.inputs)
    outputs = tuple((a.name, tuple(dims(v) for v in param_shape(a, geo, False)),
                     argument_dtype(a.dtype)) for a in sig.outputs)
    return inputs, outputs


def _relax_callee(func):
    """Relax's passes read a PrimFunc's root block (reshape detection) and skip functions
    marked scheduled (dlight): wrap the body in a root block, mark it scheduled and opaque
    (op_pattern 8) so that FuseOps leaves it whole."""
    func = with_root_block(func)
    return func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)


def check_kernel(kernel: FusedFunc):
    """Compile the PrimFunc alone, for the target in scope (else its backend's default):
    a kernel TVM cannot build never enters the module."""
    build(kernel.func, target_in_scope() or backend(kernel.target).tvm_target())


def splice_checked(mod, gv, index: int, name: str, entry: dict, make) -> tuple:
    """(module, report) with the kernel ``make()`` returns, as (kernel, the group as the
    function holds it), spliced into a copy of ``mod``: the copy only if it is well formed;
    otherwise ``mod`` unchanged and the reason (an unliftable group, or TVM's last line)."""
    try:
        kernel, group = make()
        bb = relax.BlockBuilder(mod.clone())
        kgv = bb.add_func(kernel.func, name)
        bb.update_func(gv, splice(bb.get()[gv], index, group, kgv, kernel))
        candidate = bb.get()
        relax.analysis.well_formed(candidate)
    except Unliftable as e:
        return mod, GroupReport(fused=False, reason=str(e), **entry)
    except Exception as e:  # noqa: BLE001 - a TVM error keeps the original, with the reason
        first = str(e).strip().splitlines()[-1:] or [""]
        return mod, GroupReport(fused=False, reason=f"{type(e).__name__}: {first[0]}", **entry)
    return candidate, GroupReport(fused=True, reason=str(kernel.plan), kernel=name, **entry)


def splice(func, block_index: int, group: BindingGroup, gv, kernel: FusedFunc):
    """``func`` with the group's values computed by one call of ``gv``."""
    block = func.body.blocks[block_index]
    bb, new = relax.BlockBuilder(), []

    def bind(value, name: str):
        value = bb.normalize(value)
        var = relax.DataflowVar(name, value.ty)
        new.append(relax.VarBinding(var, value))
        return var

    args = [bind(relax.op.reshape(_prepared(inp, shape, bind), shape), f"{kernel.name}_{nm}")
            for nm, inp, shape in kernel.inputs]
    types = [relax.TensorType(shape, dtype) for _, shape, dtype in kernel.outputs]
    # one output: call_tir's value is that tensor, not a tuple of one
    call = bind(relax.call_tir(gv, args, types if len(types) > 1 else types[0]), kernel.name)
    index = {name: k for k, (name, _, _) in enumerate(kernel.outputs)}
    for sink, node in group.sinks:
        var, parts = group.casts.get(sink, sink), []  # a folded cast: its value is the output
        for field, out in zip(node.fields or (node,), group.outputs[sink], strict=True):
            shape = field.shape if node.fields else shape_of(var.ty)
            if not provably_equal(prod(shape), prod(kernel.outputs[index[out]][1])):
                raise Unliftable(f"output {var.name} {shape} does not match the kernel's "
                                 f"{kernel.outputs[index[out]][1]}")
            item = call if len(types) == 1 else bind(relax.TupleGetItem(call, index[out]),
                                                     f"{kernel.name}_{out}")
            parts.append(_output(_stored(item, var, bind), shape, field.perm, bind))
        value = parts[0] if len(parts) == 1 else relax.Tuple(
            [bind(p, f"{var.name}_{k}") for k, p in enumerate(parts)])
        new.append(relax.VarBinding(var, bb.normalize(value)))
    replaced = {group.casts.get(var, var) for var, _ in group.sinks}
    first = next(k for k, b in enumerate(block.bindings) if b.var in replaced)
    kept = [b for b in block.bindings if b.var not in replaced]
    bindings = _topological(kept[:first] + new + kept[first:])
    blocks = list(func.body.blocks)
    blocks[block_index] = relax.DataflowBlock(bindings)
    return bb.normalize(relax.Function(func.params, relax.SeqExpr(blocks, func.body.body),
                                       func.ret_ty, func.is_pure, func.attrs))


def _prepared(inp, shape: tuple, bind):
    """The input's Relax value before its reshape, after its prep steps (``PREP``): a
    transpose, a cast to float32 (an index or a condition), a view that broadcasts a
    per-channel weight, a permutation that puts the reduced axes last; a bfloat16 input
    is then viewed as its int16 bits, as the kernel declares it (``algebra.dtypes``)."""
    e = inp.source
    for step in prep_steps(inp.prep):
        e = bind(PREP[step[0]](e, *step[1:]), f"rf_{step[0]}")
    if argument_dtype(inp.dtype) != inp.dtype:  # bfloat16: the kernel declares its bits
        e = bind(relax.op.memory.view(e, dtype=argument_dtype(inp.dtype)), "rf_bits")
    if not provably_equal(prod(shape_of(e.ty)), prod(shape)):
        raise Unliftable(f"input {shape_of(e.ty)} cannot be read as {shape}")
    return e


def _stored(item, var, bind):
    """A kernel output as the dtype of the Relax value it becomes: a bfloat16 output comes
    as its int16 bits (``algebra.dtypes``) and is viewed back; a float32 one (a per-row
    result, which kernels keep in float32) where the model computed in a lower precision
    is cast, rounding once as the model's last operation did."""
    want, got = str(var.ty.dtype), str(item.ty.dtype)
    if got == want:
        return item
    if got == COMPUTE.name and want in STORAGE:
        return bind(relax.op.astype(item, want), "rf_rounded")
    if got != argument_dtype(want):
        raise Unliftable(f"output {var.name} is {want}; the kernel's is {got}")
    return bind(relax.op.memory.view(item, dtype=want), "rf_stored")


def _swap_last(e):
    rank = len(shape_of(e.ty))
    return relax.op.permute_dims(e, [*range(rank - 2), rank - 1, rank - 2])


PREP = {  # prep step -> the Relax op it applies
    "T": _swap_last,
    "float": lambda e: relax.op.astype(e, "float32"),
    "reshape": lambda e, shape: relax.op.reshape(e, shape),
    "broadcast": lambda e, shape: relax.op.broadcast_to(e, shape),
    "perm": lambda e, axes: relax.op.permute_dims(e, list(axes)),
}


def prep_steps(prep: tuple) -> tuple:
    """A prep as its steps: ``("T",)`` is one step, ``(("reshape", s), ("perm", a))`` two."""
    return prep if prep and isinstance(prep[0], tuple) else (prep,) if prep else ()


def _output(item, shape: tuple, perm: tuple, bind):
    """A kernel output as the Relax value's shape; ``perm``: the kernel computed it with the
    value's axes in that order (its reduced axes moved last), so they are put back."""
    if not perm:
        return relax.op.reshape(item, shape)
    moved = bind(relax.op.reshape(item, tuple(shape[a] for a in perm)), "rf_moved")
    return relax.op.permute_dims(moved, [perm.index(a) for a in range(len(perm))])


def _topological(bindings: list) -> list:
    """Stable order in which every binding follows what it reads (a dataflow block is pure,
    so any such order computes the same values)."""
    bound = {b.var for b in bindings}
    needs = [{v for v in relax.analysis.free_vars(b.value) if v in bound} for b in bindings]
    done, order, pending = set(), [], list(range(len(bindings)))
    while pending:
        ready = next((k for k in pending if needs[k] <= done), None)
        if ready is None:
            raise Unliftable("an input of the kernel is computed from one of its outputs")
        pending.remove(ready)
        order.append(bindings[ready])
        done.add(bindings[ready].var)
    return order
