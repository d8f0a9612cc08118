"""The fused form of one reduction: symbolic state/update/merge/finalize, and its numpy run.

Three families (see ``laws.LAWS``):

- ``LinearComponent`` (sum): a state vector S of sums of basis functions psi_k(x, a)
  *at the running anchor a*.  When the anchor moves a -> a', S <- A(a, a') S with the
  derived matrix A; an element adds psi(x, a').  Merge re-anchors both sides to the
  merged anchor and adds.  Laws used (each a proof obligation): psi(x, a') = A psi(x, a),
  A(a, a) = I, A(a1, a2) A(a0, a1) = A(a0, a2).
- ``SelectComponent`` (max/min/arg*/topk): keeps the best g(x) (and its index); the
  body F(g, a) is applied at finalize, which is exact because F is monotone in g.
- ``ProductComponent`` (prod): keeps the plain product of an anchor-free factor; a prod()
  reduction uses one for the signs of its factors (+-1, 0, NaN: never out of range) next to
  a ``LinearComponent`` summing the logs of their magnitudes (``derive._product``).

The numpy run (used by ``FusionRule.evaluate``) is the kernel's algorithm in the
inputs' dtype.  Non-finite anchors follow laws that make the fused pass agree with
the float64 multi-pass reference.  Re-anchoring is exact for *any* anchor value, so
during the pass a state is kept at a *working* anchor: the running value where it
is finite, 0 where it is not (-inf before any element, 0/0 for an empty mean); at
finalize each state moves from its working anchors to the true final ones with IEEE
arithmetic, which reproduces the reference's inf and NaN exactly where it has them.
In the pass, an unmoved anchor keeps the state, and a factor that is exactly 0
annihilates while the empty state 0 stays 0 under any factor (``mul0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import sympy as sp

from .cascade import Reduction
from .families import Family, select_family
from .functions import Maximum, Minimum
from .laws import LAWS
from .numeric import compile_expr
from .prove import Obligation
from .state import INDEX_KEY, INDEX_SENTINEL, StateVar, mul0, primed

U = sp.Dummy("u", real=True)  # the stream quantity g(x) inside F(g, a): no spec name is it


def _same(old: dict, new: dict, anchors) -> np.ndarray | bool:
    same = True
    for a in anchors:
        same = same & (old[a.name] == new[a.name])
    return same


@dataclass(frozen=True)
class Component:
    """Common part: the reduction, which case applied, its state and proof obligations."""

    reduction: Reduction
    case: str
    state: tuple[StateVar, ...]
    anchors: tuple[sp.Symbol, ...]
    finalize: sp.Expr  # the reduction's value from the state, at the final anchors
    obligations: tuple[Obligation, ...]
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def compiled(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def init(self, shape: tuple, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {s.symbol.name: np.full(shape, float(s.init), dtype) for s in self.state}


@dataclass(frozen=True)
class LinearComponent(Component):
    """sum: state = sums of basis functions at the running anchor, re-anchored by a matrix."""

    columns: tuple[sp.Symbol, ...] = ()  # state symbols, the rule's count when a column is 1
    basis: tuple[sp.Expr, ...] = ()  # psi_k(x, a) for each column
    matrix: sp.Matrix = field(default_factory=lambda: sp.Matrix())  # A(a, a') over columns
    guards: frozenset[str] = frozenset()  # anchors whose powers the state keeps (1/m, m**2)

    @property
    def family(self) -> Family:
        return Family.ANCHORED_SUM if self.anchors else Family.SUM

    def counts(self, r: int) -> bool:
        """Is column r the rule's count of elements (basis 1)?  Its row is the count's
        business (the rule keeps one count for every component)."""
        return self.basis[r] == 1

    def update_lines(self) -> list[tuple[sp.Expr, sp.Expr]]:
        """S' = A(a, a') S + psi(x, a')  (the count's own row is the rule's business)."""
        new = {a: primed(a) for a in self.anchors}
        rows = self.matrix * sp.Matrix(self.columns)
        return [(primed(c), rows[r] + self.basis[r].subs(new, simultaneous=True))
                for r, c in enumerate(self.columns) if not self.counts(r)]

    def merge_lines(self) -> list[tuple[sp.Expr, sp.Expr]]:
        """S = A(a_L, a) S_L + A(a_R, a) S_R."""
        out = []
        for side in ("_L", "_R"):
            sub = {**{a: primed(a, side) for a in self.anchors},
                   **{primed(a): a for a in self.anchors},
                   **{c: primed(c, side) for c in self.columns}}
            out.append(self.matrix.subs(sub, simultaneous=True)
                       * sp.Matrix([sub[c] for c in self.columns]))
        return [(c, out[0][r] + out[1][r]) for r, c in enumerate(self.columns)
                if not self.counts(r)]

    def _program(self):
        entries = [(r, k, compile_expr(v)) for r in range(len(self.columns))
                   for k, v in enumerate(self.matrix.row(r)) if v != 0]
        return entries, [compile_expr(b) for b in self.basis]

    def _reanchor(self, src: dict, a_old: dict, a_new: dict, dt, ieee: bool = False) -> list:
        """A(a_old, a_new) @ S, with the identity where the anchors did not move; products use
        ``mul0`` (an empty state stays empty) unless ``ieee`` (finalize: inf * 0 = NaN, as the
        multi-pass reference computes exp(-inf - -inf))."""
        entries, _ = self.compiled("prog", self._program)
        env = {**a_old, **{a.name + "'": a_new[a.name] for a in self.anchors}}
        out = [dt.type(0)] * len(self.columns)
        times = np.multiply if ieee else mul0
        for r, k, entry in entries:
            out[r] = out[r] + times(np.asarray(entry(env, dt)), src[self.columns[k].name])
        same = _same(a_old, a_new, self.anchors)
        return [np.where(same, src[c.name], o) for c, o in zip(self.columns, out, strict=True)]

    def update(self, old, new, elem, a_old, a_new, dt):
        _, basis = self.compiled("prog", self._program)
        moved = self._reanchor(old, a_old, a_new, dt)
        env = {**elem, **a_new}
        for r, c in enumerate(self.columns):
            if not self.counts(r):
                new[c.name] = moved[r] + basis[r](env, dt)

    def shift_degrees(self) -> dict[tuple[int, int], int]:
        """How fast each matrix entry grows with the anchor shift t = a' - a (exp and wave
        factors aside: they are no powers of t): its degree in t, a kept ratio (m / m')**2
        counting as -2."""
        t = sp.Dummy("t")
        shift = {primed(a): a + t for a in self.anchors}
        out = {}
        for r in range(len(self.columns)):
            for k, v in enumerate(self.matrix.row(r)):
                for bounded in (sp.exp, sp.sin, sp.cos):  # factors, not powers of the shift
                    v = v.replace(bounded, lambda *_: sp.S.One)
                out[(r, k)] = _growth(v.subs(shift), t) if v != 0 else -1
        return out

    def settle(self, state: dict, a_work: dict, a_true: dict, dt):
        """Finalize: move the state from the working anchors it was kept at to the true final
        anchors (they differ only where a true anchor is not finite).  IEEE products, so
        exp(-inf - -inf) = NaN appears as in the reference; where the shift is infinite and
        every element was finite (every column is), the highest power of the shift that
        meets a non-zero state dominates: sum((x - m)**2) at m = -inf is +inf, not
        inf - inf.  An infinite element makes a column infinite, and then IEEE decides,
        as in the reference: variance with one -inf is NaN ((-inf - -inf)**2)."""
        entries, _ = self.compiled("prog", self._program)
        degree = self.compiled("degree", self.shift_degrees)
        env = {**a_work, **{a.name + "'": a_true[a.name] for a in self.anchors}}
        finite = np.all([np.isfinite(a_true[a.name]) for a in self.anchors], axis=0)
        for c in self.columns:  # (columns differ in shape: a count next to a D-vector)
            finite = finite | ~np.isfinite(state[c.name])
        rows: dict[int, list] = {}
        for r, k, entry in entries:
            s_k = state[self.columns[k].name]
            rows.setdefault(r, []).append((degree[(r, k)], np.asarray(entry(env, dt)) * s_k,
                                           s_k != 0))
        for r, c in enumerate(self.columns):
            if self.counts(r) or r not in rows:
                continue
            full = sum(term for _, term, _ in rows[r])
            top = np.max([np.where(nz, d, -1) for d, _, nz in rows[r]], axis=0)
            limit = sum(np.where(nz & (d == top), term, 0) for d, term, nz in rows[r])
            state[c.name] = np.where(finite | (top <= 0) | _wild(state, self.columns, entries, r),
                                     full, limit)

    def merge(self, left, right, out, a_left, a_right, a_out, dt):
        from_l = self._reanchor(left, a_left, a_out, dt)
        from_r = self._reanchor(right, a_right, a_out, dt)
        for r, c in enumerate(self.columns):
            if not self.counts(r):
                out[c.name] = from_l[r] + from_r[r]


def _growth(v: sp.Expr, t: sp.Dummy) -> int:
    """Degree of numerator minus degree of denominator in t (0 for anything else)."""
    num, den = sp.fraction(sp.together(v))
    try:
        return sp.Poly(num, t).degree() - sp.Poly(den, t).degree()
    except sp.PolynomialError:
        return 0


@dataclass(frozen=True)
class SelectComponent(Component):
    """max/min/arg*/topk: keep the best g(x) (ties: first index); F(g, a) at finalize."""

    core: sp.Expr = sp.S.Zero  # g(x)
    outer: sp.Expr = U  # F(u, a)
    direction: int = 1  # +1: larger g is better
    k: int = 1

    @property
    def family(self) -> Family:
        return select_family(self.k, len(self.state) > 1)  # (value, index) pairs

    def update_lines(self) -> list[tuple[object, object]]:
        value, index = (s.symbol for s in self.state) if len(self.state) > 1 else \
            (self.state[0].symbol, None)
        better = ">" if self.direction > 0 else "<"
        if self.k > 1:
            keep = f"the {self.k} best of {value} and {self.core}"
            if index is None:
                return [(primed(value), keep)]
            return [(f"({primed(value)}, {primed(index)})", f"{keep}, with indices {index} "
                     f"and i (ties: lower index first)")]
        if index is None:
            best = Maximum if self.direction > 0 else Minimum
            return [(primed(value), best(value, self.core))]
        return [(f"({primed(value)}, {primed(index)})",
                 f"({self.core}, i) if {self.core} {better} {value} else ({value}, {index})")]

    def merge_lines(self) -> list[tuple[object, object]]:
        names = [s.symbol for s in self.state]
        if self.k > 1:
            return [(f"({', '.join(map(str, names))})", f"the {self.k} best of the union of L "
                     "and R (ties: lower index first)")]
        if len(names) == 1:
            best = Maximum if self.direction > 0 else Minimum
            return [(names[0], best(primed(names[0], "_L"), primed(names[0], "_R")))]
        v, j = names
        better = ">" if self.direction > 0 else "<"
        return [(f"({v}, {j})", f"L if {v}_L {better} {v}_R or ({v}_L == {v}_R and "
                                f"{j}_L < {j}_R) else R")]

    def init(self, shape, dtype):
        shape = (*shape[:-2], self.k, 1)
        out = {}
        for s in self.state:
            if s.kind.is_index:
                out[s.symbol.name] = np.full(shape, INDEX_SENTINEL, np.int64)
            else:
                out[s.symbol.name] = np.full(shape, float(s.init), dtype)
        return out

    def _names(self):
        value = self.state[0].symbol.name
        index = self.state[1].symbol.name if len(self.state) > 1 else None
        return value, index

    def _select(self, v, j, out):
        """Keep the k best of candidates (v, j) along axis -2: by value, then lowest index."""
        value, index = self._names()
        if index is None:  # values only: a plain maximum/minimum (NaN propagates, as np.max)
            best = np.maximum if self.direction > 0 else np.minimum
            out[value] = best.reduce(v, axis=-2, keepdims=True) if self.k == 1 else \
                np.take_along_axis(v, rank_order(v, np.zeros(v.shape, np.int64), self.direction)
                                   [..., : self.k, :], axis=-2)
            return
        order = rank_order(v, j, self.direction)[..., : self.k, :]
        out[value] = np.take_along_axis(v, order, axis=-2)
        out[index] = np.take_along_axis(j, order, axis=-2)

    def update(self, old, new, elem, a_old, a_new, dt):
        value, index = self._names()
        g = self.compiled("g", lambda: compile_expr(self.core))(elem, dt)
        g = np.broadcast_to(g, np.broadcast_shapes(g.shape, old[value].shape[:-2] + (1, 1)))
        v = _concat(old[value], g)
        j = _concat(old[index], np.full(g.shape, elem[INDEX_KEY], np.int64)) if index else None
        self._select(v, j, new)

    def merge(self, left, right, out, a_left, a_right, a_out, dt):
        value, index = self._names()
        v = _concat(left[value], right[value])
        j = _concat(left[index], right[index]) if index else None
        self._select(v, j, out)

    @property
    def reselects(self) -> bool:
        """A selection of an anchored body: exact only where the final anchors are finite."""
        return bool(self.anchors)

    @property
    def flat_factors(self) -> tuple[sp.Expr, ...]:
        """The anchor-only factors of dF/du.  The commutation max(F(g, a)) = F(max(g), a)
        is proven for real anchors at which F is strictly monotone; where such a factor is
        0 or not finite at the final anchors, F is flat or NaN in g, and the elements'
        own F(g) decide (r2 = max(x * r0) with r0 = min(sigmoid(x)) = 0, reached at
        x = -inf: the reference's max holds 0 * -inf = NaN, 0 * max(x) is 0).

        Examples
        --------
        >>> from algebra.pipeline import derive
        >>> rule = derive("r0 = min(sigmoid(x[i])); r2 = max(x[i] * r0)")
        >>> [c.flat_factors for c in rule.components if c.anchors]
        [(r0,)]
        """
        names = {a.name for a in self.anchors}
        return tuple(f for f in sp.Mul.make_args(sp.factor_terms(sp.diff(self.outer, U)))
                     if f.free_symbols and {v.name for v in f.free_symbols} <= names)

    def reselect(self, env: dict, result: np.ndarray, n: int, dt) -> np.ndarray:
        """The result (values, or indices) where every final anchor is finite, else the
        selection over the body itself.  The commutation argmax(F(g, a)) = argmax(g) is
        proven for real a; at a NaN or infinite anchor F is flat or NaN in g (exp(x - NaN)
        is NaN for every x, so the lowest indices win, as in the reference), and so it is
        where a ``flat_factors`` entry is 0 or not finite.  ``env``: the
        whole stream (*rows, N, F), the parameters and the final results; ``n``: the stream
        length."""
        anchors = [np.asarray(env[a.name]) for a in self.anchors]
        factors = [np.asarray(compile_expr(f)(env, dt)) for f in self.flat_factors]
        flat = np.any([~np.isfinite(a) for a in anchors] +
                      [(f == 0) | ~np.isfinite(f) for f in factors], axis=0)
        if not np.any(flat):
            return result
        v = np.asarray(compile_expr(self.reduction.body)(env, dt), dt)
        v = np.broadcast_to(v, np.broadcast_shapes(v.shape, flat.shape[:-2] + (n, 1)))
        j = np.broadcast_to(np.arange(n, dtype=np.int64).reshape(n, 1), v.shape)
        order = rank_order(v, j, LAWS[self.reduction.op].direction)[..., : self.k, :]
        chosen = j if self.state[-1].kind.is_index else v
        return np.where(flat, np.take_along_axis(chosen, order, axis=-2), result)


def _wild(state: dict, columns, entries, r: int) -> np.ndarray:
    """Where a state read by row ``r`` of the settle is not finite.  The dominant power of an
    infinite shift decides the limit only over finite states; an infinite state means an
    infinite element, whose body at an infinite anchor is inf - inf = NaN or an infinity
    (its sign against the anchor's), as the IEEE sum of the terms has it."""
    read = [np.asarray(state[columns[k].name]) for row, k, _ in entries if row == r]
    return np.any([~np.isfinite(s) for s in read], axis=0)


def _concat(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Join candidates along axis -2, broadcasting rows and the feature axis."""
    rows = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    feat = np.broadcast_shapes(a.shape[-1:], b.shape[-1:])
    a = np.broadcast_to(a, rows + a.shape[-2:-1] + feat)
    b = np.broadcast_to(b, rows + b.shape[-2:-1] + feat)
    return np.concatenate([a, b], axis=-2)


def rank_order(v: np.ndarray, j: np.ndarray, direction: int) -> np.ndarray:
    """Positions along axis -2 from best to worst: NaN first (NaN wins a selection, as in
    np.max and np.argmax), then by value in ``direction``, ties by lower index, and empty
    slots (index INDEX_SENTINEL) last.  Stable sorts, least significant key first."""
    order = np.argsort(j, axis=-2, kind="stable")
    for key in (lambda v, j: -v if direction > 0 else v,
                lambda v, j: ~np.isnan(v),
                lambda v, j: j == INDEX_SENTINEL):
        k = key(np.take_along_axis(v, order, axis=-2), np.take_along_axis(j, order, axis=-2))
        order = np.take_along_axis(order, np.argsort(k, axis=-2, kind="stable"), axis=-2)
    return order


@dataclass(frozen=True)
class ProductComponent(Component):
    """A plain product of an anchor-free factor: the signs of a prod()'s factors."""

    factor: sp.Expr = sp.S.One  # G(x)

    @property
    def family(self) -> Family:
        return Family.PRODUCT

    def update_lines(self) -> list[tuple[sp.Expr, sp.Expr]]:
        p = self.state[0].symbol
        return [(primed(p), p * self.factor)]

    def merge_lines(self) -> list[tuple[sp.Expr, sp.Expr]]:
        p = self.state[0].symbol
        return [(p, primed(p, "_L") * primed(p, "_R"))]

    def update(self, old, new, elem, a_old, a_new, dt):
        name = self.state[0].symbol.name
        new[name] = old[name] * self.compiled("G", lambda: compile_expr(self.factor))(elem, dt)

    def merge(self, left, right, out, a_left, a_right, a_out, dt):
        name = self.state[0].symbol.name
        out[name] = left[name] * right[name]
