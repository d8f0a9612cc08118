"""Stages 1-2, parse and lift: spec text -> a ``Cascade`` of sympy reductions.

The spec is parsed with Python's own ``ast`` (so ``;`` and ``#`` work and every node
has a line and column); each statement is then lifted to sympy.  Lets are
substituted, reductions inside epilogues are hoisted into hidden results, and a
small shape lattice (scalar / feature vector / unknown / k values) rejects what
can never run.  Every problem surfaces as ``SpecError`` with its position.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass

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
from .functions import (
    COMPARISONS,
    CONNECTIVES,
    FUNCTIONS,
    AsWritten,
    Dot,
    as_written,
    ieee_not,
)
from .laws import LAWS
from .limits import (
    MAX_DEPTH,
    MAX_REDUCTIONS,
    budget_raises,
    check_text,
    check_tree,
    combined,
    degree_problem,
    node_problem,
    power_problem,
)
from .names import fresh, spec_names
from .selects import MAX_CONDITIONS, conditions, lift

CONSTANTS = {"pi": sp.pi, "inf": sp.oo}
# one-argument functions whose sympy value is their own node unless sympy folded it
_NATURAL = {f: f for f in (sp.exp, sp.log, sp.Abs, sp.tanh, sp.sin, sp.cos, sp.erf, sp.floor,
                           sp.ceiling, sp.sign)}
OUT = "out"  # kernels take their preallocated outputs as out=: no input may be named so


def _fail(node: ast.AST, message: str):
    raise SpecError.at(node, message)


@dataclass
class _Val:
    expr: sp.Expr
    shape: Shape
    reduces: bool = False  # contains a reduction (hoisted) result
    boolean: bool = False  # a condition (comparison, and/or/not): never a number


class _Lifter:
    """Walks the statements once, in order, building the Cascade."""

    def __init__(self, text: str, tree: ast.Module):
        self.text, self.tree = text, tree
        self.assigned = {_target_name(s): s for s in tree.body}  # name -> defining statement
        self.defined: dict[str, _Val] = {}  # lets, results and per-element outputs so far
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
        if not self.reductions:
            raise SpecError("the spec has no reduction (sum, max, min, prod, argmax, argmin, "
                            "topk, argtopk)", 1, 1)
        for name, stmt in self.assigned.items():
            if name not in self.outputs and name not in self.read:
                _fail(stmt, f"'{name}' is computed but never used: write {name}[i] = ... for "
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
            _index_of(stmt.targets[0])
        if name in (INDEX, LENGTH, OUT) or name in CONSTANTS:
            _fail(stmt, f"'{name}' is reserved and cannot be assigned")
        if name in self.defined or name in self.elementwise:
            _fail(stmt, f"'{name}' is assigned twice")
        value = stmt.value
        if isinstance(value, ast.Call) and _fname(value) in LAWS and not per_element:
            self.reduction(name, value, hidden=False)
            self.outputs.append(name)
            return
        val = self.expr(value)
        if val.boolean and (per_element or val.reduces):
            _fail(value, f"'{name}' is a condition (true or false), not a number: a result "
                         "must be a number, e.g. where(cond, 1, 0)")
        if not val.boolean:
            val = _Val(lift(val.expr), val.shape, val.reduces)  # selects at the top
        streamed = bool(val.expr.free_symbols & (self._streams() | {POSITION}))
        if streamed and val.shape.k:
            _fail(value, "shape mismatch: top-k values combined with a per-element value")
        self.let_cost[name] = self.cost[value]
        if per_element:
            self.elementwise[name] = val.expr
            self.outputs.append(name)
        elif val.reduces and not streamed:
            self.epilogues[name] = val.expr
            self.outputs.append(name)
            sym = sp.Symbol(name, **epilogue_assumptions(val.expr))
            self.defined[name] = _Val(sym, val.shape, True)
            self.shapes[name] = val.shape
            return
        self.defined[name] = val  # a let: substituted wherever it is read

    def reduction(self, name: str, call: ast.Call, hidden: bool) -> _Val:
        op = _fname(call)
        law = LAWS[op]
        if len(self.reductions) >= MAX_REDUCTIONS.value:
            _fail(call, MAX_REDUCTIONS.refusal(f"this is reduction {len(self.reductions) + 1}"))
        if self.in_body is not None:
            _fail(call, f"reduction '{op}' nested inside the body of another reduction "
                        f"(line {self.in_body.lineno}); give the inner one its own statement")
        nargs = 2 if law.takes_k else 1
        if len(call.args) != nargs or call.keywords:
            _fail(call, f"{op}() takes {'(expr, k)' if law.takes_k else 'one expression'}")
        k = _int_literal(call.args[1]) if law.takes_k else None
        self.in_body = call
        try:
            body = self.number(call.args[0], f"the body of {op}()")
        finally:
            self.in_body = None
        body = _Val(lift(body.expr), body.shape, body.reduces)  # selects at the top
        results = {r.name for r in self.reductions} | set(self.epilogues)
        too_high = degree_problem(body.expr, results, {*self._stream_names(), INDEX})
        if too_high:  # before any stage expands it
            raise NotFusable(name, *too_high)
        if len(conditions(body.expr)) > MAX_CONDITIONS:
            _fail(call.args[0], f"{op}() body has more than {MAX_CONDITIONS} distinct where() "
                                "conditions: each one doubles the cases to prove")
        if (law.returns != "value" or law.takes_k) and body.shape.vec:
            _fail(call.args[0], f"{op}() needs a scalar per element, not a feature-axis vector")
        if body.shape.k:
            _fail(call.args[0], f"{op}() over top-k values: reduce the stream, not a result")
        results = {r.symbol for r in self.reductions} | {
            sp.Symbol(n, **epilogue_assumptions(e)) for n, e in self.epilogues.items()}
        anchors = tuple(sorted(body.expr.free_symbols & results, key=str))
        red = Reduction(name, op, body.expr, k, anchors, call.lineno, call.col_offset + 1)
        self.reductions.append(red)
        shape = Shape(False, k) if law.takes_k else Shape(body.shape.vec if
                                                          law.returns == "value" else False)
        self.shapes[name] = shape
        val = _Val(red.symbol, shape, True)
        if not hidden:
            self.defined[name] = val
        return val

    # Step 2. Expressions ------------------------------------------------------------
    def expr(self, node: ast.AST) -> _Val:
        method = getattr(self, "e_" + type(node).__name__, None)
        if method is None:
            _fail(node, f"unsupported syntax: {ast.unparse(node)!r}")
        val = method(node)
        self._charge(node, val)
        return val

    def _charge(self, node: ast.AST, val: _Val):
        """Bound what the node built, its lets substituted: (size, depth) from its children's
        (``limits.combined``), its constants and powers (``limits.node_problem``)."""
        if isinstance(node, ast.Name):
            cost = self.let_cost.get(node.id, (1, 0))
        elif isinstance(node, ast.Call) and _fname(node) in LAWS:
            cost = (1, 0)  # the body is the reduction's; here stands its result
        else:
            cost = combined(self.cost[c] for c in ast.iter_child_nodes(node) if c in self.cost)
        self.cost[node] = cost
        problem = node_problem(cost, val.expr)
        if problem:
            _fail(node, problem)

    def e_Constant(self, node):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            _fail(node, f"unsupported constant {node.value!r}")
        return _Val(sp.nsimplify(node.value) if isinstance(node.value, float) else
                    sp.Integer(node.value), Shape())

    def number(self, node: ast.AST, role: str = "") -> _Val:
        """An expression used as a number: a condition here is an error."""
        v = self.expr(node)
        if v.boolean:
            where = f" in {role}" if role else ""
            _fail(node, f"'{ast.unparse(node)}' is a condition (true or false), used as a "
                        f"number{where}: write where({ast.unparse(node)}, 1, 0)")
        return v

    def condition(self, node: ast.AST, role: str) -> _Val:
        v = self.expr(node)
        if not v.boolean:
            _fail(node, f"{role} needs a condition (a comparison such as i <= pos, joined with "
                        f"and/or/not), not the number '{ast.unparse(node)}'")
        return v

    def e_UnaryOp(self, node):
        if isinstance(node.op, (ast.Not, ast.Invert)):  # numpy spells not as ~
            word = "'not'" if isinstance(node.op, ast.Not) else "'~' (numpy's not)"
            v = self.condition(node.operand, word)
            return _Val(ieee_not(v.expr), v.shape, v.reduces, True)
        v = self.number(node.operand)
        if isinstance(node.op, ast.USub):
            return _Val(-v.expr, v.shape, v.reduces)
        if isinstance(node.op, ast.UAdd):
            return v
        _fail(node, f"unsupported operator in {ast.unparse(node)!r}")

    def e_Compare(self, node):
        """``a < b``, ``a <= b < c`` (chained: each adjacent pair, joined with and)."""
        sides = [self.number(node.left), *(self.number(c) for c in node.comparators)]
        parts, shape = [], sides[0].shape
        for op, a, b in zip(node.ops, sides, sides[1:], strict=False):
            shape = shape.join(b.shape, node)
            try:
                parts.append(as_written(COMPARISONS[type(op).__name__], a.expr, b.expr))
            except (KeyError, TypeError):  # 'is', 'in'; or a comparison sympy finds undefined
                _fail(node, f"cannot compare in {ast.unparse(node)!r}: use < <= > >= == != "
                            "between real numbers")
        return _Val(sp.And(*parts), shape, any(v.reduces for v in sides), True)

    def e_BoolOp(self, node):
        vals = [self.condition(v, f"'{type(node.op).__name__.lower()}'") for v in node.values]
        shape = vals[0].shape
        for v in vals[1:]:
            shape = shape.join(v.shape, node)
        return _Val(CONNECTIVES[type(node.op).__name__](*(v.expr for v in vals)), shape,
                    any(v.reduces for v in vals), True)

    def e_BinOp(self, node):
        if isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
            return self._connective(node)
        a, b = self.number(node.left), self.number(node.right)
        ops = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y,
               ast.Mult: lambda x, y: x * y, ast.Div: lambda x, y: x / y,
               ast.Pow: lambda x, y: x ** y}
        fn = ops.get(type(node.op))
        if fn is None:
            _fail(node, f"unsupported operator in {ast.unparse(node)!r}")
        if isinstance(node.op, ast.Pow):
            self._check_power(node, a.expr, b.expr)
        if isinstance(node.op, ast.Div) and b.expr.is_zero:  # a typo, surely: say so
            _fail(node, f"'{ast.unparse(node)}' is undefined (division by the constant 0)")
        value = as_written(fn, a.expr, b.expr)
        if _undefined(value):
            _fail(node, f"'{ast.unparse(node)}' is undefined (a complex value)")
        return _Val(value, a.shape.join(b.shape, node), a.reduces or b.reduces)

    def _connective(self, node):
        """numpy's spelling of the connectives on conditions: ``&`` and, ``|`` or, ``^`` xor
        (numpy's ``(a < b) & (c > d)``); on numbers they are bitwise operators, which a spec
        of float values has no use for."""
        symbol = {ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^"}[type(node.op)]
        sides = []
        for side in (node.left, node.right):
            v = self.expr(side)
            if not v.boolean:
                _fail(side, f"'{symbol}' joins conditions (numpy's elementwise and/or/xor), "
                            f"but '{ast.unparse(side)}' is a number; compare it first, and "
                            f"mind that '{symbol}' binds tighter than a comparison: write "
                            f"(a < b) {symbol} (c < d)")
            sides.append(v)
        a, b = sides
        join = {ast.BitAnd: sp.And, ast.BitOr: sp.Or,
                ast.BitXor: lambda p, q: sp.Or(sp.And(p, ieee_not(q)), sp.And(ieee_not(p), q))}
        return _Val(join[type(node.op)](a.expr, b.expr), a.shape.join(b.shape, node),
                    a.reduces or b.reduces, True)

    def e_Name(self, node):
        return self.name(node.id, node, subscripted=False)

    def e_Subscript(self, node):
        if not isinstance(node.value, ast.Name):
            _fail(node, f"only a name can be indexed, not {ast.unparse(node.value)!r}")
        vector = _index_of(node)
        if vector is None:  # g[:] : a per-row parameter with a feature axis
            val = self.name(node.value.id, node, subscripted=False)
            self._declare_vector(node.value.id, node)
            return _Val(val.expr, Shape(True), val.reduces)
        val = self.name(node.value.id, node, subscripted=True)
        if vector:
            self._declare_vector(node.value.id, node)
            val = _Val(val.expr, Shape(True), val.reduces)
        return val

    def e_Call(self, node):
        fname = _fname(node)
        if fname in LAWS:
            if self.in_body is None and not self.target:
                _fail(node, "a reduction must be assigned to a name")
            return self.reduction(self._hidden_name(fname), node, hidden=True)
        fn = FUNCTIONS.get(fname)
        if fn is None:
            near = difflib.get_close_matches(fname or "", [*FUNCTIONS, *LAWS], n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            _fail(node, f"unknown function '{fname or ast.unparse(node.func)}'{hint}")
        if len(node.args) != fn.arity or node.keywords:
            _fail(node, f"{fname}() takes {fn.arity} argument(s), got {len(node.args)}")
        if fname == "where":
            args = [self.condition(node.args[0], "where()"),
                    *(self.number(a, "where()") for a in node.args[1:])]
        else:
            args = [self.number(a, f"{fname}()") for a in node.args]
        if fname == "dot":
            return self._dot(node, args)
        if fname == "pow":
            self._check_power(node, args[0].expr, args[1].expr)
        shape = args[0].shape
        for a in args[1:]:
            shape = shape.join(a.shape, node)
        value = fn.build(*(a.expr for a in args))
        if _folded_call(fn, value, args):  # exp(log(x)) is x over the reals, not in floats
            value = fn.build(*(AsWritten(a.expr) if a.expr.free_symbols else a.expr
                               for a in args))
        if not fn.condition and _undefined(value):
            _fail(node, f"'{ast.unparse(node)}' is undefined (a complex or infinite value)")
        return _Val(value, shape, any(a.reduces for a in args), fn.condition)

    def _dot(self, node, args: list[_Val]) -> _Val:
        for arg_node, a in zip(node.args, args, strict=True):
            if a.shape.vec is False or a.shape.k:
                _fail(arg_node, f"shape mismatch: dot() needs feature-axis vectors, but "
                                f"'{ast.unparse(arg_node)}' is a scalar")
            if a.expr.is_Symbol and a.expr.name in self.kind:
                self._declare_vector(a.expr.name, arg_node)
        return _Val(Dot(args[0].expr, args[1].expr), Shape(False), any(a.reduces for a in args))

    # Step 3. Names ------------------------------------------------------------------
    def name(self, name: str, node: ast.AST, subscripted: bool) -> _Val:
        if name == INDEX:
            return _Val(POSITION, Shape())
        if name == LENGTH:
            return _Val(N, Shape())
        if name in CONSTANTS:
            return _Val(CONSTANTS[name], Shape())
        if name in self.elementwise:
            self.read.add(name)
            return _Val(self.elementwise[name], Shape(None))
        if name in self.defined:
            self.read.add(name)
            return self.defined[name]
        if name in self.assigned:
            later = self.assigned[name]
            reads = {n.id for n in ast.walk(later.value) if isinstance(n, ast.Name)}
            if name == self.target or self.target in reads:
                _fail(node, f"cycle: '{self.target}' and '{name}' are defined in terms of "
                            "each other" if name != self.target else
                            f"cycle: '{name}' is defined in terms of itself")
            _fail(node, f"'{name}' is used before its definition on line {later.lineno}")
        if name == OUT:
            _fail(node, f"'{OUT}' is reserved (kernels take preallocated outputs as {OUT}=)")
        kind = "stream" if subscripted else "param"
        if self.kind.setdefault(name, kind) != kind:
            _fail(node, f"'{name}' is used both as a stream ({name}[i]) and as a per-row "
                        f"parameter ({name})")
        return _Val(sp.Symbol(name, real=True), Shape(True if name in self.vector else None))

    def _declare_vector(self, name: str, node: ast.AST):
        if name not in self.kind:
            _fail(node, f"'{name}' is computed, not an input: its feature axis follows "
                        "from its definition")
        self.vector.add(name)

    def _streams(self) -> set[sp.Symbol]:
        return {sp.Symbol(n, real=True) for n in self._stream_names()}

    def _stream_names(self) -> list[str]:
        return [n for n, k in self.kind.items() if k == "stream"]

    @staticmethod
    def _check_power(node: ast.AST, base: sp.Expr, exponent: sp.Expr):
        """Before sympy evaluates a constant power exactly (10**10**10 would never end)."""
        problem = power_problem(base, exponent)
        if problem:
            _fail(node, problem)

    def _hidden_name(self, op: str) -> str:
        return fresh(f"{self.target}_{op}", self.names)


def _folded_call(fn, value: sp.Basic, args: list) -> bool:
    """Whether sympy folded the call into something else (exp(log(x)) -> x,
    log(exp(x)) -> x, abs(x**2) -> x**2, exp(x + log(y)) -> y*exp(x)): valid over the reals,
    not in floats (exp overflows, log of a negative is NaN)."""
    natural = _NATURAL.get(fn.build)
    if natural is None or not any(a.expr.free_symbols for a in args):
        return False
    return not isinstance(value.as_coeff_Mul()[1], natural)  # sin(m - x) = -sin(x - m)


def _undefined(value: sp.Expr) -> bool:
    """Division by zero, or a constant that is not real (pow(-1, 1/3), log(-1), and
    pow(-1, pi), whose realness sympy's assumptions leave open: its value decides)."""
    if value.has(sp.zoo, sp.nan, sp.I):
        return True
    return any(n.is_number and _not_real(n) for n in sp.preorder_traversal(value))


def _not_real(n: sp.Expr) -> bool:
    real = n.is_extended_real
    if real is not None:
        return not real
    try:
        return complex(n).imag != 0
    except (TypeError, ValueError, OverflowError):  # no numeric value: left to the proofs
        return False


def _target_name(stmt: ast.stmt) -> str:
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        _fail(stmt, "each statement must be a single assignment 'name = expression'")
    t = stmt.targets[0]
    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
        return t.value.id
    if not isinstance(t, ast.Name):
        _fail(t, f"cannot assign to {ast.unparse(t)!r}: write 'name = ...' or 'name[i] = ...'")
    return t.id


def _index_of(node: ast.Subscript) -> bool | None:
    """``x[i]`` -> False, ``x[i, :]`` -> True (feature axis), ``g[:]`` -> None."""
    s = node.slice
    if isinstance(s, ast.Name) and s.id == INDEX:
        return False
    if isinstance(s, ast.Slice) and s.lower is s.upper is s.step is None:
        return None
    if (isinstance(s, ast.Tuple) and len(s.elts) == 2 and isinstance(s.elts[0], ast.Name)
            and s.elts[0].id == INDEX and isinstance(s.elts[1], ast.Slice)):
        return True
    _fail(node, f"streams are indexed by '{INDEX}' only (x[i] or x[i, :]), "
                f"not {ast.unparse(node)!r}")


def _fname(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else None


def _int_literal(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value > 0:
        return node.value
    _fail(node, f"k must be a positive integer literal, not {ast.unparse(node)!r}")


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
