"""``FusionRule.evaluate``: the fused algorithm in numpy, exactly as a kernel runs it.

One pass over the stream per chunk, element by element (state in the inputs'
dtype), chunk states merged along an explicit tree; then finalize, then the
per-element outputs in a second pass.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from .cascade import INDEX, LENGTH
from .components import SelectComponent
from .layout import Layout, resolve, to_user, vector_results
from .numeric import PER_ROW, compile_expr
from .state import INDEX_KEY


def _bounds(chunks, n: int) -> list[tuple[int, int]]:
    chunks = ([n] if n else []) if chunks is None else [int(c) for c in chunks]
    if any(c <= 0 for c in chunks) or sum(chunks) != n:
        raise ValueError(f"chunks {chunks} must be positive lengths adding up to N = {n}"
                         + (" (an empty stream has no chunks: pass none)" if n == 0 else ""))
    edges = np.cumsum([0, *chunks])
    return list(zip(edges[:-1], edges[1:], strict=True))


def _leaves(tree) -> list[int]:
    return [tree] if isinstance(tree, int) else [x for t in tree for x in _leaves(t)]


def _merge_tree(rule, states, tree, params):
    if tree is None:
        out = states[0]
        for s in states[1:]:
            out = rule.merge(out, s, params)
        return out
    if sorted(_leaves(tree)) != list(range(len(states))):
        raise ValueError(f"tree {tree!r} must use each chunk number 0..{len(states) - 1} once")

    def walk(t):
        if isinstance(t, int):
            return states[t]
        parts = [walk(x) for x in t]
        out = parts[0]
        for p in parts[1:]:
            out = rule.merge(out, p, params)
        return out

    return walk(tree)


def _empty(rule, lay: Layout, params: dict, tree) -> dict[str, np.ndarray]:
    """The results of an empty stream (``FusionRule.finalize_empty``), per row and with the
    feature axis where a result carries it."""
    if tree is not None:
        raise ValueError(f"tree {tree!r} merges chunks, but an empty stream (N = 0) has none")
    vector = vector_results(rule.cascade, lay.vector | rule.cascade.vector_inputs)
    return {k: np.broadcast_to(v, lay.rows + (1, (lay.d or 1) if k in vector else 1))
            for k, v in rule.finalize_empty(params, lay.dtype).items()}


def _params(rule, lay: Layout) -> dict:
    params = {p.name: lay.arrays[p.name] for p in rule.cascade.params}
    params[LENGTH] = lay.dtype.type(lay.n)
    return params


@contextmanager
def _per_row(cascade):
    """Sums add the cascade's per-row inputs last, as the kernels do (``numeric.PER_ROW``);
    an earlier stage's result is not one of them (a kernel holds it next to the stream)."""
    token = PER_ROW.set(frozenset(p.name for p in cascade.params) | {LENGTH})
    try:
        yield
    finally:
        PER_ROW.reset(token)


def run(rule, inputs: dict, chunks=None, tree=None) -> dict[str, np.ndarray]:
    lay = resolve(rule.cascade, inputs)
    with np.errstate(all="ignore"), _per_row(rule.cascade):  # inf - inf, 0 * inf: the laws'
        final = fold(rule, lay, _params(rule, lay), chunks, tree)
    return to_user(rule.cascade, lay, final)


def run_staged(staged, inputs: dict, plans) -> dict[str, np.ndarray]:
    """``StagedRule.evaluate``: each stage folded by ``fold`` in turn (its (chunks, tree) from
    ``plans``), reading the earlier stages' final values as per-row parameters."""
    lay = resolve(staged.cascade, inputs)
    params = {p.name: lay.arrays[p.name] for p in staged.cascade.params}
    params[LENGTH] = lay.dtype.type(lay.n)
    final: dict[str, np.ndarray] = {}
    with np.errstate(all="ignore"), _per_row(staged.cascade):
        for stage, (chunks, tree) in zip(staged.stages, plans, strict=True):
            out = fold(stage.rule, lay, params, chunks, tree)
            final.update(out)
            params.update({k: out[k] for k in stage.results})
    return to_user(staged.cascade, lay, final)


def fold(rule, lay: Layout, params: dict, chunks=None, tree=None) -> dict[str, np.ndarray]:
    """The rule's final values in the layout's (*rows, L, F) arrays: one pass per chunk from
    ``init``, the chunk states merged along ``tree``, then finalize and the per-element
    outputs (``params``: the per-row values by name, N included)."""
    dt = lay.dtype
    streams = [s.name for s in rule.cascade.streams]
    states = []
    for start, stop in _bounds(chunks, lay.n):
        state = rule.init(lay.rows, dt)
        for i in range(start, stop):
            elem = {s: lay.arrays[s][..., i:i + 1, :] for s in streams}
            elem.update(params)
            elem[INDEX], elem[INDEX_KEY] = dt.type(i), i
            state = rule.update(state, elem, params)
        states.append(state)
    final = rule.finalize(_merge_tree(rule, states, tree, params), params) if states \
        else _empty(rule, lay, params, tree)
    env = {**params, **{s: lay.arrays[s] for s in streams}, **final,
           INDEX: np.arange(lay.n, dtype=dt).reshape(lay.n, 1)}
    for comp in rule.components:
        if isinstance(comp, SelectComponent) and comp.reselects:
            name = comp.reduction.name
            final[name] = env[name] = comp.reselect(env, final[name], lay.n, dt)
    for name, expr in rule.cascade.elementwise.items():
        final[name] = compile_expr(expr)(env, dt)
    return final
