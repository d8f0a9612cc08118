"""Backward cascades: the gradient of a forward cascade, derived by reverse-mode
differentiation of its lifted form, written as a new spec and proven.

The forward's values are the stream's elements, per-row parameters, per-row results (each
reduction and epilogue) and per-element outputs.  Given the upstream gradient of the
outputs a caller differentiates (``dy[i]`` for a per-element output, ``dr`` per row for a
per-row result), every per-row result R gets an *adjoint* ``row + sum(body)``: a per-row
part plus a sum over the stream, accumulated from R's readers in reverse order (chain
rule).  A reduction ``R = sum(b(x, a))`` passes ``adjoint(R) * sum(db/da)`` to each anchor
or parameter ``a``: where ``db/da = c(a) * b`` (exp(x - m): c = -1) that is ``c * R``, no new
sum; otherwise the adjoint of R is *materialised* as a line of the backward spec
(``g_R = ... + sum(...)``) and read as an anchor, which makes the backward a cascade that
the same engine fuses and proves.  A product ``R = prod(b)`` whose factors cannot be 0
passes the same with ``db/da`` replaced by ``R * (db/da) / b``, its log-derivative
(``algebra.backward_products``).  A max/min reduction passes nothing where the outputs do
not depend on it (a stabiliser: softmax's m), which is proven, not assumed; otherwise it
is differentiated at its selection, as a top-k result is (``algebra.backward_selections``).
The stream's gradient is a per-element output:
``dx[i] = sum_y dy[i] dy/dx + sum_R g_R db_R/dx``.

What the forward keeps is derived: the per-row results the backward spec reads (``saved``);
per-element forward values are recomputed from them, except a differentiated per-element
output, read instead where that saves a transcendental or work (``algebra.backward_saved``:
softmax's backward reads y and d, and computes no exp).

Every gradient is proven: each stabiliser's adjoint must simplify to 0 (for every N), then
the cascade is unrolled at N = 1, 2 and 3 symbolic elements, and ``sympy.diff`` of the loss
``sum dy * y + dr * r`` (the multi-pass definition) must equal the backward spec unrolled
the same way, element by element and for every parameter.  Sums are symmetric in their
elements, so three elements cover an element's own term and the others'.

Conventions (torch's): a select ``where(c, a, b)`` is differentiated branch by branch (the
condition is piecewise constant: no gradient through it); ``relu'(0) = 0``; ``abs'(0) = 0``.

Examples
--------
>>> from algebra.spec import parse
>>> b = backward(parse("m = max(x[i])\\nd = sum(exp(x[i] - m))\\ny[i] = exp(x[i] - m) / d"))
>>> print(b.spec)
g_d = sum(-dy[i]*y[i]/d)
dx[i] = y[i]*(d*g_d + dy[i])
>>> b.saved, b.outputs_read, b.proven
(('d', 'y'), ('y',), True)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import sympy as sp

from .adjoint import (
    Adjoint,
    RowSum,
    diff,
    expressions_of,
    ratio,
    results_in_order,
    spelled,
    symbols_of,
)
from .backward_products import (
    PRODUCTS,
    check_factors,
    element_derivative,
    products_reached,
    through_product,
)
from .backward_proof import prove
from .backward_saved import read_outputs
from .backward_selections import Selection, contracted_selections, rewritten, selection
from .backward_text import spelling, written
from .backward_vectors import ROLES, column_text, contracted, simplified, solved_hidden, tidied
from .cascade import POSITION, Cascade, N
from .errors import NoBackward
from .laws import LAWS
from .limits import DERIVE_BUDGET_S, budget_raises, time_budget
from .names import fresh
from .printing import spec_text

STABILISERS = ("max", "min")  # reductions that may pass nothing (their adjoint is proven 0)
INDEX_RETURNS = ("index", "indices_k")  # a law's ``returns`` for an integer result

# why a gradient or a whole backward is refused, as data: reason -> message template
REFUSALS = {
    "index": "{name} is an index: integer outputs have no gradient",
    "op": "{name} = {op}(...): only sum and product reductions and selections (max, min, "
          "top-k) are differentiated",
}


def refusal(reason: str, **what) -> str:
    return REFUSALS[reason].format(**what)


@dataclass(frozen=True)
class Backward:
    """The backward cascade of a forward one: its spec, what it reads, what it proves."""

    forward: Cascade
    spec: str
    upstream: dict[str, str]  # forward output -> its gradient's input name
    gradients: dict[str, tuple[str, str]]  # forward input -> (gradient name, orientation)
    saved: tuple[str, ...]  # forward results the backward reads (per-row, and outputs_read)
    forward_spec: str  # the forward with every saved result an output (hidden sums named)
    stabilisers: tuple[str, ...]  # max/min results the outputs do not depend on (proven)
    zero: dict[str, str] = field(default_factory=dict)  # input -> why its gradient is 0
    proofs: tuple[tuple[str, bool], ...] = ()
    maps: dict[str, sp.Expr] = field(default_factory=dict)  # gradient -> its form where the
    # spec cannot hold it: a per-element gradient, a per-row one with no sum (d eps)
    columns: str = ""  # gradients summed over the rows: a cascade whose stream is the rows
    column_params: dict[str, str] = field(default_factory=dict)  # new parameter -> ROLES key
    dots: dict[str, tuple[str, str]] = field(default_factory=dict)  # delta -> (upstream, output)
    selections: tuple[Selection, ...] = ()  # max/min/top-k differentiated at their selection
    products: tuple[str, ...] = ()  # prod results differentiated by their log-derivative
    outputs_read: tuple[str, ...] = ()  # per-element outputs read, not recomputed

    @property
    def per_element(self) -> set[str]:
        """The names the backward reads per element: the forward's streams, the outputs
        it reads and the upstreams of its per-element outputs (not the selections'
        scattered inputs)."""
        return {s.name for s in self.forward.streams} | set(self.outputs_read) | {
            g for o, g in self.upstream.items() if o in self.forward.elementwise}

    @property
    def is_map(self) -> bool:
        """Nothing for a kernel: no gradient reads a stream, so each is a per-row value (a
        learned eps's) or one broadcast along the row (a mean's dx = dr / N), which ``maps``
        holds for the caller to run.  A per-element gradient that reads the row with no sum
        (logsumexp's dx = dlse * exp(x - lse)) is a line of the spec: a map kernel."""
        read = {s.name for e in self.maps.values() for s in sp.sympify(e).free_symbols}
        return "sum(" not in self.spec and not self.per_element & read

    @property
    def proven(self) -> bool:
        return bool(self.proofs) and all(ok for _, ok in self.proofs)

    def __str__(self) -> str:
        up = ", ".join(f"{g} (of {o})" for o, g in self.upstream.items())
        lines = [f"backward of: {', '.join(self.upstream)}", f"  upstream: {up}",
                 f"  saved by the forward: {', '.join(self.saved) or 'nothing'}"
                 f" ({'other ' if self.outputs_read else ''}per-element values are recomputed"
                 " from them)"]
        lines += [f"  {o}: the forward's output, saved (no recompute)" for o in self.outputs_read]
        for name, (grad, how) in self.gradients.items():
            lines.append(f"  {grad}: gradient of {name}, {how}")
        lines += [f"  gradient of {name}: 0, {why}" for name, why in self.zero.items()]
        lines += [f"  {s}: a stabiliser, the outputs do not depend on it (proven)"
                  for s in self.stabilisers]
        lines += [f"  {p}: a product, differentiated by its log-derivative {p} * sum(d factor "
                  "/ factor) (no factor can be 0)" for p in self.products]
        lines += [f"  {delta} = dot({d}, {o}) per row, from the saved output"
                  for delta, (d, o) in self.dots.items()]
        for s in self.selections:
            lines.append(f"  {s}: the subgradient of {s.result} (torch's: to the element(s) "
                         "the forward selected; ties to the lowest index)")
            if s.delta:
                lines.append(f"  {s.delta} = dot({s.upstream}, {s.result}) per row, from the "
                             "saved output")
        lines.append("spec:")
        lines += [f"  {line}" for line in self.spec.splitlines()]
        if self.columns:
            lines.append("spec in the other orientation (the rows are its stream):")
            lines += [f"  {line}" for line in self.columns.splitlines()]
            lines += [f"  ({p}: {ROLES[role]})" for p, role in self.column_params.items()]
        lines.append("proof:")
        lines += [f"  [{'proven' if ok else 'FAILED'}] {what}" for what, ok in self.proofs]
        return "\n".join(lines)


@dataclass
class _Sweep:
    """The reverse sweep's working data: adjoints, the backward spec's lines, names."""

    c: Cascade
    sym: dict[str, sp.Symbol]
    taken: set[str]
    selectors: frozenset[str] = frozenset()  # per-element inputs of the selections
    upstream: frozenset[sp.Symbol] = frozenset()  # the per-element outputs' upstreams
    adjoint: dict[str, Adjoint] = field(default_factory=lambda: defaultdict(Adjoint))
    lines: list[tuple[str, sp.Expr]] = field(default_factory=list)  # per-row lines, in order
    held: dict[str, sp.Expr] = field(default_factory=dict)  # result -> its adjoint's value

    def name(self, base: str) -> str:
        out = fresh(base, self.taken)
        self.taken.add(out)
        return out

    @property
    def per_element(self) -> set[sp.Symbol]:
        return {*self.c.streams, POSITION, *self.upstream,
                *(sp.Symbol(s, real=True) for s in self.selectors)}

    def value_of(self, result: str) -> sp.Expr:
        """The adjoint of ``result`` as one per-row value: inline where it has no sum,
        else a line ``g_<result> = row + sum(body)`` of the backward spec, read by name."""
        if result not in self.held:
            a = self.adjoint[result]
            body = simplified(a.body)
            if not body.free_symbols & self.per_element:  # sum(c) = N * c: no sum to run
                self.held[result] = simplified(a.row + N * body)
            else:
                g = sp.Symbol(self.name(f"g_{result}"), real=True)
                self.lines.append((g.name, a.row + RowSum(body)))
                self.held[result] = g
        return self.held[result]


def terminal_outputs(c: Cascade) -> tuple[str, ...]:
    """The float outputs no other value reads (softmax: y; logsumexp: lse): what a model
    differentiates by default; the others are statistics the forward saves, and indices
    have no gradient."""
    read = {s.name for e in expressions_of(c) for s in e.free_symbols}
    return tuple(o for o in c.outputs if o not in read | set(_indices(c)))


def _indices(c: Cascade) -> list[str]:
    return [r.name for r in c.reductions if LAWS[r.op].returns in INDEX_RETURNS]


def backward(c: Cascade, outputs: tuple[str, ...] | None = None) -> Backward:
    """The backward cascade of ``c`` for the gradients of ``outputs`` (default: the
    ``terminal_outputs``), derived and proven (module docstring)."""
    outputs = terminal_outputs(c) if outputs is None else tuple(outputs)
    if not outputs:  # argmax alone: nothing to differentiate, not a kernel writing zeros
        raise NoBackward("no output to differentiate: " + "; ".join(
            refusal("index", name=o) for o in _indices(c) if o in c.outputs))
    _check_outputs(c, outputs)
    with time_budget(DERIVE_BUDGET_S.value), budget_raises(NoBackward):
        return _derived(c, outputs)


def _derived(forward: Cascade, outputs: tuple[str, ...]) -> Backward:
    taken = set(forward.names) | set(forward.outputs) | {
        s.name for s in (*forward.streams, *forward.params)}
    up = {}
    for o in outputs:
        up[o] = sp.Symbol(fresh(f"d{o}", taken), real=True)
        taken.add(up[o].name)
    c, seeds, dots = contracted(forward, outputs, up, taken)
    selections = contracted_selections(forward, outputs, up, taken)
    seeds |= {s.result: sp.S.One for s in selections}
    sw, stabilisers = _swept(forward, c, selections, seeds, up, taken)
    streams, params, columns, zero = _input_gradients(sw, up)
    solved = {s.result: sp.Symbol(s.delta, real=True) for s in selections if s.delta}
    if dots or solved:
        def tidy(e):
            return tidied(solved_hidden(forward, dots, _by_name(e, solved)))
        sw.lines = [(g, tidy(e)) for g, e in sw.lines]
        streams = [(s, g, tidy(e)) for s, g, e in streams]
        columns = [(s, g, tidy(e)) for s, g, e in columns]
    sw.lines, streams, read = read_outputs(sw.c, outputs, sw.lines, streams, sw.per_element)
    proofs = prove(rewritten(forward, selections), sw.sym, sw.lines, up, dots, stabilisers,
                   streams, params, columns, selections, tuple(zero))
    column_spec, column_params = _column_spec(c, sw, dots, columns)
    exprs = [e for _, e in sw.lines] + [e for _, _, e in (*streams, *columns)]
    reads = {s.name for e in exprs for s in e.free_symbols}
    dots = {o: (d, delta) for o, (d, delta) in dots.items() if delta.name in reads}
    saved = sorted((reads | set(dots)) & set(results_in_order(c)) | set(read) | {
        s.index for s in selections} | {s.result for s in selections if s.delta})
    forward_spec = (written(forward, selections) if set(saved) - set(c.outputs)
                    else forward.text)
    return Backward(forward, _spec_text(c, sw, up, streams, read),
                    {o: s.name for o, s in up.items()},
                    _described(streams, params, columns), tuple(saved), forward_spec,
                    tuple(stabilisers), zero, proofs, _maps(sw, streams, params),
                    column_spec, column_params,
                    {delta.name: (d.name, o) for o, (d, delta) in dots.items()},
                    tuple(selections), products_reached(sw.c, sw.adjoint), read)


class _Selects(Exception):
    """A max/min whose adjoint is not 0: the outputs depend on the value it selects."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _swept(forward: Cascade, c: Cascade, selections: list[Selection], seeds, up, taken):
    """The reverse sweep, again with each max/min the outputs depend on differentiated at
    its selection (``algebra.backward_selections``); returns it and the stabilisers."""
    reductions = {r.name: r for r in forward.reductions}
    while True:
        here = rewritten(c, selections)
        sw = _Sweep(here, symbols_of(here), set(taken),
                    frozenset(s.selector for s in selections),
                    frozenset(up[o] for o in up if o in here.elementwise))
        try:
            return sw, _sweep(sw, seeds, up)
        except _Selects as e:
            selections.append(selection(forward, reductions[e.name], taken))


def _by_name(e: sp.Expr, values: dict[str, sp.Expr]) -> sp.Expr:
    """``e`` with the symbols named in ``values`` replaced, whatever their assumptions."""
    return e.xreplace({s: values[s.name] for s in e.free_symbols if s.name in values})


def _described(streams, params: dict[str, str], columns) -> dict[str, tuple[str, str]]:
    """Each input -> (its gradient's name, the orientation it is computed in)."""
    grads = {s.name: (g, "per element: a stream of each row, row-parallel")
             for s, g, _ in streams}
    grads |= {p: (g, "per row: a sum over the row's stream") for p, g in params.items()}
    return grads | {s.name: (g, "per element of a stream the rows share: a sum over the rows, "
                                "in the other orientation (the rows are its stream)")
                    for s, g, _ in columns}


def _maps(sw: _Sweep, streams, params: dict[str, str]) -> dict[str, sp.Expr]:
    """The gradients the caller may compute itself: each stream's per-element form, and
    each parameter's with no sum (a map of per-row values: d eps)."""
    out = {g: spelled(e) for _, g, e in streams}
    return out | {g: spelled(e) for g, e in sw.lines
                  if g in params.values() and not e.has(RowSum)}


def _column_spec(c: Cascade, sw: _Sweep, dots, columns) -> tuple[str, dict[str, str]]:
    if not columns:
        return "", {}
    shared = {s.name for s in c.streams if s.name in c.vector_inputs}  # keys, values, weights
    per_row = {s.name for _, _, e in columns for s in e.free_symbols} - shared
    vectors = set(c.vector_inputs) | {d.name for d, _ in dots.values()}
    return column_text(c, [(g, e) for _, g, e in columns], per_row, vectors, sw.taken,
                       lambda e, spell: spec_text(spelled(e), spell, NoBackward))


def _check_outputs(c: Cascade, outputs: tuple[str, ...]) -> None:
    ops = {r.name: r.op for r in c.reductions}
    for o in outputs:
        if o not in c.outputs:
            raise NoBackward(f"{o} is not an output of the cascade (its outputs: "
                             f"{', '.join(c.outputs)})")
        if o in ops and LAWS[ops[o]].returns in INDEX_RETURNS:
            raise NoBackward(refusal("index", name=o))


def _sweep(sw: _Sweep, seeds: dict[str, sp.Expr], up: dict[str, sp.Symbol]) -> list[str]:
    """Adjoints of every per-row value, readers before what they read, from each output's
    seed (its upstream; 1 for a contracted vector output); returns the stabilisers
    (max/min results whose adjoint is proven 0)."""
    c, reductions = sw.c, {r.name: r for r in sw.c.reductions}
    values = set(results_in_order(c)) | {p.name for p in c.params}
    for o, d in seeds.items():
        if o in c.elementwise:
            g = c.elementwise[o]
            for s in g.free_symbols & {sw.sym[v] for v in values if v in sw.sym}:
                sw.adjoint[s.name] += Adjoint(body=d * diff(g, s))
        else:
            sw.adjoint[o] += Adjoint(row=d)
    stabilisers = []
    for name in reversed(results_in_order(c)):
        a = sw.adjoint[name]
        if name in c.epilogues:
            for s in c.epilogues[name].free_symbols:
                if s.name in values:
                    sw.adjoint[s.name] += a.times(diff(c.epilogues[name], s))
            continue
        red = reductions[name]
        if a == Adjoint() and red.op not in STABILISERS:  # no gradient reaches it (an index)
            continue
        if red.op in STABILISERS:
            if not a.vanishes({sw.sym[e]: x for e, x in c.epilogues.items() if e in sw.sym}):
                raise _Selects(name)
            stabilisers.append(name)
            continue
        if red.op != "sum" and red.op not in PRODUCTS:
            raise NoBackward(refusal("op", name=name, op=red.op))
        check_factors(c, red)  # a product's log-derivative: no factor may be 0
        for s in red.body.free_symbols:
            if s.name in values:
                sw.adjoint[s.name] += (_through_sum(sw, red, s, a) if red.op == "sum" else
                                       through_product(red, s, a, sw.sym[name],
                                                       sw.per_element, sw.value_of))
    return stabilisers


def _through_sum(sw: _Sweep, red, s: sp.Symbol, a: Adjoint) -> Adjoint:
    """What ``red = sum(b)`` passes to ``s``: adjoint(red) * sum(db/ds).  Where
    db/ds = c * b with c free of the stream and dividing by nothing db/ds does not (no new
    pole: x * m gives 1/m), that is c * red; else one more sum."""
    db = diff(red.body, s)
    c = ratio(db, red.body)
    new_pole = sp.denom(c).free_symbols - sp.denom(sp.together(db)).free_symbols
    if not c.free_symbols & sw.per_element and not new_pole:
        return a.times(c * sw.sym[red.name])
    return Adjoint(body=sw.value_of(red.name) * db)  # inline where the adjoint has no sum


def _input_gradients(sw: _Sweep, up: dict[str, sp.Symbol]):
    """(stream gradients as (stream, gradient name, per-element expression), parameter
    gradient names, gradients of vector streams as (name, per-element vector expression),
    summed over the rows in the other orientation, parameters whose gradient is 0 with the
    reason); parameter gradients become lines of the spec."""
    c, streams, params, columns, zero = sw.c, [], {}, [], {}
    sums = [r for r in c.reductions if r.op == "sum" or r.op in PRODUCTS]
    for s in c.streams:
        expr = sum((d * diff(c.elementwise[o], s) for o, d in up.items()
                    if o in c.elementwise), sp.S.Zero)
        expr += sum((sw.value_of(r.name) * element_derivative(r, s, sw.sym[r.name])
                     for r in sums if s in r.body.free_symbols), sp.S.Zero)
        if s.name in c.vector_inputs:
            columns.append((s, sw.name(f"d{s.name}"), simplified(expr)))
        else:
            streams.append((s, sw.name(f"d{s.name}"), simplified(expr)))
    for p in c.params:
        a = sw.adjoint[p.name]
        if a.vanishes():  # torch's convention too: a condition passes no gradient
            zero[p.name] = ("the outputs do not depend on it, or only through a condition "
                            "(proven)")
        else:
            g = sw.name(f"d{p.name}")
            body = simplified(a.body)
            sw.lines.append((g, simplified(a.row) + (RowSum(body) if body != 0 else 0)))
            params[p.name] = g
    return streams, params, columns, zero


def _spec_text(c: Cascade, sw: _Sweep, up: dict[str, sp.Symbol], streams, read) -> str:
    name = spelling(c, {s.name for s in c.streams} | set(sw.selectors) | set(read) | {
        up[o].name for o in up if o in c.elementwise})
    lines = [f"{g} = {spec_text(spelled(e), name, NoBackward)}" for g, e in sw.lines
             if e.has(RowSum)]  # a per-row map (no sum) is run by the caller: ``maps``
    lines += [f"{g}[i] = {spec_text(spelled(e), name, NoBackward)}" for _, g, e in streams]
    return "\n".join(lines)
