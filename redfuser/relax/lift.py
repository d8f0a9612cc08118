"""Lifting one Relax dataflow block into spec statements, binding by binding.

Every binding whose op has an entry in ``ops.OPS`` becomes a ``Node``: the spec text of its
value plus the fragment (statements and inputs) it needs.  Operands that are not lifted
become kernel inputs, read as streams or per-row parameters by their broadcast shape.
Nothing here changes the module; ``group.py`` decides what is worth fusing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from algebra.dtypes import COMPUTE, STORAGE

from ..tvm.graph import GenericConst, relax
from .frag import Frag, Input, Stmt, Unliftable, computed, fit, merge
from .ops import OPS, SEEDS, unlifted_reason
from .values import Ext, Node, Operand, literal, pad_shape, static_shape


@dataclass
class Lifter:
    """Lifts the bindings of one dataflow block; ``materialise`` lists matmuls to keep,
    ``leaves`` (consumer var, operand var) pairs where the consumer reads the lifted operand
    as the Relax value it is (``recomputed_reads``)."""

    func: object
    block: object
    materialise: frozenset = frozenset()
    leaves: frozenset = frozenset()
    nodes: dict = field(default_factory=dict)  # Relax var -> Node
    failures: dict = field(default_factory=dict)  # Relax var -> (op, reason): reductions
    absorbed: set = field(default_factory=set)  # (consumer var, operand var) read as nodes
    values: dict = field(default_factory=dict)  # every bound var of the function -> value
    quiet: set = field(default_factory=set)  # not reported: chains a handler absorbed
    seq: int = 0
    _inputs: list = field(default_factory=list)  # (Input, name)
    _pending: list = field(default_factory=list)
    current: object = None

    def run(self) -> Lifter:
        for blk in self.func.body.blocks:
            for b in blk.bindings:
                self.values[b.var] = b.value
        for b in self.block.bindings:
            self.current, self._pending = b.var, []
            value, op = b.value, _op_name(b.value)
            handler = OPS.get(op)
            if handler is None:
                reason = unlifted_reason(op, value)
                if reason:
                    self.failures[b.var] = (_short(op), reason)
                continue
            try:
                self.nodes[b.var] = handler(self, value, b.var.ty)
                self.absorbed.update((b.var, v) for v in self._pending)
            except Unliftable as e:
                if op in SEEDS:
                    self.failures[b.var] = (_short(op), str(e))
            except Exception as e:  # noqa: BLE001 - an op form the table does not expect
                # never silent: the binding stays in Relax and the report says why
                self.failures[b.var] = (_short(op), f"lifting failed: {type(e).__name__}: {e}")
        for var in self.quiet:
            self.failures.pop(var, None)
        return self

    # Statements and inputs ------------------------------------------------------------
    def stmt(self, text: str, kind: str, deps, op: str, absorbed: tuple = ()) -> Stmt:
        self.seq += 1
        return Stmt(self.seq, f"t{self.seq}", text, kind, frozenset(deps),
                    f"{_short(op)} {self.current.name}", absorbed)

    def input(self, ext: Ext, kind: str, vector: bool, rows: tuple, frame, n, d=None):
        """Register a kernel input; returns (spec reference, fragment holding it).  Every
        tensor a kernel reads comes through here, so this is where a cascade on tensors
        of other than a storage dtype is refused, before anything is derived or built."""
        computed(ext.dtype)
        inp = Input(ext.source, kind, vector, tuple(rows), ext.prep, ext.storage)
        name = next((name for known, name in self._inputs
                     if known.source.same_as(inp.source) and known.prep == inp.prep
                     and known.kind == kind and known.vector == vector), None)
        if name is None:
            name = f"x{len(self._inputs)}"
            self._inputs.append((inp, name))
        return inp.ref(name), Frag(tuple(frame), n, d, {}, {name: inp})

    # Operands -------------------------------------------------------------------------
    def node(self, expr) -> Node | None:
        """The lifted node of ``expr`` (recorded as read by the current binding)."""
        node = self._lifted(expr)
        if node is not None:
            self._pending.append(expr)
        return node

    def _lifted(self, expr) -> Node | None:
        if not isinstance(expr, relax.Var) or (self.current, expr) in self.leaves:
            return None
        return self.nodes.get(expr)

    def recomputed_reads(self) -> frozenset:
        """Absorbed (consumer, operand) pairs whose consumer also reads an input computed
        from the operand, the operand having a reduction: inlined, the operand's cascade
        would run both before the consumer's kernel and inside it, and the kernel would
        need its own output (BERT's post-LN residual: LayerNorm(f(h) + h) with h a
        LayerNorm).  Read as leaves, the operand is materialised once and read back."""
        parents = {var: relax.analysis.free_vars(value) for var, value in self.values.items()}
        pairs = set()
        for consumer, operand in self.absorbed:
            if consumer not in self.nodes:  # read for its shape only (``idioms``)
                continue
            frag = self.nodes[operand].frag
            if not any(st.kind == "red" for st in frag.stmts.values()):
                continue
            sources = [inp.source for inp in self.nodes[consumer].frag.inputs.values()]
            if any(_depends(src, operand, parents) for src in sources):
                pairs.add((consumer, operand))
        return frozenset(pairs)

    def scalar(self, expr) -> float | None:
        """The value of a float scalar constant (directly or through one binding)."""
        if isinstance(expr, relax.Var) and isinstance(self.values.get(expr), GenericConst):
            expr = self.values[expr]
        if isinstance(expr, GenericConst):
            array = expr.value.numpy()
            if array.ndim == 0 and array.dtype.kind == "f":
                return float(array)
        return None

    def ext(self, expr) -> Ext:
        shape = static_shape(expr.ty)
        source = self.peel(expr)
        return Ext(source, shape, str(expr.ty.dtype), (), str(source.ty.dtype))

    def peel(self, expr):
        """Follow producers that keep element order (reshape, same-shape broadcast, expand,
        squeeze): the kernel reshapes its inputs anyway, so those copies are not needed;
        and a cast of a bfloat16 or float16 tensor to float32 (exact), which the kernel's
        loads do in registers (transformers' ``hidden.to(float32)`` before a norm).  Not
        from a lifted value with a reduction: a kernel's output replaces it, and what it
        was computed from may be gone (a softmax read a GEMM cascade's reshaped result from
        the matmul behind it, which the pass then left in Relax: two kernels, one dead)."""
        while isinstance(expr, relax.Var) and isinstance(self.values.get(expr), relax.Call):
            if expr in self.nodes and self.nodes[expr].frag.reduces:
                break
            call = self.values[expr]
            op = _op_name(call)
            same = op == "relax.broadcast_to" and _same_shape(call.args[0], expr)
            if op not in ("relax.reshape", "relax.expand_dims", "relax.squeeze") and not same \
                    and not _widening(call) or not self.visible(call.args[0]):
                break
            expr = call.args[0]
        return expr

    def producer(self, expr) -> str:
        """The op that computes ``expr`` in this function ("" for an input or a constant)."""
        return _op_name(self.values.get(expr)) if isinstance(expr, relax.Var) else ""

    def visible(self, expr) -> bool:
        """Can the current block read ``expr``? (A dataflow var is local to its block.)"""
        return not isinstance(expr, relax.DataflowVar) or any(
            b.var.same_as(expr) for b in self.block.bindings)

    def elem(self, expr, out: tuple) -> Operand:
        """``expr`` read per element of a stream of length out[-1] on rows out[:-1]; a
        lifted value that cannot be read so is read as the Relax value it is."""
        if isinstance(expr, Ext):
            return self._external(expr, out)
        value = self.scalar(expr)
        if value is not None:
            return Operand(literal(value))
        node = self._lifted(expr)
        if node is not None:
            try:
                operand = self._node_elem(node, out)
                self._pending.append(expr)
                return operand
            except Unliftable:
                pass
        return self._external(self.ext(expr), out)

    def _node_elem(self, node: Node, out: tuple) -> Operand:
        frame, n = out[:-1], out[-1]
        if node.kind == "row" and node.shape and node.shape[-1] == 1 and len(node.shape) > 1:
            return Operand(node.text, node.deps, fit(node.frag, frame))
        if node.kind != "elem" or node.shape[-1] != n or node.frag.n != n or node.perm:
            raise Unliftable(f"a {node.kind} value {node.shape} read per element of {out}")
        return Operand(node.text, node.deps, fit(node.frag, frame), node.terms, node.dots)

    def row(self, expr, out: tuple, keepdims: bool) -> Operand:
        """``expr`` read once per row; ``out`` is the row value's shape (keepdims: trailing 1)."""
        value = self.scalar(expr)
        if value is not None:
            return Operand(literal(value))
        frame = out[:-1] if keepdims else out
        node = self.node(expr)
        if node is None:
            ext = self.ext(expr)
            rows = pad_shape(ext.shape, len(out), out)
            if keepdims and rows[-1] != 1:
                raise Unliftable(f"{ext.shape} is not one value per row")
            ref, frag = self.input(ext, "param", False, rows[:-1] if keepdims else rows, frame, 0)
            return Operand(ref, frozenset(), frag)
        if node.kind != "row" or pad_shape(node.shape, len(out), out) != tuple(out):
            raise Unliftable(f"{node.kind} value {node.shape} read as a row value {out}")
        return Operand(node.text, node.deps, fit(node.frag, frame))

    def feature(self, expr, out: tuple) -> Operand:
        """``expr`` read as a per-row feature vector of shape ``out`` (..., D): a matmul's
        result, a per-row value or a constant broadcast over the features, or an input
        (a bias (D,), a residual (..., D)) read as a vector parameter."""
        node = self.node(expr)
        if node is not None and node.kind == "vec" and node.shape == tuple(out):
            return Operand(node.text, node.deps, node.frag)
        if node is not None or self.scalar(expr) is not None:
            return self.row(expr, out[:-1] + (1,), True)
        ext = self.ext(expr)
        rows = pad_shape(ext.shape, len(out), out)
        vector = rows[-1] > 1
        ref, frag = self.input(ext, "param", vector, rows[:-1], out[:-1], 0,
                               out[-1] if vector else None)
        return Operand(ref, frozenset(), frag)

    def _external(self, ext: Ext, out: tuple) -> Operand:
        shape = pad_shape(ext.shape, len(out), out)
        if shape[-1] == out[-1] and out[-1] > 1:
            ref, frag = self.input(ext, "stream", False, shape[:-1], out[:-1], out[-1])
        elif shape[-1] == 1:
            ref, frag = self.input(ext, "param", False, shape[:-1], out[:-1], out[-1])
        else:
            raise Unliftable(f"{ext.shape} does not broadcast to {out}")
        return Operand(ref, frozenset(), frag)

    def combine(self, operands: list[Operand], frame) -> Frag:
        """One fragment for all non-literal operands (parameters carry no stream length)."""
        frags = [o.frag for o in operands if o.frag is not None]
        if not frags:
            raise Unliftable("only constants")
        lengths = {f.n for f in frags if f.n}
        if len(lengths) > 1:
            raise Unliftable(f"stream lengths {sorted(lengths)} differ")
        return merge(frags, tuple(frame), lengths.pop() if lengths else 0)


def _depends(expr, var, parents: dict) -> bool:
    """Is ``expr`` computed from ``var`` (through the function's bindings)?"""
    todo, seen = [expr], set()
    while todo:
        e = todo.pop()
        if e.same_as(var):
            return True
        if e in seen or e not in parents:
            continue
        seen.add(e)
        todo.extend(parents[e])
    return False


def _widening(call) -> bool:
    """A cast of a lower-precision storage dtype to float32: exact, a load's conversion."""
    return (_op_name(call) == "relax.astype" and str(call.attrs.dtype) == COMPUTE.name
            and str(call.args[0].ty.dtype) in STORAGE)


def _same_shape(a, b) -> bool:
    try:
        return static_shape(a.ty) == static_shape(b.ty)
    except Unliftable:
        return False


def _op_name(value) -> str:
    if isinstance(value, relax.TupleGetItem):
        return "TupleGetItem"
    if isinstance(value, relax.Tuple):
        return "Tuple"
    op = getattr(value, "op", None)
    return getattr(op, "name", "") if isinstance(value, relax.Call) else ""


def _short(op: str) -> str:
    return op.replace("relax.nn.", "").replace("relax.", "")

