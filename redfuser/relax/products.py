"""Matrix products lifted: scores ``q @ k^T`` as a per-element dot product, and a streamed
left side times a weight (``p @ v``, a norm times a Linear) as a sum over the stream.

Grouped-query attention (Llama's ``repeat_kv``: ``expand_dims``, ``broadcast_to`` over a
new head axis, ``reshape`` to H heads) is read without the repeat: K and V are read as
they were before it, with rows (B, Hkv, 1) on the frame (B, Hkv, G, ...) that splits the
query heads, and each K/V row is shared by its G query heads through the kernels' row
broadcasting.  The frame has as many rows as the Relax value's and orders them alike
(``frag.fit``).
"""

from __future__ import annotations

import dataclasses
from math import prod

from ..tvm.graph import relax
from .frag import Unliftable, computed, merge, move_rows
from .idioms import GUARD, guard_of
from .values import Ext, Lifting, Node, pad_shape, static_shape


def matmul(lf: Lifting, call, ty) -> Node:
    a, b = call.args
    out, sa, sb = static_shape(ty), static_shape(a.ty), static_shape(b.ty)
    if len(sa) < 2 or len(sb) < 2:
        raise Unliftable("not a matrix product")
    computed(str(ty.dtype))  # low-precision operands: float32 accumulation, as torch's
    node = lf.nodes.get(a)
    if node is not None and node.kind == "elem" and node.frag.reduces:
        return _contract(lf, a, b, sb, out)
    if lf.current in lf.materialise:
        raise Unliftable("kept as a matmul (its scores are needed outside)")
    if node is not None and node.frag.reduces:
        raise Unliftable("a reduced value used as a matrix")
    return _dot(lf, a, b, sa, sb, out)


def _contract(lf: Lifting, a, b, sb: tuple, out: tuple) -> Node:
    """A streamed left side times a weight: sum over the stream of a[i] * w[i, :]."""
    k, p = sb[-2], sb[-1]
    if p < 2:
        raise Unliftable("a product with a single column")
    e = lf.elem(a, out[:-1] + (k,))
    frame = out[:-1]
    rows = pad_shape(sb[:-2], len(frame) - 1, out[:-2]) + (1,)
    weight = lf.ext(b)
    grouped = _grouped(lf, weight, out[:-2])
    if grouped is not None:  # V shared by a group of query heads
        weight, own, heads = grouped
        frame, rows = heads + out[-2:-1], own + (1,)
    ref, wfrag = lf.input(weight, "stream", True, rows, frame, k, p)
    frag = merge([e.frag, wfrag], frame, k)
    if frag.d != p:
        raise Unliftable(f"two feature lengths ({frag.d} and {p}) in one kernel")
    guarded = None if e.terms else frag.stmts.get(e.text)
    guard = guard_of(guarded)
    terms = ((guard[1], frozenset({guard[1]})),) if guard else e.term_list()
    text = " + ".join(f"sum(({t}) * {ref})" for t, _ in terms)
    stmt = lf.stmt(text, "red", frozenset().union(*(d for _, d in terms)), "relax.matmul")
    frag = frag.with_stmt(stmt)
    if guard:  # a safe softmax's rows with no visible key give 0
        stmt = lf.stmt(GUARD.format(m=guard[0], p=stmt.name), "epi",
                       {guard[0], stmt.name}, "relax.matmul",
                       absorbed=(guarded.op, *guarded.absorbed))  # the where it moved
        frag = frag.with_stmt(stmt)
    return Node("vec", frag, stmt.name, frozenset({stmt.name}), out)


def _dot(lf: Lifting, a, b, sa: tuple, sb: tuple, out: tuple) -> Node:
    """Scores q @ k^T: one element of the stream per column, dot(q[:], k[i, :])."""
    m, k, p = sa[-2], sa[-1], sb[-1]
    if p < 2 or k < 2:
        raise Unliftable("a product with a single row or column")
    frame = out[:-1]
    arows = pad_shape(sa[:-2], len(out) - 2, out[:-2]) + (m,)
    brows = pad_shape(sb[:-2], len(out) - 2, out[:-2]) + (1,)
    keys = _transposed(lf, b)
    grouped = _grouped(lf, keys, out[:-2])
    if grouped is not None:  # K shared by a group of query heads
        keys, own, heads = grouped
        arows = move_rows(arows, frame, heads + (m,))
        frame, brows = heads + (m,), own + (1,)
        if arows is None:
            raise Unliftable(f"queries {sa} cannot be read on the grouped heads {heads}")
    aref, afrag = lf.input(lf.ext(a), "param", True, arows, frame, p, k)
    bref, bfrag = lf.input(keys, "stream", True, brows, frame, p, k)
    frag = merge([afrag, bfrag], frame, p)
    stmt = lf.stmt(f"dot({aref}, {bref})", "let", frozenset(), "relax.matmul")
    frag = dataclasses.replace(frag.with_stmt(stmt), dots=frozenset({lf.current}))
    return Node("elem", frag, stmt.name, frozenset({stmt.name}), out,
                dots=frozenset({lf.current}))


def _transposed(lf: Lifting, b) -> Ext:
    """b with its last two axes swapped: the producer's input when b is a transpose (seen
    through reshapes of the leading axes and same-shape broadcasts), else a permute_dims."""
    expr, shape = b, static_shape(b.ty)
    while isinstance(call := lf.values.get(expr), relax.Call) and lf.visible(call.args[0]):
        op, inner = call.op.name, static_shape(call.args[0].ty)
        rank = len(shape)
        if op == "relax.permute_dims":
            axes = list(call.attrs.axes) if call.attrs.axes is not None else None
            if axes == [*range(rank - 2), rank - 1, rank - 2] or (axes is None and rank == 2):
                return lf.ext(call.args[0])
            break
        keeps = op == "relax.reshape" and inner[-2:] == shape[-2:]
        if not (keeps or (op == "relax.broadcast_to" and inner == shape)):
            break
        expr, shape = call.args[0], inner
    sb = static_shape(b.ty)
    return Ext(b, sb[:-2] + (sb[-1], sb[-2]), str(b.ty.dtype), ("T",))


def _grouped(lf: Lifting, ext: Ext, lead: tuple):
    """(``ext`` read before its repeat, its row axes there, the frame's row axes) when
    ``ext`` is K or V repeated for grouped-query heads: a broadcast over row axes only,
    reshaped to the product's row axes ``lead``; else None."""
    call = lf.values.get(ext.source)
    if ext.prep or not isinstance(call, relax.Call) or call.op.name != "relax.broadcast_to" \
            or not lf.visible(call.args[0]):
        return None
    inner, full = static_shape(call.args[0].ty), static_shape(ext.source.ty)
    if len(inner) != len(full) or inner[-2:] != full[-2:] or prod(full[:-2]) != prod(lead):
        return None
    source = lf.peel(call.args[0])
    return Ext(source, inner, ext.dtype, (), str(source.ty.dtype)), inner[:-2], full[:-2]
