"""Lifting TensorIR: find cascades of reduction blocks in a PrimFunc and derive their rules.

Analysis only (frozen data, nothing rewritten; ``fuse`` does that).  The root
block's statements are the *units*: a loop nest around one block whose update
matches a combiner in ``COMBINERS`` is a reduction, one that stores a value is
elementwise (and is inlined where it is read), anything else is opaque and kept.
Reductions linked by data dependence (a later body reads an earlier result per
row) form a group; ``axes`` maps each group's loop variables and buffer axes onto
one frame (rows, the stream axis N, a feature axis D), the group is printed in the
spec language and handed to ``redfuser.derive``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from algebra import FusionRule, NotFusable, SpecError, derive

from ..tvm.ir import (
    SBlock,
    SBlockRealize,
    TensorLoad,
    TensorRegion,
    WalkResult,
    is_buffer_var,
    structural_walk,
    tirx,
)
from .axes import Access, Frame, group_axes
from .expr import FLOAT_MAX, LiftError, Producer, Translator

# update node class -> (reduction, initial values accepted as its identity)
COMBINERS: dict[type, tuple[str, frozenset]] = {
    tirx.Add: ("sum", frozenset({0.0})),
    tirx.Mul: ("prod", frozenset({1.0})),
    tirx.Max: ("max", frozenset({-float("inf"), -FLOAT_MAX})),
    tirx.Min: ("min", frozenset({float("inf"), FLOAT_MAX})),
}
DATA_PAR, COMM_REDUCE = 0, 2  # IterVar kinds


@dataclass(frozen=True)
class LiftedBlock:
    """A liftable block: ``out[store] = value`` (or ``out[store] = op(out[store], value)``)."""

    pos: int
    name: str
    out: object
    store: tuple  # per output axis: a block variable or an int
    value: object  # the TIR value (a reduction's operand)
    extents: dict  # block variable -> int, or the symbolic extent expression
    reduce_var: object = None
    op: str | None = None


@dataclass(frozen=True)
class Unit:
    """One statement of the root block; ``block`` is None for an opaque one."""

    pos: int
    stmt: object
    block: LiftedBlock | None
    reads: frozenset
    writes: frozenset
    why: str = ""


@dataclass(frozen=True)
class Group:
    """One cascade found in a PrimFunc, fusable (``rule`` set) or not (``reason`` says why).

    ``positions`` are the root statements the fused computation replaces (it goes at the
    first), ``dead`` the further statements that only fed them; ``accesses`` bind every
    spec name to a buffer and its axes, ``frame`` gives the axis sizes."""

    function: str
    reductions: tuple[str, ...]
    consumers: tuple[str, ...] = ()
    spec: str | None = None
    frame: Frame | None = None
    accesses: tuple[Access, ...] = ()
    positions: tuple[int, ...] = ()
    dead: tuple[int, ...] = ()
    rule: FusionRule | None = field(default=None, compare=False)
    reason: str = ""
    notes: tuple[str, ...] = ()

    @property
    def fusable(self) -> bool:
        return self.rule is not None

    @property
    def blocks(self) -> tuple[str, ...]:
        return self.reductions + self.consumers


def lift(func, name: str | None = None) -> list[Group]:
    """Find the cascades of reductions in a TensorIR PrimFunc and derive their rules.

    Parameters
    ----------
    func : tvm.tirx.PrimFunc
        A function with SBlocks (TVMScript ``@T.prim_func(s_tir=True)``,
        ``te.create_prim_func``, TOPI).
    name : str, optional
        Name shown in the groups (default: the function's ``global_symbol``).

    Returns
    -------
    list of Group
        One per chain of reduction blocks, in program order; a group's ``rule`` is the
        proven FusionRule, or None with ``reason`` saying why it cannot be fused.

    Raises
    ------
    LiftError
        ``func`` is not a PrimFunc with a root SBlock (already lowered TIR).

    Examples
    --------
    >>> from tvm import te, topi
    >>> x = te.placeholder((4, 64), "float32", name="x")
    >>> g, b = (te.placeholder((64,), "float32", name=n) for n in "gb")
    >>> [group] = lift(te.create_prim_func([x, g, b, topi.nn.layer_norm(x, g, b, axis=[-1])]))
    >>> print(group.spec)
    x_sum = sum(x[i])
    x_var_sum = sum((x[i] - x_sum/64)**2)
    T_layer_norm[i] = g[i]*(x[i] - x_sum/64)/sqrt(x_var_sum/64 + 1/100000) + b[i]
    >>> group.fusable, group.frame, group.consumers
    (True, Frame(rows=(4,), n=64, d=None), ('x_mean', 'T_layer_norm'))
    """
    units, params = root_units(func)
    name = name or _symbol(func)
    writers: dict = {}
    for u in units:
        for b in u.writes:
            writers.setdefault(b, []).append(u.pos)
    producers = {u.block.out: Producer(u.pos, u.block.store, u.block.value,
                                       u.reads - {u.block.out}) for u in units
                 if u.block is not None and u.block.op is None and
                 len(writers[u.block.out]) == 1}  # an elementwise block, the buffer's only writer
    exprs, failed = {}, {}
    for u in units:
        if u.block is not None:
            try:
                tr = Translator(producers, writers, u.pos, f"block '{u.block.name}'")
                exprs[u.pos] = (tr.value(u.block.value), tr.loads)
            except LiftError as e:
                failed[u.pos] = str(e)
    reductions = [u for u in units if u.block is not None and u.block.op is not None]
    groups = [(comp[0].pos, _group(name, comp, units, params, exprs, failed))
              for comp in _components(reductions, exprs, units)]
    groups += [(u.pos, Group(name, (_reduces(u.stmt),), reason=u.why)) for u in units
               if u.block is None and u.why and _reduces(u.stmt)]  # reported, never fused
    return [g for _, g in sorted(groups, key=lambda pg: pg[0])]


def root_units(func) -> tuple[list[Unit], frozenset]:
    """The root block's statements as units, and the parameter buffers."""
    if not isinstance(func, tirx.PrimFunc):
        raise LiftError(f"expected a tvm.tirx.PrimFunc, not {type(func).__name__}")
    if not isinstance(func.body, SBlockRealize):
        raise LiftError("the function has no root SBlock (already lowered TIR, or written "
                        "without T.sblock): nothing to lift")
    body = func.body.block.body
    stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    params = frozenset(p for p in func.params if is_buffer_var(p))
    return [_unit(pos, s) for pos, s in enumerate(stmts)], params


def _symbol(func) -> str:
    attrs = func.attrs or {}
    return str(attrs.get("global_symbol", "main")) if attrs else "main"


# -- Step 1. Units ----------------------------------------------------------------------------

def _unit(pos: int, stmt) -> Unit:
    reads, writes = _accesses(stmt)
    try:
        return Unit(pos, stmt, _block(pos, stmt), reads, writes)
    except LiftError as e:
        return Unit(pos, stmt, None, reads, writes, str(e))


def _reduces(stmt) -> str | None:
    """The name of a reduction block inside ``stmt`` (None if it has none)."""
    found = []
    structural_walk(stmt, (SBlock, lambda b: found.append(b.name_hint) if any(
        iv.iter_type == COMM_REDUCE for iv in b.iter_vars) else None))
    return found[0] if found else None


def _accesses(stmt) -> tuple[frozenset, frozenset]:
    """Buffers a statement reads and writes: loads, stores and the blocks' declared regions;
    a buffer used any other way (an address taken, an extern call) counts as written."""
    loads, stores, seen = set(), set(), set()

    def block(b):
        loads.update(r.source for r in b.reads)
        stores.update(r.source for r in b.writes)

    structural_walk(stmt, [(SBlock, block), (TensorRegion, lambda n: WalkResult.SKIP),
                           (TensorLoad, lambda n: loads.add(n.source)),
                           (tirx.BufferStore, lambda n: stores.add(n.buffer)),
                           (tirx.Var, lambda v: seen.add(v) if is_buffer_var(v) else None)],
                    order="pre")
    return frozenset(seen | loads | stores), frozenset(stores | (seen - loads - stores))


def _block(pos: int, stmt) -> LiftedBlock:
    """The block of a perfect loop nest, if its update is liftable (else LiftError)."""
    loops = {}
    while isinstance(stmt, tirx.For):
        if _int(stmt.min) != 0:
            raise LiftError(f"loop `{stmt.loop_var}` does not start at 0")
        loops[stmt.loop_var] = stmt.extent
        stmt = stmt.body
    if not isinstance(stmt, SBlockRealize):
        raise LiftError("not a loop nest around one block")
    blk, where = stmt.block, f"block '{stmt.block.name_hint}'"
    store = blk.body
    if not isinstance(store, tirx.BufferStore) or blk.alloc_buffers or blk.match_buffers:
        raise LiftError(f"{where} is not a single store")
    if store.buffer.dtype != "float32":
        raise LiftError(f"{where} computes in {store.buffer.dtype}: only float32 blocks are "
                        "lifted (the kernels compute in float32)")
    if _int(stmt.predicate) != 1:
        raise LiftError(f"{where} has a predicate")
    extents, reduce_var = _iter_vars(blk, stmt.iter_values, loops, where)
    terms = tuple(_int(i) if _int(i) is not None else i for i in store.indices)
    spatial = [v for v in extents if reduce_var is None or not v.same_as(reduce_var)]
    named = [t for t in terms if not isinstance(t, int)]
    if not (len(set(named)) == len(named) == len(spatial) and set(named) == set(spatial)):
        raise LiftError(f"{where} does not store at exactly its spatial variables")
    if reduce_var is None:
        if blk.init is not None or _reads(store.value, store.buffer):
            raise LiftError(f"{where} reads what it writes")
        return LiftedBlock(pos, blk.name_hint, store.buffer, terms, store.value, extents)
    op, value = _combiner(blk, store, where)
    return LiftedBlock(pos, blk.name_hint, store.buffer, terms, value, extents, reduce_var, op)


def _iter_vars(blk, values, loops: dict, where: str) -> tuple[dict, object]:
    """(block variable -> extent, the reduction variable or None); each variable must be bound
    to a whole loop, and at most one may reduce."""
    extents, reduce_var = {}, None
    for iv, value in zip(blk.iter_vars, values, strict=True):
        if not (isinstance(value, tirx.Var) and value in loops and _int(iv.dom.min) == 0
                and _same(iv.dom.extent, loops[value])):
            raise LiftError(f"{where}: variable `{iv.var}` is not bound to a whole loop")
        if iv.iter_type == COMM_REDUCE:
            if reduce_var is not None:
                raise LiftError(f"{where} reduces over more than one axis")
            reduce_var = iv.var
        elif iv.iter_type != DATA_PAR:
            raise LiftError(f"{where}: variable `{iv.var}` is neither spatial nor reduction")
        extent = _int(iv.dom.extent)
        extents[iv.var] = iv.dom.extent if extent is None else extent
    return extents, reduce_var


def _combiner(blk, store, where: str):
    """(reduction, operand) of ``out = op(out, operand)`` with an identity init."""
    entry = COMBINERS.get(type(store.value))
    if entry is None:
        raise LiftError(f"{where}: update `{store.value}` matches no combiner "
                        f"({', '.join(op for op, _ in COMBINERS.values())})")
    op, identities = entry
    a, b = store.value.a, store.value.b
    own = [x for x in (a, b) if isinstance(x, TensorLoad) and x.source.same_as(store.buffer)
           and all(_same(i, j) for i, j in zip(x.indices, store.indices, strict=True))]
    operand = b if own and own[0] is a else a
    init = blk.init
    if not own or _reads(operand, store.buffer):
        raise LiftError(f"{where}: update `{store.value}` is not {op}(out, value)")
    if not (isinstance(init, tirx.BufferStore) and isinstance(init.value, tirx.FloatImm)
            and float(init.value.value) in identities):
        raise LiftError(f"{where}: a {op} must start at its identity, not "
                        f"{getattr(init, 'value', None)}")
    return op, operand


def _reads(expr, buffer) -> bool:
    found = []
    structural_walk(expr, (TensorLoad, lambda n: found.append(n.source.same_as(buffer))))
    return any(found)


def _int(e) -> int | None:
    return int(e.value) if isinstance(e, tirx.IntImm) else (e if isinstance(e, int) else None)


def _same(a, b) -> bool:
    return _int(a) == _int(b) if _int(a) is not None else a.same_as(b)


# -- Step 2. Grouping ------------------------------------------------------------------

def _components(reductions: list[Unit], exprs: dict, units: list[Unit]) -> list[list[Unit]]:
    """Reductions linked by per-row reads of one another's results (union-find).  A block
    that could not be lifted is linked by the buffers it reaches through elementwise blocks
    instead, so that it is reported once, with its chain."""
    out_of = {u.block.out: u for u in reductions}
    parent = {u.pos: u.pos for u in reductions}

    def root(p):
        while parent[p] != p:
            p = parent[p]
        return p

    for u in reductions:
        for src in _anchor_sources(u, exprs, units, out_of):
            parent[root(u.pos)] = root(src.pos)
    comps: dict = {}
    for u in reductions:
        comps.setdefault(root(u.pos), []).append(u)
    return sorted(comps.values(), key=lambda c: c[0].pos)


def _anchor_sources(u: Unit, exprs: dict, units: list[Unit], out_of: dict) -> list[Unit]:
    k = u.block.reduce_var
    if u.pos in exprs:
        return [out_of[ld.buffer] for ld in exprs[u.pos][1].values()
                if ld.buffer in out_of and out_of[ld.buffer].pos < u.pos and not any(
                    not isinstance(t, int) and t.same_as(k) for t in ld.terms)]
    found, todo, seen = [], list(u.reads - {u.block.out}), set()
    while todo:
        buf = todo.pop()
        if buf in seen:
            continue
        seen.add(buf)
        if buf in out_of and out_of[buf].pos < u.pos:
            found.append(out_of[buf])
            continue
        todo += [b for v in units if v.pos < u.pos and v.block is not None and
                 v.block.op is None and buf in v.writes for b in v.reads]
    return found


def _group(name, comp, units, params, exprs, failed) -> Group:
    """The component as one group; if the engine refuses one of its reductions, the reductions
    before it are tried alone (the rest is found again, as a group of its own, once they are
    fused)."""
    bad = [failed[u.pos] for u in comp if u.pos in failed]
    if bad:
        return Group(name, tuple(u.block.name for u in comp), reason=bad[0])
    try:
        whole, culprit = _attempt(name, comp, units, params, exprs)
    except LiftError as e:
        return Group(name, tuple(u.block.name for u in comp), reason=str(e))
    refused = next((u for u in comp for a in whole.accesses
                    if a.name == culprit and a.buffer.same_as(u.block.out)), None)
    prefix = [u for u in comp if refused is not None and u.pos < refused.pos]
    if whole.fusable or not prefix:
        return whole
    try:
        part, _ = _attempt(name, prefix, units, params, exprs)
    except LiftError:
        return whole
    note = f"'{refused.block.name}' and the reductions after it are left: {whole.reason}"
    return _with(part, notes=part.notes + (note,)) if part.fusable else whole


def _attempt(name, comp, units, params, exprs) -> tuple[Group, str | None]:
    """(group, name of the reduction the engine refused, if it refused one)."""
    axes = group_axes(comp, units, params, exprs)
    group = Group(name, axes.reductions, axes.consumers, axes.spec, axes.frame, axes.accesses,
                  axes.positions, axes.dead, notes=axes.notes)
    if axes.trivial:
        return _with(group, reason=axes.trivial), None
    rule, why, culprit = derive_cached(axes.spec)
    return _with(group, rule=rule, reason=why), culprit


def _with(group: Group, **changes) -> Group:
    return replace(group, **changes)


@functools.lru_cache(maxsize=256)
def derive_cached(spec: str) -> tuple[FusionRule | None, str, str | None]:
    """(rule, '', None) or (None, the engine's reason, the refused reduction's name or None);
    lifting again after a rewrite hits the cache."""
    try:
        return derive(spec), "", None
    except NotFusable as e:
        return None, f"NotFusable: {e}", e.reduction
    except SpecError as e:
        return None, f"SpecError: {e}", None
    except Exception as e:  # noqa: BLE001 - an engine failure is a report entry, not a crash
        return None, f"the algebra engine failed: {type(e).__name__}: {e}", None
