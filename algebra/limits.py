"""Bounds on the work ``derive`` does, so that any string is answered quickly.

Each limit is one entry of ``LIMITS``: a name, a value and why it is what it is.  A spec over
a limit is refused with a ``SpecError`` (where the spec says too much: its line and column)
or a ``NotFusable`` (a reduction whose body holds too high a power, or whose derivation ran
out of time), and the message names the limit.  The limits sit well above anything the
library, the Relax and TensorIR lifts or the tests write (the largest of those, measured over
the test suite: 380 characters, 109 tokens, nesting 9, 24 sympy nodes, 4 reductions, a power
of 30).

The checks run in the order the work is done: the text (characters, tokens, literals) before
Python's parser sees it, the syntax tree's nesting before the lifter recurses over it, the
size, nesting and constants of each lifted expression as it is built (a constant power before
sympy evaluates it exactly), the number of reductions and the powers in each reduction body
(before a later stage expands them), and a time budget around the whole derivation as the
last resort.
"""

from __future__ import annotations

import ast
import contextlib
import io
import math
import signal
import threading
import tokenize
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import sympy as sp

from .errors import NotFusable, SpecError
from .separate import MAX_RANK


@dataclass(frozen=True)
class Limit:
    """One bound: its name (as users see it in messages), value and reason."""

    name: str
    value: int | float
    why: str

    def refusal(self, what: str) -> str:
        """``what`` exceeded this limit, as one message naming it."""
        return f"{what} (limit {self.name} = {self.value}: {self.why})"


MAX_SPEC_CHARS = Limit(
    "MAX_SPEC_CHARS", 100_000, "every later check reads the whole text once; the longest "
    "spec redfuser writes itself is under 1,000 characters")
MAX_TOKENS = Limit(
    "MAX_TOKENS", 10_000, "Python's parser recurses once per operator of a chain such as a "
    "long sum and fails with a RecursionError somewhere between 1,000 and 3,000 of them")
MAX_DEPTH = Limit(
    "MAX_DEPTH", 64, "the lifter and sympy recurse once per level of an expression (lets "
    "substituted), a few Python frames each, within Python's recursion limit of 1,000")
MAX_SIZE = Limit(
    "MAX_SIZE", 20_000, "nodes of one lifted expression with its lets substituted: a let "
    "read twice doubles it, and every stage walks the whole tree")
MAX_REDUCTIONS = Limit(
    "MAX_REDUCTIONS", 64, "each reduction adds its own state, update, merge and proofs "
    "(tens of milliseconds of sympy each) and registers to every row's kernel state")
MAX_DEGREE = Limit(
    "MAX_DEGREE", MAX_RANK - 1, "a power k of a stream expression in an earlier result needs "
    f"k + 1 state sums to re-anchor (at most MAX_RANK = {MAX_RANK}), and the later stages "
    "would expand it into k + 1 or more terms before that is known")
MAX_CONSTANT_BITS = Limit(
    "MAX_CONSTANT_BITS", 1_100, "sympy keeps constants exact; float64 ends at 2**1024, and "
    "exact integers far beyond it take unbounded time to compute and cannot be printed")
DERIVE_BUDGET_S = Limit(
    "DERIVE_BUDGET_S", 60.0, "seconds of CPU time for one derivation: the library derives "
    "in under 2 s each, and a cascade that needs more is not worth fusing")

LIMITS = {lim.name: lim for lim in (MAX_SPEC_CHARS, MAX_TOKENS, MAX_DEPTH, MAX_SIZE,
                                    MAX_REDUCTIONS, MAX_DEGREE, MAX_CONSTANT_BITS,
                                    DERIVE_BUDGET_S)}
# A decimal integer literal this long has more than MAX_CONSTANT_BITS bits (checked on the text:
# Python's parser refuses one of over 4,300 digits with advice about sys that fits no spec).
_LITERAL_DIGITS = math.ceil(MAX_CONSTANT_BITS.value * math.log10(2)) + 1


_LAYOUT_TOKENS = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT,
                  tokenize.ENDMARKER)


def _position(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


# Step 1. The text, before Python's parser ---------------------------------------------------
def check_text(text: str) -> tuple[int, int]:
    """Refuse a text over the size limits; return the (line, column) where its longest
    statement starts (where to point if the parser still finds it too deep).

    Examples
    --------
    >>> check_text("m = max(x[i])\\nd = sum(exp(x[i] - m))")
    (2, 1)
    >>> check_text("m = max(x[i] * " + "9" * 400 + ")")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    algebra.errors.SpecError: line 1, column 16: a number literal of 400 characters (limit MAX...
    """
    if len(text) > MAX_SPEC_CHARS.value:
        raise SpecError(MAX_SPEC_CHARS.refusal(f"the spec has {len(text):,} characters"),
                        *_position(text, MAX_SPEC_CHARS.value))
    count, longest, start, size = 0, (0, (1, 1)), None, 0
    with contextlib.suppress(tokenize.TokenError, SyntaxError):  # the parser names those
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            count += 1
            where = tok.start[0], tok.start[1] + 1
            if count > MAX_TOKENS.value:
                raise SpecError(MAX_TOKENS.refusal(f"the spec has more than "
                                                   f"{MAX_TOKENS.value} tokens"), *where)
            if tok.type == tokenize.NUMBER and len(tok.string) > _LITERAL_DIGITS:
                raise SpecError(MAX_CONSTANT_BITS.refusal(
                    f"a number literal of {len(tok.string)} characters"), *where)
            if tok.type == tokenize.NEWLINE or tok.string == ";":
                start = None
            elif tok.type not in _LAYOUT_TOKENS:
                if start is None:
                    start, size = where, 0
                size += 1
                longest = max(longest, (size, start))
    return longest[1]


def check_tree(tree: ast.Module) -> None:
    """Refuse an expression nested deeper than MAX_DEPTH, at the first node too deep (walked
    with an explicit stack: the tree is not known to be shallow yet)."""
    stack = [(child, 1) for stmt in tree.body for child in ast.iter_child_nodes(stmt)
             if isinstance(child, ast.expr)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH.value:
            raise SpecError(MAX_DEPTH.refusal(f"the expression nests more than "
                                              f"{MAX_DEPTH.value} levels deep"),
                            node.lineno, node.col_offset + 1)
        stack += [(c, depth + 1) for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr)]


# Step 2. Each lifted expression, as it is built ----------------------------------------------
def _bits(q: sp.Rational) -> int:
    return max(abs(q.p).bit_length(), abs(q.q).bit_length())


def power_problem(base: sp.Expr, exponent: sp.Expr) -> str | None:
    """Why ``base ** exponent`` must not be built (sympy would evaluate it exactly), or None.

    Examples
    --------
    >>> power_problem(sp.Integer(10), sp.Integer(10) ** 10)  # doctest: +ELLIPSIS
    '10**10000000000 would be an exact constant of about 33219280949 bits (limit MAX_CONSTANT...'
    >>> power_problem(sp.Integer(2), sp.Integer(-24)) is None
    True
    """
    if not (base.is_Rational and exponent.is_Rational) or exponent == 0:
        return None
    magnitude = max(abs(base.p), abs(base.q))  # |base| or 1/|base|, whichever is larger
    if magnitude == 1 or base == 0:
        return None
    # log2 of the result's bits, |exponent| * log2(magnitude), in logs: the exponent itself
    # may be too large for a float
    log_bits = (math.log2(abs(exponent.p)) - math.log2(exponent.q)
                + math.log2(math.log2(magnitude)))
    if log_bits <= math.log2(MAX_CONSTANT_BITS.value):
        return None
    bits = f"{2 ** log_bits:.0f}" if log_bits < 64 else f"2**{log_bits:.0f}"
    return MAX_CONSTANT_BITS.refusal(f"{base}**{exponent} would be an exact constant of about "
                                     f"{bits} bits")


def combined(children: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """(size, depth) of a node from its children's: a bound on the lifted tree's (sympy
    folds many nodes; a let read twice counts twice, as every walk of the tree does)."""
    parts = list(children)
    return 1 + sum(p[0] for p in parts), 1 + max((p[1] for p in parts), default=0)


def node_problem(cost: tuple[int, int], value: sp.Expr) -> str | None:
    """Why a just-built node is refused, or None: its (size, depth) over MAX_SIZE or
    MAX_DEPTH, or a constant over MAX_CONSTANT_BITS (``value_problem``)."""
    size, depth = cost
    if size > MAX_SIZE.value:
        return MAX_SIZE.refusal(f"the expression has {size} nodes with its lets substituted")
    if depth > MAX_DEPTH.value:
        return MAX_DEPTH.refusal(f"the expression nests {depth} levels deep with its lets "
                                 "substituted")
    return value_problem(value)


def value_problem(value: sp.Expr) -> str | None:
    """Why a just-built expression is refused, or None: an exact constant over
    MAX_CONSTANT_BITS.  Only its top node and its arguments are looked at: everything below
    was checked when it was built.

    Examples
    --------
    >>> value_problem(sp.Symbol("x") * sp.Integer(2) ** 1200)  # doctest: +ELLIPSIS
    'an exact constant of 1201 bits (limit MAX_CONSTANT_BITS = 1100: ...'
    """
    for e in (value, *value.args):
        if e.is_Rational and _bits(e) > MAX_CONSTANT_BITS.value:
            return MAX_CONSTANT_BITS.refusal(f"an exact constant of {_bits(e)} bits")
    return None


def degree_problem(body: sp.Expr, results: set[str],
                   streams: set[str]) -> tuple[sp.Expr, str] | None:
    """(the power, why) when a reduction body holds a power beyond MAX_DEGREE of an
    expression that mixes the stream (names ``streams``) with earlier results (names
    ``results``), else None: checked on the lifted body, before any stage expands it.

    Examples
    --------
    >>> x, m = sp.symbols("x m", real=True)
    >>> degree_problem(sp.exp(x - m) * (x - m) ** 16, {"m"}, {"x"})  # doctest: +ELLIPSIS
    ((-m + x)**16, 'is a power 16 of an expression mixing the stream with the earlier ...')
    >>> degree_problem((x - m) ** 15 + x ** 100 + (m + 1) ** 100, {"m"}, {"x"}) is None
    True
    """
    for e in body.atoms(sp.Pow):
        if e.exp.is_number and abs(e.exp) > MAX_DEGREE.value:
            names = {s.name for s in e.base.free_symbols}
            if names & streams and names & results:
                read = ", ".join(sorted(names & results))
                return e, MAX_DEGREE.refusal(f"is a power {e.exp} of an expression mixing the "
                                             f"stream with the earlier result(s) {read}")
    return None


# Step 3. The time budget: the last resort ----------------------------------------------------
class OverBudget(BaseException):  # noqa: N818 - not an error users see: converted below
    """The budget of ``seconds`` ran out.  A BaseException, so that no ``except Exception``
    in sympy or in the engine swallows it; it never leaves ``derive`` (see ``charged_to``)."""

    def __init__(self, seconds: float):
        super().__init__(seconds)
        self.seconds = seconds


_TIMER, _SIGNAL = (signal.ITIMER_PROF, signal.SIGPROF) if hasattr(signal, "setitimer") else \
    (None, None)
# Python drops an exception raised where it cannot propagate (a gc callback, a __del__, a
# weakref callback: hypothesis installs a gc callback), so an expiry landing there is lost.
# The timer therefore fires again every RETRY_S of CPU time until someone catches one.
RETRY_S = 0.05
_armed: dict[str, bool] = {"on": False}


def _armable() -> bool:
    """A CPU-time timer only exists on POSIX, only the main thread may install a signal
    handler, and a timer someone else set (a profiler) is left alone."""
    return (_TIMER is not None and threading.current_thread() is threading.main_thread()
            and signal.getitimer(_TIMER) == (0.0, 0.0))


def _disarm() -> None:
    """An expiry was caught: no further one may fire while it is being converted."""
    if _armed["on"]:
        _armed["on"] = False
        signal.setitimer(_TIMER, 0)


@contextlib.contextmanager
def time_budget(seconds: float | None) -> Iterator[None]:
    """Run the block within ``seconds`` of CPU time: when they are spent, ``OverBudget`` is
    raised wherever the block is, and again every ``RETRY_S`` until it is caught.  Elsewhere
    than the main thread of a POSIX process the block runs unbounded: the other limits still
    bound what a spec can ask for.  An ``OverBudget`` no stage converted leaves as a
    ``SpecError``.  ``None``: no budget."""
    if seconds is not None and not (isinstance(seconds, (int, float)) and 0 < seconds < math.inf):
        raise ValueError(f"a time budget is a positive number of seconds or None, not "
                         f"{seconds!r}")
    if seconds is None or not _armable():
        yield
        return

    def expire(signum, frame):
        if _armed["on"]:
            raise OverBudget(seconds)

    previous = signal.signal(_SIGNAL, expire)
    _armed["on"] = True
    signal.setitimer(_TIMER, seconds, RETRY_S)
    try:
        yield
    except OverBudget:
        _disarm()
        raise SpecError(budget_refusal(seconds), 1, 1) from None
    finally:
        _disarm()
        signal.signal(_SIGNAL, signal.SIG_DFL if previous is None else previous)


def budget_refusal(seconds: float) -> str:
    return DERIVE_BUDGET_S.refusal(f"the derivation took more than {seconds:g} s of CPU time")


@contextlib.contextmanager
def budget_raises(error: Callable[[str], Exception]):
    """In the block, the budget running out raises ``error(message)`` instead."""
    try:
        yield
    except OverBudget as e:
        _disarm()
        raise error(budget_refusal(e.seconds)) from None


def charged_to(reduction):
    """The budget running out in the block is ``reduction``'s ``NotFusable``."""
    return budget_raises(lambda why: NotFusable(reduction.name, reduction.body,
                                                f"could not be derived in time: {why}"))
