"""The derived, proven ``FusionRule``: state, update, merge, finalize, and how to show it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import sympy as sp

from .backward import Backward, backward
from .cascade import INDEX, Cascade
from .components import Component, LinearComponent
from .interpret import run
from .laws import LAWS
from .numeric import compile_expr
from .precision import precision_lines
from .prove import Obligation
from .stash import OutputStash, stashes, tile_anchor
from .state import StateVar, guarded_anchors, primed, working_value


@dataclass(frozen=True)
class FusionRule:
    """A one-pass form of a cascade of reductions, with the identities that prove it.

    Laws: ``update(s, x) = merge(s, state of x alone)``, ``merge`` is associative and
    ``init`` is its identity, so any chunking and any merge tree give the same result
    (up to rounding); each component's obligations prove its part of that.
    """

    cascade: Cascade
    components: tuple[Component, ...]
    running: dict[str, sp.Expr]  # each result as a function of the state (N -> n)
    status: tuple[bool, ...]  # proven? per obligation, as checked when the rule was derived
    name: str | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    # Step 1. What the rule is -------------------------------------------------------
    @property
    def count(self) -> sp.Symbol:
        """The count of elements folded in (n, unless the spec uses that name)."""
        return self.cascade.count

    @property
    def uses_count(self) -> bool:
        count = self.count
        return any(count in e.free_symbols for e in self.running.values()) or any(
            count in getattr(c, "columns", ()) for c in self.components)

    @property
    def state(self) -> tuple[StateVar, ...]:
        """All state variables with their initial values, the count first if used."""
        own = tuple(s for c in self.components for s in c.state)
        count = StateVar(self.count, sp.S.Zero, "number of elements folded in (N at the end)",
                         "count")
        return ((count,) if self.uses_count else ()) + own

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.cascade.outputs

    @property
    def obligations(self) -> tuple[Obligation, ...]:
        return tuple(o for c in self.components for o in c.obligations)

    def verify(self) -> bool:
        """Re-check every proof obligation with sympy; True only if all hold."""
        return all(o.check() for o in self.obligations)

    def update_lines(self) -> list[tuple[object, object]]:
        n = self.count
        count = [(primed(n), n + 1)] if self.uses_count else []
        return count + [line for c in self.components for line in c.update_lines()]

    def merge_lines(self) -> list[tuple[object, object]]:
        n = self.count
        count = [(n, primed(n, "_L") + primed(n, "_R"))] if self.uses_count else []
        return count + [line for c in self.components for line in c.merge_lines()]

    def finalize_lines(self) -> list[tuple[object, object]]:
        shown = [n for n in self.outputs if n in self.running]
        return [(sp.Symbol(n), self.running[n]) for n in shown]

    def elementwise_lines(self) -> list[tuple[object, object]]:
        return [(f"{n}[{INDEX}]", e) for n, e in self.cascade.elementwise.items()]

    @property
    def stashes(self) -> dict[str, OutputStash]:
        """Per-element outputs the statistics pass can write as it goes (``algebra.stash``),
        each with its proven identity."""
        return self.compiled("stashes", lambda: stashes(self.cascade, self.components))

    def stash_lines(self) -> list[tuple[object, object]]:
        out = []
        for n, s in self.stashes.items():
            psi = self.components[s.component].basis[s.column]
            at_tile = {a: tile_anchor(a, self.cascade)
                       for a in self.components[s.component].anchors}
            anchors = ", ".join(map(str, at_tile.values()))
            out.append((f"{n}[{INDEX}]", f"({psi.subs(at_tile)}) * ({s.factor})    # the pass "
                        f"writes the first factor, at its anchors {anchors}"))
        return out

    def backward(self, outputs: tuple[str, ...] | None = None) -> Backward:
        """The backward cascade for the gradients of ``outputs`` (default: the outputs no
        other value reads), derived by reverse-mode differentiation and proven against
        ``sympy.diff`` of the multi-pass definition (``algebra.backward``).

        Examples
        --------
        >>> from algebra import derive
        >>> b = derive("log_softmax").backward()
        >>> print(b.spec)
        g_lse_sum = sum(-dy[i]/lse_sum)
        dx[i] = dy[i] + g_lse_sum*exp(-m + x[i])
        >>> b.saved, b.proven
        (('lse_sum', 'm'), True)
        """
        key = ("backward", None if outputs is None else tuple(outputs))
        return self.compiled(key, lambda: backward(self.cascade, outputs))

    # Step 2. How to show it ---------------------------------------------------------
    def sections(self) -> list[tuple[str, list[tuple[object, object]]]]:
        return [
            ("state (initial value)", [(s.symbol, f"{s.init}    # {s.meaning}")
                                       for s in self.state]),
            ("update (one element; primes mark new values)", self.update_lines()),
            ("merge (two partial states L, R)", self.merge_lines()),
            (f"finalize ({self.count} = N)", self.finalize_lines()),
            (f"per element ({self._elementwise_pass})", self.elementwise_lines()),
            ("stash (per-element outputs written by the statistics pass)", self.stash_lines()),
        ]

    @property
    def _elementwise_pass(self) -> str:
        return "second pass over the stream" if self.components else "one pass: a map, no reduction"

    def __str__(self) -> str:
        proven = sum(self.status)
        head = f"FusionRule {self.name or ''}".rstrip()
        out = [f"{head}  [{proven}/{len(self.obligations)} obligations proven]", "spec:"]
        out += [f"  {line.strip()}" for line in self.cascade.text.strip().splitlines()]
        for title, lines in self.sections():
            if lines:
                out.append(f"{title}:")
                out += [f"  {lhs} = {rhs}" for lhs, rhs in lines]
        out.append("cases:")
        out += [f"  {c.reduction.name}: {c.case}" for c in self.components]
        out.append("precision (what each state needs; storage dtypes change loads and stores "
                   "only):")
        out += [f"  {line}" for line in precision_lines(self)]
        out.append("proof:")
        out += [f"  [{'proven' if ok else 'FAILED'}] {o.name}: {o.statement()}"
                for o, ok in zip(self.obligations, self.status, strict=True)]
        out += [f"  [proven] {s.obligation.name}: {s.obligation.statement()}"
                for s in self.stashes.values()]  # only proven stashes are kept
        return "\n".join(out)

    def to_latex(self) -> str:
        """The rule as a LaTeX ``aligned`` block per section."""
        def tex(v):
            return sp.latex(v) if isinstance(v, sp.Basic) else r"\text{{{}}}".format(str(v).replace(
                "_", r"\_"))
        out = []
        for title, lines in self.sections():
            if lines and not title.startswith("state"):
                rows = r" \\ ".join(f"{tex(lhs)} &= {tex(rhs)}" for lhs, rhs in lines)
                out.append(r"\text{{{}:}}\quad\begin{{aligned}}{}\end{{aligned}}".format(
                    title.split(" (")[0], rows))
        out += [o.latex() for o in self.obligations]
        return "\n".join(out)

    def to_json(self) -> str:
        return json.dumps({
            "name": self.name, "spec": self.cascade.text.strip(), "outputs": list(self.outputs),
            **{title.split(" (")[0]: [[str(a), str(b)] for a, b in lines]
               for title, lines in self.sections()},
            "cases": {c.reduction.name: c.case for c in self.components},
            "proof": [{"name": o.name, "law": o.law, "statement": o.statement(),
                       "proven": ok} for o, ok in zip(self.obligations, self.status,
                                                      strict=True)],
        }, indent=2)

    # Step 3. How to run it (numpy, the inputs' dtype) -------------------------------
    def _running_fns(self):
        return self.compiled("running", lambda: {k: compile_expr(v)
                                                 for k, v in self.running.items()})

    def compiled(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def _anchors(self, comp, state, params, dt, working: bool = True) -> dict[str, np.ndarray]:
        """The component's anchors at this state (plus the parameters its matrix reads);
        ``working``: the working anchors (``algebra.state.working_value``)."""
        fns = self._running_fns()
        env = {**params, **state}
        values = {a.name: np.asarray(fns[a.name](env, dt)) for a in comp.anchors}
        if working:
            guarded = self.compiled("guarded", lambda: guarded_anchors(self.components))
            values = {k: working_value(v, k in guarded, dt) for k, v in values.items()}
        return {**params, **values}

    def init(self, rows: tuple, dtype) -> dict[str, np.ndarray]:
        dt = np.dtype(dtype)
        state = {self.count.name: np.zeros(rows + (1, 1), dt)} if self.uses_count else {}
        for comp in self.components:
            state.update(comp.init(rows + (1, 1), dt))
        return state

    def update(self, state: dict, element: dict, params: dict) -> dict:
        """Fold one element (arrays (*rows, 1, F) by input name, plus 'i') into the state."""
        dt = _dtype_of(state)
        new = dict(state)
        if self.uses_count:
            new[self.count.name] = state[self.count.name] + dt.type(1)
        for comp in self.components:
            comp.update(state, new, element, self._anchors(comp, state, params, dt),
                        self._anchors(comp, new, params, dt), dt)
        return new

    def merge(self, left: dict, right: dict, params: dict) -> dict:
        """Combine two partial states (any order of association gives the same result)."""
        dt = _dtype_of(left)
        out = {}
        if self.uses_count:
            out[self.count.name] = left[self.count.name] + right[self.count.name]
        for comp in self.components:
            comp.merge(left, right, out, self._anchors(comp, left, params, dt),
                       self._anchors(comp, right, params, dt),
                       self._anchors(comp, out, params, dt), dt)
        return out

    def finalize(self, state: dict, params: dict) -> dict[str, np.ndarray]:
        """Every named result (reductions and epilogues) from a complete state: each
        re-anchored sum first settles at the true final anchors, in dependence order."""
        dt = _dtype_of(state)
        final = dict(state)
        for comp in self.components:
            if isinstance(comp, LinearComponent) and comp.anchors:
                comp.settle(final, self._anchors(comp, state, params, dt),
                            self._anchors(comp, final, params, dt, working=False), dt)
        env = {**params, **final}
        return {k: f(env, dt) for k, f in self._running_fns().items()}

    def finalize_empty(self, params: dict, dt: np.dtype) -> dict[str, np.ndarray]:
        """Every named result of an empty stream (N = 0): ``empty_results``, which no state
        could give (a settle at the -inf anchor of an empty max is inf * 0)."""
        identities, epilogues = empty_results(self.cascade)
        env = {**params, **{k: dt.type(v) for k, v in identities.items()}}
        out = {k: np.asarray(env[k]).reshape(1, 1) for k in identities}
        for name, expr in epilogues.items():  # per-row when it reads per-row parameters
            value = np.asarray(compile_expr(expr)(env, dt))
            out[name] = value if value.ndim >= 2 else value.reshape(1, 1)
        return {k: v for k, v in out.items() if k in self.running}

    def evaluate(self, inputs: dict, chunks=None, tree=None) -> dict[str, np.ndarray]:
        """Run the fused one-pass algorithm in numpy, in the inputs' dtype.

        ``chunks``: chunk lengths (default: one chunk of N); each chunk is folded element
        by element from ``init``, and the chunk states are merged along ``tree`` (nested
        tuples of chunk numbers; default: left to right).

        Examples
        --------
        >>> import redfuser
        >>> x = np.array([[1.0, 3.0, 2.0]], np.float32)
        >>> out = redfuser.derive("softmax").evaluate({"x": x}, chunks=[1, 2])
        >>> np.round(out["y"], 4)
        array([[0.09  , 0.6652, 0.2447]], dtype=float32)
        """
        return run(self, inputs, chunks, tree)


def empty_results(cascade: Cascade) -> tuple[dict[str, float], dict[str, sp.Expr]]:
    """The results of an empty stream (N = 0): each reduction is its law's identity (sum 0,
    prod 1, max -inf, min +inf: numpy's and torch's empty reductions), and each epilogue is
    computed from those with IEEE arithmetic (a mean is 0/0 = NaN, logsumexp's log(0) + 0 is
    -inf).  Returns (reduction -> identity, epilogue -> its expression in the reductions).
    Index reductions have no identity: ``algebra.layout`` refuses them on an empty stream.

    Examples
    --------
    >>> from algebra.spec import parse
    >>> empty_results(parse("s = sum(x[i]); m = max(x[i]); mean = s / N"))
    ({'s': 0.0, 'm': -inf}, {'mean': s/N})
    """
    identities = {r.name: float(LAWS[r.op].identity) for r in cascade.reductions}
    results, inlined = cascade.results, {}
    for name, expr in cascade.epilogues.items():  # spec order: what an epilogue reads is first
        inlined[name] = expr.xreplace({results[k]: v for k, v in inlined.items()})
    return identities, inlined


def _dtype_of(state: dict) -> np.dtype:
    for v in state.values():
        if v.dtype.kind == "f":
            return v.dtype
    return np.dtype(np.float64)


