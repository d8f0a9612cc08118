"""Stages 1-2, parse and lift: spec text -> a ``Cascade`` of sympy reductions.

The spec is parsed with Python's own ``ast`` (so ``;`` and ``#`` work and every node
has a line and column); each statement is then lifted to sympy (its expressions by
``algebra.expressions``).  Lets are substituted, reductions inside epilogues are hoisted
into hidden results, and a small shape lattice (scalar / feature vector / unknown / k
values) rejects what can never run.  Every problem surfaces as ``SpecError`` with its position.
"""

from __future__ import annotations

import ast

import sympy as sp

from .cascade import (
    INDEX,
    LENGTH,
    POSITION,
    Cascade,
    N,
    Reduction,
    Shape,
    carries_feature_axis,
    epilogue_assumptions,
)
from .errors import NotFusable, SpecError
from .expressions import ExpressionLifter, Value, call_name, fail, index_of
from .laws import LAWS
from .limits import (
    MAX_DEPTH,
    MAX_REDUCTIONS,
    budget_raises,
    check_text,
    check_tree,
    degree_problem,
)
from .names import fresh, spec_names
from .selects import MAX_CONDITIONS, conditions, lift

CONSTANTS = {"pi": sp.pi, "inf": sp.oo}
OUT = "out"  # kernels take their preallocated outputs as out=: no input may be named so


class _Lifter(ExpressionLifter):
    """Walks the statements once, in order, building the Cascade."""

    def __init__(self, text: str, tree: ast.Module):
        self.text, self.tree = text, tree
        self.assigned = {_target_name(s): s for s in tree.body}  # name -> defining statement
        self.defined: dict[str, Value] = {}  # lets, results and per-element outputs so far
        self.kind: dict[str, str] = {}  # input name -> "stream" | "param"
        self.vector: set[str] = set()
        self.reductions: list[Reduction] = []
        self.epilogues: dict[str, sp.Expr] = {}
        self.elementwise: dict[str, sp.Expr] = {}
        self.outputs: list[str] = []
        self.shapes: dict[str, Shape] = {}
        self.in_body: ast.AST | None = None  # the reduction call whose body is being lifted
        self.read: set[str] = set()  # assigned names read by a later statement
        self.target = ""
        # (size, depth) of each lifted node with its lets substituted, and of each let
        self.cost: dict[ast.AST, tuple[int, int]] = {}
        self.let_cost: dict[str, tuple[int, int]] = {}
        # hidden results are named fresh against every name the text spells, also the inputs
        # it only reads later (t = max(x[i]) + t_max)
        self.names = spec_names(tree, [INDEX, LENGTH, OUT, *CONSTANTS])

    def run(self) -> Cascade:
        for stmt in self.tree.body:
            with budget_raises(lambda why, s=stmt: SpecError(why, s.lineno, s.col_offset + 1)):
                self.statement(stmt)
        self.check()
        streams = tuple(sp.Symbol(n, real=True) for n, k in self.kind.items() if k == "stream")
        params = tuple(sp.Symbol(n, real=True) for n, k in self.kind.items() if k == "param")
        return Cascade(self.text, streams, params, frozenset(self.vector), tuple(self.reductions),
                       self.epilogues, self.elementwise, tuple(self.outputs), self.shapes,
                       frozenset(self.names))

    def check(self):
        """Whole-spec checks, once every feature axis is known."""
        if not self.reductions and not self.elementwise:  # a map (y[i] = ...) is a cascade
            raise SpecError("the spec has no reduction (sum, max, min, prod, argmax, argmin, "
                            "topk, argtopk) and no per-element output (y[i] = ...)", 1, 1)
        for name, stmt in self.assigned.items():
            if name not in self.outputs and name not in self.read:
                fail(stmt, f"'{name}' is computed but never used: write {name}[i] = ... for "
                           "a per-element output, or use it in a reduction")
        for r in self.reductions:
            law = LAWS[r.op]
            if (law.takes_k or law.returns == "index") and carries_feature_axis(r.body,
                                                                                self.vector):
                raise SpecError(f"{r.op}() needs a scalar per element, but its body reads "
                                "a feature-axis vector", r.line, r.col)

    # Step 1. Statements -------------------------------------------------------------
    def statement(self, stmt: ast.stmt):
        self.target = name = _target_name(stmt)
        per_element = isinstance(stmt.targets[0], ast.Subscript)
        if per_element:
            index_of(stmt.targets[0])
        if name in (INDEX, LENGTH, OUT) or name in CONSTANTS:
            fail(stmt, f"'{name}' is reserved and cannot be assigned")
        if name in self.defined or name in self.elementwise:
            fail(stmt, f"'{name}' is assigned twice")
        value = stmt.value
        if isinstance(value, ast.Call) and call_name(value) in LAWS and not per_element:
            self.reduction(name, value, hidden=False)
            self.outputs.append(name)
            return
        val = self.expr(value)
        if val.boolean and (per_element or val.reduces):
            fail(value, f"'{name}' is a condition (true or false), not a number: a result "
                        "must be a number, e.g. where(cond, 1, 0)")
        if not val.boolean:
            val = Value(lift(val.expr), val.shape, val.reduces)  # selects at the top
        streamed = bool(val.expr.free_symbols & (self._streams() | {POSITION}))
        if streamed and val.shape.k:
            fail(value, "shape mismatch: top-k values combined with a per-element value")
        self.let_cost[name] = self.cost[value]
        if per_element:
            self.elementwise[name] = val.expr
            self.outputs.append(name)
        elif val.reduces and not streamed:
            self.epilogues[name] = val.expr
            self.outputs.append(name)
            sym = sp.Symbol(name, **epilogue_assumptions(val.expr))
            self.defined[name] = Value(sym, val.shape, True)
            self.shapes[name] = val.shape
            return
        self.defined[name] = val  # a let: substituted wherever it is read

    def reduction(self, name: str, call: ast.Call, hidden: bool) -> Value:
        op = call_name(call)
        law = LAWS[op]
        if len(self.reductions) >= MAX_REDUCTIONS.value:
            fail(call, MAX_REDUCTIONS.refusal(f"this is reduction {len(self.reductions) + 1}"))
        if self.in_body is not None:
            fail(call, f"reduction '{op}' nested inside the body of another reduction "
                       f"(line {self.in_body.lineno}); give the inner one its own statement")
        nargs = 2 if law.takes_k else 1
        if len(call.args) != nargs or call.keywords:
            fail(call, f"{op}() takes {'(expr, k)' if law.takes_k else 'one expression'}")
        k = _int_literal(call.args[1]) if law.takes_k else None
        self.in_body = call
        try:
            body = self.number(call.args[0], f"the body of {op}()")
        finally:
            self.in_body = None
        body = Value(lift(body.expr), body.shape, body.reduces)  # selects at the top
        results = {r.name for r in self.reductions} | set(self.epilogues)
        too_high = degree_problem(body.expr, results, {*self._stream_names(), INDEX})
        if too_high:  # before any stage expands it
            raise NotFusable(name, *too_high)
        if len(conditions(body.expr)) > MAX_CONDITIONS:
            fail(call.args[0], f"{op}() body has more than {MAX_CONDITIONS} distinct where() "
                               "conditions: each one doubles the cases to prove")
        if (law.returns != "value" or law.takes_k) and body.shape.vec:
            fail(call.args[0], f"{op}() needs a scalar per element, not a feature-axis vector")
        if body.shape.k:
            fail(call.args[0], f"{op}() over top-k values: reduce the stream, not a result")
        results = {r.symbol for r in self.reductions} | {
            sp.Symbol(n, **epilogue_assumptions(e)) for n, e in self.epilogues.items()}
        anchors = tuple(sorted(body.expr.free_symbols & results, key=str))
        red = Reduction(name, op, body.expr, k, anchors, call.lineno, call.col_offset + 1)
        self.reductions.append(red)
        shape = Shape(False, k) if law.takes_k else Shape(body.shape.vec if
                                                          law.returns == "value" else False)
        self.shapes[name] = shape
        val = Value(red.symbol, shape, True)
        if not hidden:
            self.defined[name] = val
        return val

    # Step 2. Names ------------------------------------------------------------------
    def name(self, name: str, node: ast.AST, subscripted: bool) -> Value:
        if name == INDEX:
            return Value(POSITION, Shape())
        if name == LENGTH:
            return Value(N, Shape())
        if name in CONSTANTS:
            return Value(CONSTANTS[name], Shape())
        if name in self.elementwise:
            self.read.add(name)
            return Value(self.elementwise[name], Shape(None))
        if name in self.defined:
            self.read.add(name)
            return self.defined[name]
        if name in self.assigned:
            later = self.assigned[name]
            reads = {n.id for n in ast.walk(later.value) if isinstance(n, ast.Name)}
            if name == self.target or self.target in reads:
                fail(node, f"cycle: '{self.target}' and '{name}' are defined in terms of "
                           "each other" if name != self.target else
                           f"cycle: '{name}' is defined in terms of itself")
            fail(node, f"'{name}' is used before its definition on line {later.lineno}")
        if name == OUT:
            fail(node, f"'{OUT}' is reserved (kernels take preallocated outputs as {OUT}=)")
        kind = "stream" if subscripted else "param"
        if self.kind.setdefault(name, kind) != kind:
            fail(node, f"'{name}' is used both as a stream ({name}[i]) and as a per-row "
                       f"parameter ({name})")
        return Value(sp.Symbol(name, real=True), Shape(True if name in self.vector else None))

    def _declare_vector(self, name: str, node: ast.AST):
        if name not in self.kind:
            fail(node, f"'{name}' is computed, not an input: its feature axis follows "
                       "from its definition")
        self.vector.add(name)

    def _streams(self) -> set[sp.Symbol]:
        return {sp.Symbol(n, real=True) for n in self._stream_names()}

    def _stream_names(self) -> list[str]:
        return [n for n, k in self.kind.items() if k == "stream"]

    def _hidden_name(self, op: str) -> str:
        return fresh(f"{self.target}_{op}", self.names)


def _target_name(stmt: ast.stmt) -> str:
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        fail(stmt, "each statement must be a single assignment 'name = expression'")
    t = stmt.targets[0]
    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
        return t.value.id
    if not isinstance(t, ast.Name):
        fail(t, f"cannot assign to {ast.unparse(t)!r}: write 'name = ...' or 'name[i] = ...'")
    return t.id


def _int_literal(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value > 0:
        return node.value
    fail(node, f"k must be a positive integer literal, not {ast.unparse(node)!r}")


def parse(text: str) -> Cascade:
    """Parse and lift a cascade spec.

    Examples
    --------
    >>> c = parse("m = max(x[i]); d = sum(exp(x[i] - m))")
    >>> [(r.name, r.op, r.body, r.anchors) for r in c.reductions]
    [('m', 'max', x, ()), ('d', 'sum', exp(-m + x), (m,))]
    """
    if not isinstance(text, str):
        raise SpecError(f"a spec is a string, not {type(text).__name__}")
    longest = check_text(text)  # size limits, before Python's parser sees the text
    for pos, ch in enumerate(text):
        if ch == "\0" or 0xD800 <= ord(ch) <= 0xDFFF:  # NUL or a lone surrogate
            line = text.count("\n", 0, pos) + 1
            col = pos - (text.rfind("\n", 0, pos) + 1) + 1
            raise SpecError(f"unreadable character {ch!r}", line, col)
    try:
        tree = ast.parse(text, mode="exec")
    except SyntaxError as e:
        raise SpecError(f"syntax error: {e.msg}", e.lineno or 1, e.offset or 1) from None
    except (RecursionError, MemoryError):  # the parser's own depth limit, lower on a deep stack
        raise SpecError(MAX_DEPTH.refusal("the statement that starts here nests too deeply "
                                          "for Python's parser"), *longest) from None
    check_tree(tree)  # nesting, before the lifter recurses over the tree
    if not tree.body:
        raise SpecError("empty spec: write at least one reduction, e.g. 'm = max(x[i])'", 1, 1)
    return _Lifter(text, tree).run()
