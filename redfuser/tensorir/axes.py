"""Axes of one group: which loop variable and buffer axis is a row, the stream axis N or
the feature axis D; which blocks join the group; what it reads, writes and leaves dead.

Every block of a group is mapped onto one frame: the first reduction's stored axes
are the rows (in its store order), its reduction axis is N.  Later blocks inherit
roles through the buffers they share with earlier ones (a load of ``m[v0]`` makes
``v0`` row 0); a later reduction's variable that matches no row becomes the feature
axis D (the output axis of a matmul after a softmax).  Each buffer keeps one role per
axis (``dims``), so the fused kernel reads and writes the original buffers in place
through an index map, whatever their layout (a transposed or strided stream is fine).
"""

from __future__ import annotations

from dataclasses import dataclass

from .expr import LiftError, spec_name, spec_text

N_ROLE, D_ROLE = ("n",), ("d",)


@dataclass(frozen=True)
class Frame:
    """Axis sizes of a group: rows (any number), the stream length N, the feature length D."""

    rows: tuple[int, ...]
    n: int
    d: int | None = None


@dataclass(frozen=True)
class Access:
    """A spec name bound to a buffer: ``dims`` gives each buffer axis its role,
    ("row", j), ("n",), ("d",) or ("const", c); ``kind`` is stream, param (inputs),
    result, epilogue or elementwise (outputs); ``needed`` says whether an output is read
    after the group (or is a parameter) and must be written."""

    name: str
    buffer: object
    dims: tuple
    kind: str
    needed: bool = True

    @property
    def vector(self) -> bool:
        return D_ROLE in self.dims

    @property
    def is_input(self) -> bool:
        return self.kind in ("stream", "param")


@dataclass(frozen=True)
class Axes:
    reductions: tuple[str, ...]
    consumers: tuple[str, ...]
    spec: str
    frame: Frame
    accesses: tuple[Access, ...]
    positions: tuple[int, ...]
    dead: tuple[int, ...]
    notes: tuple[str, ...]
    trivial: str  # why fusing would gain nothing ('' when it would)


class _Unifier:
    """Roles of loop variables and buffer axes, committed block by block."""

    def __init__(self):
        self.dims: dict = {}  # buffer -> tuple of roles
        self.frame: Frame | None = None

    def fit(self, block, loads: dict, first: bool) -> dict:
        """Roles of ``block``'s variables, then of every buffer axis it touches (committed
        only when all are consistent): buffer -> dims."""
        roles, frame = self._start(block, loads, first)
        accesses = [(ld.buffer, ld.terms) for ld in loads.values()] + [(block.out, block.store)]
        self._propagate(roles, accesses, block.name)
        for v in block.extents:
            if v not in roles:
                frame = self._feature(block, v, roles, frame)
        sizes = {N_ROLE: frame.n, D_ROLE: frame.d,
                 **{("row", j): s for j, s in enumerate(frame.rows)}}
        for v, role in roles.items():
            if role[0] != "const" and _extent(block, v) != sizes[role]:
                raise LiftError(f"block '{block.name}': loop `{v}` has extent "
                                f"{_extent(block, v)}, but the axis it indexes has {sizes[role]}")
        new = {}
        for buf, terms in accesses:
            new[buf] = self._dims(block, buf, terms, roles, new.get(buf, self.dims.get(buf)))
        self.dims.update(new)
        self.frame = frame
        return new

    def _start(self, block, loads: dict, first: bool) -> tuple[dict, Frame]:
        """Roles known before looking at the loads: extent-1 loops (a keepdims axis) are the
        constant index 0, the reduction variable is N; the first reduction's stored
        variables define the rows."""
        roles = {v: ("const", 0) for v in block.extents
                 if _extent(block, v) == 1 and not _same_var(v, block.reduce_var)}
        frame = self.frame
        if first:
            feature = _inner_axis(block, loads, roles)
            rows = [t for t in block.store if not isinstance(t, int) and t not in roles and
                    not _same_var(t, feature)]
            roles.update({v: ("row", j) for j, v in enumerate(rows)})
            frame = Frame(tuple(_extent(block, v) for v in rows),
                          _extent(block, block.reduce_var))
            if feature is not None:
                roles[feature] = D_ROLE
                frame = Frame(frame.rows, frame.n, _extent(block, feature))
        if block.reduce_var is not None:
            if _extent(block, block.reduce_var) != frame.n:
                raise LiftError(f"block '{block.name}' reduces over "
                                f"{_extent(block, block.reduce_var)} elements, the chain over "
                                f"{frame.n}")
            roles[block.reduce_var] = N_ROLE
        return roles, frame

    @staticmethod
    def _dims(block, buf, terms, roles: dict, old) -> tuple:
        if any(not isinstance(t, int) and t not in roles for t in terms):
            raise LiftError(f"block '{block.name}' indexes '{buf.name}' with a variable that "
                            "is not its own")
        dims = tuple(("const", t) if isinstance(t, int) else roles[t] for t in terms)
        named = [d for d in dims if d[0] != "const"]
        if len(set(named)) != len(named) or (old is not None and old != dims):
            raise LiftError(f"buffer '{buf.name}' is indexed inconsistently (block "
                            f"'{block.name}' reads it as {_show(dims)}, elsewhere {_show(old)})")
        return dims

    def _propagate(self, roles: dict, accesses: list, where: str):
        changed = True
        while changed:
            changed = False
            for buf, terms in accesses:
                known = self.dims.get(buf)
                if known is None or len(known) != len(terms):
                    continue
                for t, role in zip(terms, known, strict=True):
                    if isinstance(t, int) or role[0] == "const":
                        continue
                    if t not in roles:
                        roles[t], changed = role, True
                    elif roles[t] != role:
                        raise LiftError(f"block '{where}': loop `{t}` indexes both "
                                        f"{_show((roles[t],))} and {_show((role,))}")

    @staticmethod
    def _feature(block, v, roles, frame: Frame) -> Frame:
        """An unmatched variable is the feature axis D (one per group)."""
        e = _extent(block, v)
        if D_ROLE not in roles.values() and (frame.d == e or (frame.d is None and
                                                               block.op is not None)):
            roles[v] = D_ROLE
            return Frame(frame.rows, frame.n, e)
        raise LiftError(f"block '{block.name}': loop `{v}` (extent {e}) matches no axis of "
                        f"the chain (rows {frame.rows}, N = {frame.n}, D = {frame.d})")


def _inner_axis(block, loads: dict, roles: dict):
    """The stored variable that indexes the streams *inside* the reduction axis (softmax over
    axis 1 of (B, N, C): C), if there is exactly one: it becomes the feature axis D, so the
    kernel reads contiguous vectors instead of one strided element per row."""
    k, inner, outer = block.reduce_var, set(), set()
    for ld in loads.values():
        at = next((p for p, t in enumerate(ld.terms) if not isinstance(t, int) and
                   t.same_as(k)), None)
        if at is not None:
            inner.update(t for t in ld.terms[at + 1:] if not isinstance(t, int))
            outer.update(t for t in ld.terms[:at] if not isinstance(t, int))
    inner = {v for v in inner - outer if v not in roles}
    return next(iter(inner)) if len(inner) == 1 else None


def _same_var(a, b) -> bool:
    return b is not None and a.same_as(b)


def _extent(block, v) -> int:
    e = block.extents[v]
    if not isinstance(e, int):
        raise LiftError(f"symbolic shape: loop `{v}` of block '{block.name}' has extent `{e}`; "
                        "kernels are generated per shape: specialize the function first, "
                        "func.specialize({param: tvm.tirx.decl_buffer(shape, dtype)})")
    return e


def _show(dims) -> str:
    if dims is None:
        return "nothing"
    return "[" + ", ".join(str(d[1]) if d[0] == "const" else
                           (f"row{d[1]}" if d[0] == "row" else d[0].upper()) for d in dims) + "]"


# -- the whole group ------------------------------------------------------------------------

def group_axes(comp: list, units: list, params: frozenset, exprs: dict) -> Axes:
    """Roles, members, liveness, safety checks and the spec text of one component."""
    uni, kept, notes = _Unifier(), [], []
    members = {u.block.out: u for u in comp}
    for u in comp:
        try:
            _no_unfused_reads(u, exprs, members, kept)
            dims = uni.fit(u.block, exprs[u.pos][1], first=not kept)
            if N_ROLE in dims[u.block.out] or not _all_rows(dims[u.block.out], uni.frame):
                raise LiftError(f"block '{u.block.name}' does not store one value per row")
            kept.append(u)
        except LiftError as e:
            if not kept:
                raise
            notes.append(f"'{u.block.name}' stays unfused: {e}")
    first = kept[0].pos
    outs = {u.block.out: u for u in kept}
    consumers = _consumers(uni, units, exprs, outs, first)
    outs.update({u.block.out: u for u in consumers})
    group = kept + consumers
    inputs = {ld.buffer for u in group for ld in exprs[u.pos][1].values()} - set(outs)
    _check_inputs(inputs, units, first)
    alive = _alive(units, {u.pos for u in group}, params | inputs)
    _check_interleaving(group, alive, inputs, outs)
    needed = params | {b for u in alive for b in u.reads}
    accesses = _bind(uni, group, inputs, needed)
    spec = _spec(kept, consumers, accesses, exprs)
    positions = tuple(sorted(u.pos for u in group))
    dead = tuple(sorted({u.pos for u in units} - set(positions) - {u.pos for u in alive}))
    streamed = any(a.kind == "elementwise" and a.needed for a in accesses)
    trivial = "" if len(kept) > 1 or streamed else (
        "a single reduction with no per-element output after it: already one pass")
    return Axes(tuple(u.block.name for u in kept), tuple(u.block.name for u in consumers),
                spec, uni.frame, accesses, positions, dead, tuple(notes), trivial)


def _no_unfused_reads(u, exprs, members, kept):
    for ld in exprs[u.pos][1].values():
        src = members.get(ld.buffer)
        if src is not None and src is not u and src not in kept:
            raise LiftError(f"it reads '{src.block.name}', which stays unfused")


def _all_rows(dims, frame: Frame) -> bool:
    return all(("row", j) in dims for j in range(len(frame.rows)))


def _consumers(uni: _Unifier, units, exprs, outs, first: int) -> list:
    """Elementwise blocks after the group's first reduction whose value reads its results and
    fits the frame: computed inside the fused kernel (or dropped when nothing needs them)."""
    found = []
    for u in units:
        if u.block is None or u.block.op is not None or u.pos < first or u.pos not in exprs:
            continue
        loads = exprs[u.pos][1]
        if not any(ld.buffer in outs for ld in loads.values()):
            continue
        if any(ld.buffer not in outs and _written_from(ld.buffer, units, first)
               for ld in loads.values()):
            continue
        saved = (dict(uni.dims), uni.frame)
        try:
            dims = uni.fit(u.block, loads, first=False)
            if not _all_rows(dims[u.block.out], uni.frame):
                raise LiftError("not one value per row or element")
            found.append(u)
        except LiftError:
            uni.dims, uni.frame = saved
    return found


def _written_from(buf, units, first: int) -> list:
    return [u for u in units if u.pos >= first and buf in u.writes]


def _check_inputs(inputs, units, first: int):
    for buf in inputs:
        late = _written_from(buf, units, first)
        if late:
            raise LiftError(f"input '{buf.name}' is written by statement {late[0].pos} "
                            f"({_unit_name(late[0])}) after the group starts")
        if buf.dtype != "float32":
            raise LiftError(f"buffer '{buf.name}' is {buf.dtype}: the kernels compute in "
                            "float32")


def _unit_name(u) -> str:
    return f"block '{u.block.name}'" if u.block is not None else "an opaque statement"


def _alive(units, group_pos: set, roots: frozenset) -> list:
    """Statements kept after the rewrite: all but the group's and those that only fed them
    (a block whose output nothing else reads, a parameter or a group input)."""
    alive = [u for u in units if u.pos not in group_pos]
    while True:
        dead = [u for u in alive if u.block is not None and not (u.writes & roots) and not any(
            u.writes & v.reads for v in alive if v is not u)]
        if not dead:
            return alive
        alive = [u for u in alive if u not in dead]


def _check_interleaving(group, alive, inputs, outs):
    """A statement left between the group's blocks must not see the fused kernel run early."""
    first, last = group[0].pos, max(u.pos for u in group)
    for v in alive:
        if not first < v.pos < last:
            continue
        later = {b for b, u in outs.items() if u.pos > v.pos}
        if v.writes & (inputs | set(outs)) or v.reads & later:
            raise LiftError(f"{_unit_name(v)} (statement {v.pos}) sits between the group's "
                            "blocks and touches their buffers")


def _bind(uni: _Unifier, group, inputs, needed) -> tuple[Access, ...]:
    taken: set[str] = set()
    out = []
    for u in group:
        dims = uni.dims[u.block.out]
        kind = "result" if u.block.op else ("elementwise" if N_ROLE in dims else "epilogue")
        out.append(Access(spec_name(u.block.out.name, taken), u.block.out, dims, kind,
                          u.block.out in needed))
    for buf in sorted(inputs, key=lambda b: b.name):
        dims = uni.dims[buf]
        out.append(Access(spec_name(buf.name, taken), buf, dims,
                          "stream" if N_ROLE in dims else "param"))
    return tuple(out)


def _spec(kept, consumers, accesses, exprs) -> str:
    by_buf = {a.buffer: a for a in accesses}
    lines = []
    for u in kept + [c for c in consumers if by_buf[c.block.out].needed]:
        body, loads = exprs[u.pos]
        text = spec_text(body, lambda s, loads=loads: _spelling(by_buf[loads[s].buffer]))
        a = by_buf[u.block.out]
        if u.block.op:
            lines.append(f"{a.name} = {u.block.op}({text})")
        else:
            lines.append(f"{a.name}{'[i]' if a.kind == 'elementwise' else ''} = {text}")
    return "\n".join(lines)


def _spelling(a: Access) -> str:
    if a.kind == "stream":
        return f"{a.name}[i, :]" if a.vector else f"{a.name}[i]"
    if a.kind == "param" and a.vector:
        return f"{a.name}[:]"
    return a.name
