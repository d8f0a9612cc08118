"""Rewriting one lifted group: the fused kernel as a statement, spliced into the PrimFunc.

The kernel is emitted by the target's own loop nests (``lowering.backend(target).variants``)
into placeholder buffers of the kernel's shapes ((R_in, L, F) inputs, (R, width)
results, (R, N, width) per-element outputs); every load and store of a placeholder
is then rewritten into an access of the original buffer through the group's axis
roles (``structural_map``).  No buffer views are declared: TVM 0.27's StorageRewrite
ignores DeclBuffer aliases of allocated buffers and gave two viewed intermediates the
same memory.  Results nothing reads afterwards go to fresh local buffers instead.
The statement becomes one opaque SBlock at the group's first position; the group's
other statements and the dead ones go, and so do root allocations left unused.
"""

from __future__ import annotations

import numpy as np

from algebra.layout import Layout

from ..lowering import Geometry, Plan, backend, geometry, signature
from ..plans import hand_written, plan_for
from ..tvm.ir import (
    IRBuilder,
    Range,
    SBlock,
    SBlockRealize,
    T,
    TensorLoad,
    is_buffer_var,
    structural_map,
    structural_walk,
    tirx,
)
from .groups import Group

F32 = "float32"


def layout_of(group: Group) -> Layout:
    """The kernel's view of the group's inputs: (*own rows, L, F) per input (zero-size data)."""
    frame = group.frame
    arrays, vector = {}, set()
    for a in group.accesses:
        if a.is_input:
            shape = own_rows(a, frame.rows) + (frame.n if a.kind == "stream" else 1,
                                               frame.d if a.vector else 1)
            arrays[a.name] = np.broadcast_to(np.zeros((), np.float32), shape)
            if a.vector:
                vector.add(a.name)
    return Layout(frame.rows, frame.n, frame.d, np.dtype(np.float32), arrays, frozenset(vector))


def own_rows(access, rows: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s if ("row", j) in access.dims else 1 for j, s in enumerate(rows))


def fused_stmt(group: Group, target: str, fast_math: bool = True):
    """(statement, plan): the group's fused kernel over the original buffers, following the
    plan ``compile`` would (``plans.plan_for``: the tuning database's when it has one); a
    tuned plan that does not emit here gives way to the hand-written one, as in a Kernel."""
    geo = geometry(group.rule, layout_of(group))
    choice = plan_for(group.rule, geo, target, fast_math=fast_math)
    try:
        return _emitted(group, geo, choice.plan, target), choice.plan
    except Exception:  # noqa: BLE001 - a stale tuning record never stops the rewrite
        if not choice.tuned:
            raise
    plan = hand_written(group.rule, geo, target, fast_math=fast_math)
    return _emitted(group, geo, plan, target), plan


def _emitted(group: Group, geo: Geometry, plan: Plan, target: str):
    """The group's kernel of ``plan`` at ``geo`` as a statement over the original buffers."""
    rule, frame = group.rule, group.frame
    by_name = {a.name: a for a in group.accesses}
    views: dict = {}  # placeholder -> (access, own rows)

    def view(name, shape, rows, dtype=F32):
        buf = tirx.decl_buffer(shape, dtype, f"{name}_kernel")
        views[buf] = (by_name[name], rows)
        return buf

    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("redfuser_fused")
            bufs = {k: view(k, (g.count, g.length, g.width), g.rows) for k, g in
                    sorted(geo.inputs.items())}
            results, elementwise = {}, {}
            sig = signature(rule, geo, frozenset(n for n, a in by_name.items() if a.needed))
            for a in sig.outputs:
                _check_width(a, by_name[a.name], frame)
                if a.elementwise:
                    elementwise[a.name] = view(a.name, a.shape, frame.rows)
                else:
                    results[a.name] = (view(a.name, a.shape, frame.rows, a.dtype), a.width)
            for a in sig.internal:  # results the function never reads again
                results[a.name] = (T.alloc_buffer(a.shape, a.dtype), a.width)
            backend(target).variants[plan.variant](rule, geo, plan, bufs, results, elementwise)
    return _remap(ib.get().body, views)


def _check_width(arg, access, frame) -> None:
    """The kernel's width of an output must match the buffer's axes."""
    if arg.width != (frame.d if access.vector else 1):
        raise ValueError(f"output '{arg.name}' has width {arg.width} in the kernel but its "
                         f"buffer axes are {access.dims}")


def _remap(body, views: dict):
    """Every placeholder access -> the original buffer at the mapped indices."""
    def load(node):
        hit = views.get(node.source)
        return node if hit is None else tirx.BufferLoad(hit[0].buffer,
                                                        _indices(*hit, node.indices))

    def store(node):
        hit = views.get(node.buffer)
        return node if hit is None else tirx.BufferStore(hit[0].buffer, node.value,
                                                         _indices(*hit, node.indices))

    out = structural_map(body, [(TensorLoad, load), (tirx.BufferStore, store)])
    left = []
    structural_walk(out, (tirx.Var, lambda v: left.append(v.name) if v in views else None))
    if left:
        raise ValueError(f"placeholder buffer(s) {sorted(set(left))} used outside a load or "
                         "store")
    return out


def _indices(access, rows: tuple[int, ...], kernel: list) -> list:
    """Kernel indices (r, [i,] slot) -> the original buffer's, one per axis by role."""
    r, slot = kernel[0], kernel[-1]
    i = kernel[1] if len(kernel) == 3 else None
    row_index, inner = {}, 1
    for j in reversed(range(len(rows))):
        if rows[j] > 1:
            row_index[j] = tirx.floormod(tirx.floordiv(r, _c(inner, r)), _c(rows[j], r))
        inner *= rows[j]
    table = {"n": lambda d: i, "d": lambda d: slot, "const": lambda d: tirx.const(d[1], "int32"),
             "row": lambda d: row_index.get(d[1], tirx.const(0, "int32"))}
    return [table[d[0]](d) for d in access.dims]


def _c(value: int, like):
    return tirx.const(value, like.ty.dtype if hasattr(like, "ty") else "int32")


def splice(func, group: Group, stmt):
    """``func`` with the group's statements replaced by ``stmt`` (an opaque block at the first
    position) and its dead statements and unused root allocations removed."""
    realize = func.body
    root = realize.block
    stmts = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    reads = [a.buffer for a in group.accesses if a.is_input]
    writes = [a.buffer for a in group.accesses if not a.is_input and a.needed]
    block = SBlock([], [_region(b) for b in reads], [_region(b) for b in writes],
                   f"redfuser_{group.reductions[0]}", stmt)
    drop = set(group.positions) | set(group.dead)
    kept = [SBlockRealize([], True, block) if pos == group.positions[0] else s
            for pos, s in enumerate(stmts) if pos == group.positions[0] or pos not in drop]
    body = tirx.SeqStmt(kept) if len(kept) > 1 else kept[0]
    used: set = set()
    structural_walk(body, (tirx.Var, lambda v: used.add(v) if is_buffer_var(v) else None))
    allocs = [b for b in root.alloc_buffers if b in used]
    new_root = SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body, root.init,
                      allocs, root.match_buffers, root.annotations)
    return func.with_body(SBlockRealize(realize.iter_values, realize.predicate, new_root))


def _region(buf):
    return tirx.BufferRegion(buf, [Range(0, s) for s in buf.shape])


def rewrite_group(func, group: Group, target: str = "cpu", fast_math: bool = True) -> tuple:
    """(new PrimFunc, plan) with ``group`` fused; raises on any failure (nothing is kept)."""
    stmt, plan = fused_stmt(group, target, fast_math)
    return splice(func, group, stmt), plan

