"""From lifted nodes to cascades: which values leave a kernel, and the spec that computes them.

A *sink* is a lifted value that depends on a reduction and is read by something that was
not lifted with it (another op, the function's result).  Sinks that share a reduction are
computed by one kernel when their fragments fit one frame (one stream length, one
feature length); otherwise each gets its own.  The spec of a group is the closure of its
sinks' statements; a group is a *cascade* when a reduction or a per-element output reads
an earlier reduction's result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from algebra.dtypes import COMPUTE, STORAGE

from ..report import GroupReport
from ..tvm.graph import relax
from .frag import Frag, Stmt, Unliftable, closure, merge
from .lift import Lifter


@dataclass
class BindingGroup:
    """One candidate kernel: its fragment, the Relax values it replaces, and its spec."""

    frag: Frag
    sinks: list = field(default_factory=list)  # (Relax var, Node)
    spec: str = ""
    outputs: dict = field(default_factory=dict)  # Relax var -> spec output names
    needed: list = field(default_factory=list)  # statements of the spec, in order
    elem_dots: frozenset = frozenset()  # inlined matmuls read again by per-element outputs
    # per-element sinks the model reads only through a cast to a low-precision dtype: sink
    # var -> the cast's var (``narrowed``); the kernel stores them in ``out_dtype``
    casts: dict = field(default_factory=dict)
    out_dtype: str = COMPUTE.name

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(op for s in self.needed for op in (s.op, *s.absorbed)))

    @property
    def values(self) -> tuple[str, ...]:
        return tuple(v.name for v, _ in self.sinks)

    @property
    def read(self) -> frozenset[str]:
        """The spec outputs a Relax value takes: the kernel's outputs (the other results
        stay inside it)."""
        return frozenset(name for names in self.outputs.values() for name in names)


def readers(lf: Lifter) -> dict:
    """Each Relax var of the function -> the vars of the bindings that read it (None: the
    function's result)."""
    out: dict = {}
    for blk in lf.func.body.blocks:
        for b in blk.bindings:
            for v in relax.analysis.free_vars(b.value):
                out.setdefault(v, []).append(b.var)
    for v in relax.analysis.free_vars(lf.func.body.body):
        out.setdefault(v, []).append(None)
    return out


def sinks(lf: Lifter) -> list:
    """Lifted values with a reduction that something outside their own lifting reads."""
    read = readers(lf)
    return [(v, node) for v, node in lf.nodes.items() if node.frag.reduces
            and any((r, v) not in lf.absorbed for r in read.get(v, []))]


def narrowed(lf: Lifter, g: BindingGroup) -> None:
    """The dtype the kernel stores the group's per-element outputs and feature vectors in:
    their own where the model computes them in bfloat16 or float16 (``frag.computed``);
    else, where each one is read only by a cast to the same bfloat16 or float16 dtype in
    this block (transformers' ``softmax(..., dtype=float32).to(query.dtype)``), that dtype,
    the cast folded into the kernel's stores (rounding once to nearest even, as the cast
    does) and its value the kernel's output.  Otherwise (float32, or dtypes that differ)
    float32, and a low-precision value is cast from it (``rewrite._stored``)."""
    here, read, casts, dtypes = {b.var for b in lf.block.bindings}, readers(lf), {}, set()
    # feature vectors (a GEMM's y, attention's o) are stored as per-element outputs are
    for v in (v for v, node in g.sinks if node.kind in ("elem", "vec")):
        (reader, *more) = read.get(v, [None])
        if str(v.ty.dtype) != COMPUTE.name:
            dtypes.add(str(v.ty.dtype))
        elif not more and reader in here and _narrowing(lf.values.get(reader)):
            casts[v] = reader
            dtypes.add(str(lf.values[reader].attrs.dtype))
        else:
            dtypes.add(COMPUTE.name)
    if len(dtypes) == 1:
        g.casts, g.out_dtype = casts, dtypes.pop()


def _narrowing(value) -> bool:
    """A cast of a float32 tensor to a lower-precision storage dtype."""
    return (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.astype"
            and str(value.args[0].ty.dtype) == COMPUTE.name
            and str(value.attrs.dtype) in STORAGE and str(value.attrs.dtype) != COMPUTE.name)


def form_groups(lf: Lifter) -> list[BindingGroup]:
    """Sinks sharing a reduction, one group per frame that holds them all."""
    groups: list[BindingGroup] = []
    for var, node in sinks(lf):
        reds = _reductions(node.frag)
        for g in groups:
            if reds & _reductions(g.frag):
                try:
                    g.frag = merge([g.frag, node.frag], g.frag.frame, g.frag.n)
                except Unliftable:
                    continue
                g.sinks.append((var, node))
                break
        else:
            groups.append(BindingGroup(node.frag, [(var, node)]))
    for g in groups:
        _write_spec(g)
        narrowed(lf, g)
    return [g for g in groups if is_cascade(g)]


def _reductions(frag: Frag) -> set[str]:
    return {name for name, s in frag.stmts.items() if s.kind == "red"}


def _write_spec(g: BindingGroup):
    """The spec text: needed statements in order, then one line per per-element output."""
    lines, reads, dots = [], set(), frozenset()
    for var, node in g.sinks:
        names = []
        for f in node.fields or (node,):
            if f.kind == "elem":
                out = "o" + f.text[1:]
                lines.append(f"{out}[i] = {f.text}")
                dots |= f.dots
                names.append(out)
            else:
                names.append(f.text)
            reads |= f.deps
        g.outputs[var] = tuple(names)
    g.needed = closure(g.frag.stmts, reads)
    g.elem_dots = dots
    g.spec = "\n".join([f"{s.name} = {s.text}" for s in g.needed] + list(dict.fromkeys(lines)))


def is_cascade(g: BindingGroup) -> bool:
    """Does a reduction, or a per-element value that is output, read an earlier result?"""
    stmts = {s.name: s for s in g.needed}
    results = {s.name for s in g.needed if s.kind != "let"}
    readers = [s for s in g.needed if s.kind == "red"]
    for _var, node in g.sinks:
        readers += [stmts[f.text] for f in node.fields or (node,)
                    if f.kind == "elem" and f.text in stmts]
    return any(_reads_result(s, stmts, results) for s in readers)


def _reads_result(stmt: Stmt, stmts: dict, results: set) -> bool:
    todo, seen = list(stmt.deps), set()
    while todo:
        name = todo.pop()
        if name in results:
            return True
        if name in stmts and name not in seen:
            seen.add(name)
            todo.extend(stmts[name].deps)
    return False


SINGLE = "a single reduction with no per-element output after it: already one pass"


def skipped_entries(fname: str, lifter: Lifter, groups: list[BindingGroup]) -> list[GroupReport]:
    """Report entries for every reduction no group holds, so that no reduction the pass
    meets goes unmentioned: each op that could not be lifted, with the reason (another
    axis, an op with no lifting), and each lifted reduction that no cascade holds, as
    already one pass (as the TensorIR pass reports it)."""
    out = [GroupReport(fname, (var.name,), False, reason, (f"{op} {var.name}",))
           for var, (op, reason) in lifter.failures.items()]
    held = {s.name for g in groups for s in g.needed}
    for var, node in lifter.nodes.items():
        op = f"{_op_of(node, var)} {var.name}"
        mine = [s for s in node.frag.stmts.values() if s.kind == "red" and s.op == op]
        if mine and not any(s.name in held for s in mine):
            out.append(GroupReport(fname, (var.name,), False, SINGLE, (op,),
                                   "\n".join(f"{s.name} = {s.text}" for s in mine)))
    return out


def _op_of(node, var) -> str:
    """The op name a node's own statements carry ("sum lv3" -> "sum")."""
    own = [s.op for s in node.frag.stmts.values() if s.op.endswith(f" {var.name}")]
    return own[0].split()[0] if own else ""
