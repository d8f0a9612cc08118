"""The two translations lifting needs: TIR values -> sympy, and sympy -> spec text.

A block's value is translated node by node through one table (``NODES``, and
``CALLS`` for intrinsics).  A load of a buffer that an elementwise block writes is
replaced by that block's own value with its loop variables bound to the load's
indices (inlining), so a reduction's body reaches the function's inputs and the
results of earlier reductions.  Every load that stays becomes a symbol standing
for one ``Load`` (a buffer and its index terms); ``spec_text`` prints sympy back
in the spec language, each load through a caller-given name.
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Callable
from dataclasses import dataclass

import sympy as sp

from algebra import printing
from algebra.laws import LAWS
from algebra.vocabulary import FUNCTIONS

from ..tvm.ir import Call, TensorLoad, tirx

FLOAT_MAX = float.fromhex("0x1.fffffep+127")  # float32 max: TOPI's max/min initial value


class LiftError(ValueError):
    """IR that cannot be lifted; the message says which block and why."""


@dataclass(frozen=True)
class Load:
    """One read that stays a symbol: a buffer and one index term per buffer axis (a loop
    variable of the reading block, or an int)."""

    buffer: object
    terms: tuple


def _fn(name: str) -> Callable:
    return FUNCTIONS[name].build


# TIR intrinsic name -> sympy builder (the spec language's own classes).
CALLS: dict[str, Callable] = {
    "tirx.exp": _fn("exp"), "tirx.log": _fn("log"), "tirx.sqrt": _fn("sqrt"),
    "tirx.rsqrt": _fn("rsqrt"), "tirx.tanh": _fn("tanh"), "tirx.sigmoid": _fn("sigmoid"),
    "tirx.fabs": _fn("abs"), "tirx.erf": _fn("erf"), "tirx.log1p": _fn("log1p"),
    "tirx.expm1": _fn("expm1"), "tirx.floor": _fn("floor"), "prim.ceil": _fn("ceil"),
    "tirx.ceil": _fn("ceil"), "tirx.round": _fn("round"), "tirx.nearbyint": _fn("round"),
    "tirx.sin": _fn("sin"), "tirx.cos": _fn("cos"), "tirx.pow": _fn("pow"),
    "tirx.exp2": lambda a: 2 ** a,
}


def constant(value: float) -> sp.Expr:
    """A TIR float constant as the spec parser would read it (``nsimplify``)."""
    if math.isinf(value):
        return sp.oo if value > 0 else -sp.oo
    if math.isnan(value):
        raise LiftError("a NaN constant")
    return sp.nsimplify(value) if value != int(value) else sp.Integer(int(value))


@dataclass(frozen=True)
class Producer:
    """An elementwise block whose value replaces loads of the buffer it writes."""

    pos: int
    store: tuple  # its variables (or ints), one per buffer axis
    value: object
    reads: frozenset


class Translator:
    """TIR -> sympy for one reading block (at statement ``pos``).

    A load of a buffer in ``producers`` is inlined when the producer runs before the reader
    and nothing rewrites what it read in between (``writers``: buffer -> positions).
    ``loads`` collects the symbols made for the loads that stay."""

    def __init__(self, producers: dict, writers: dict, pos: int, where: str):
        self.producers, self.writers, self.where = producers, writers, where
        self._limit = pos  # the statement whose reads are being inlined
        self.loads: dict[sp.Symbol, Load] = {}
        self._symbols: dict[tuple, sp.Symbol] = {}

    def value(self, expr, env: dict | None = None) -> sp.Expr:
        """``expr`` with the reading block's variables renamed through ``env``."""
        handler = NODES.get(type(expr))
        if handler is None:
            raise LiftError(f"{self.where}: unsupported TIR expression `{expr}` "
                            f"({type(expr).__name__})")
        return handler(self, expr, env or {})

    def load(self, node, env) -> sp.Expr:
        terms = tuple(self._term(i, env) for i in node.indices)
        producer = self.producers.get(node.source)
        if producer is not None and self._inlinable(producer):
            env = {v: t for v, t in zip(producer.store, terms, strict=True)
                   if not isinstance(v, int)}  # the producer's variables take the indices
            outer, self._limit = self._limit, producer.pos
            try:
                return self.value(producer.value, env)
            finally:
                self._limit = outer
        key = (node.source, terms)
        if key not in self._symbols:
            sym = sp.Symbol(f"load{len(self._symbols)}", real=True)
            self._symbols[key] = sym
            self.loads[sym] = Load(node.source, terms)
        return self._symbols[key]

    def _inlinable(self, producer: Producer) -> bool:
        return producer.pos < self._limit and not any(
            producer.pos < p < self._limit for b in producer.reads
            for p in self.writers.get(b, ()))

    def _term(self, index, env):
        if isinstance(index, tirx.IntImm):
            return int(index.value)
        if isinstance(index, tirx.Var):
            return env.get(index, index)
        raise LiftError(f"{self.where}: index `{index}` is neither a loop variable nor a "
                        "constant")

    def call(self, node, env) -> sp.Expr:
        build = CALLS.get(node.op.name)
        if build is None:
            raise LiftError(f"{self.where}: unsupported intrinsic {node.op.name} in `{node}`")
        return build(*(self.value(a, env) for a in node.args))

    def cast(self, node, env) -> sp.Expr:
        if node.ty.dtype != "float32" or node.value.ty.dtype != "float32":
            raise LiftError(f"{self.where}: cast `{node}`: only float32 values are lifted")
        return self.value(node.value, env)


def _binary(op: Callable) -> Callable:
    def handle(tr: Translator, node, env):
        if node.ty.dtype != "float32":
            raise LiftError(f"{tr.where}: `{node}` computes in {node.ty.dtype}; only float32 "
                            "values are lifted")
        return op(tr.value(node.a, env), tr.value(node.b, env))
    return handle


# TIR node class -> handler(translator, node, env); one line each.
NODES: dict[type, Callable] = {
    tirx.Add: _binary(lambda a, b: a + b),
    tirx.Sub: _binary(lambda a, b: a - b),
    tirx.Mul: _binary(lambda a, b: a * b),
    tirx.Div: _binary(lambda a, b: a / b),
    tirx.Max: _binary(_fn("maximum")),
    tirx.Min: _binary(_fn("minimum")),
    tirx.FloatImm: lambda tr, node, env: constant(float(node.value)),
    tirx.IntImm: lambda tr, node, env: sp.Integer(int(node.value)),
    tirx.Cast: Translator.cast,
    TensorLoad: Translator.load,
    Call: Translator.call,
}


# -- sympy -> spec text ---------------------------------------------------------------------

RESERVED = {"i", "N", "pi", "inf", *FUNCTIONS, *LAWS, *keyword.kwlist, "step"}
def spec_text(expr: sp.Expr, name: Callable[[sp.Symbol], str]) -> str:
    """``expr`` in the spec language (``algebra.printing``); no spelling is a LiftError.

    Examples
    --------
    >>> x, m, d = sp.symbols("x m d", real=True)
    >>> spec_text(sp.exp(x - m) / d, lambda s: {"x": "x[i]"}.get(s.name, s.name))
    'exp(-m + x[i])/d'
    """
    return printing.spec_text(expr, name, LiftError)


def spec_name(buffer_name: str, taken: set[str]) -> str:
    """A spec identifier for a buffer: its name made an identifier, never reserved or taken."""
    base = "".join(c if c.isalnum() or c == "_" else "_" for c in buffer_name) or "b"
    if base[0].isdigit():
        base = "b_" + base
    name, k = base, 1
    while name in RESERVED or name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name
