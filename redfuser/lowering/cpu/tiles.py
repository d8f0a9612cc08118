"""Tiles: whole blocks of elements folded at the tile's own final anchors, then merged.

Each tile starts from the identity state in its own lane(s).  Components are folded
level by level (a level's anchors come from earlier levels only), so every anchor is
final for the tile when it is read: the re-anchoring matrix is the identity inside the
tile and the derived merge pays the rescale once per tile instead of once per element.

- Many lanes (scalar states): lane l takes elements base + k*lanes + l (vectorized over
  the lanes).
- One lane (feature vectors, dot products: attention): the dot products of the tile are
  computed first, then the slot-invariant part of each basis (``exp(s - m)``) for all the
  tile's elements in one loop vectorized over the elements, then the D-vector sums.
- Blocks of rows (one lane, a stream shared by the rows: attention's K/V, a GEMM's
  weights): the rows of a block fold the same tile together and every load of the shared
  stream serves all of them; the D-vector sums run slot-chunk outermost, so each row's
  chunk of the sum stays in a register across the tile (a GEMM micro-kernel: tile x rows
  x the vector's lanes).

Vectors are ``em.simd`` lanes of the kernel's compute dtype (16 float32 or 8 float64 on
AVX-512), and every buffer here holds the compute dtype (``Geometry.compute``).
"""

from __future__ import annotations

import sympy as sp

from algebra.rule import FusionRule

from ...tvm.ir import T, tirx
from ..emitter import Emitter, folded
from ..invariants import split_invariant
from ..registers import Const0, States
from ..texpr import const
from .plan import ISA, LANES
from .prefetch import prefetch_rows

FEATURE_CHUNKS = 8  # D / vector lanes from which dots run along the features (tile_dots)
FEATURE_GROUPS = (4, 2, 1)  # elements a step of those dots covers, most first


def levels(rule: FusionRule, components) -> list[list]:
    """``components`` (the rule's that are folded) in groups whose anchors all come from
    earlier groups: a group's tile loops are one loop, so a shared exp(x - m) is computed
    once per element."""
    aliases = folded(rule)[1]
    out, produced = [], set()
    for comp in components:
        reads = {aliases.get(s.name, s.name)
                 for a in comp.anchors for s in rule.running[a.name].free_symbols}
        if not out or reads & produced:
            out.append([])
            produced = set()
        out[-1].append(comp)
        produced |= {s.symbol.name for s in comp.state}
    return out


def _share_best(em: Emitter, st: States, level, lanes: int, at: int):
    """Write the tile's best of each single selection of ``level`` into all its lanes
    ``at .. at + lanes`` (a halving tree, then a broadcast): their anchors are then equal."""
    for comp in level:
        if not comp.family.single:
            continue
        half = lanes // 2
        while half >= 1:
            with _lane_loop(half) as lane:
                em.merge_select(st, comp, at + lane, at + lane + half)
            half //= 2
        with _lane_loop(lanes) as lane:
            for s in comp.state:
                st.set(s.symbol.name, at + lane, st.get(s.symbol.name, at))


def _lane_loop(lanes: int):
    """A vectorized loop over the lanes; none for one lane (the slot loop inside may then
    be the vectorized one: vector loops cannot nest)."""
    return T.vectorized(0, lanes) if lanes > 1 else Const0()


def _start(st: States, lane, tile: int):
    st.init(lane)
    if st.count in st.bufs:
        st.set(st.count, lane, const(float(tile)))


def tile(em: Emitter, st: States, r, base, lanes: int, size: int, aligned: bool = False,
         first: bool = False):
    """One row: lanes [lanes, 2 lanes) hold the tile of lanes x size elements, merged into
    the running lanes [0, lanes) at the end.  ``first``: the row's first tile, folded
    straight into the running lanes (they hold the identity: the merge would be a copy).
    ``aligned`` (``lane_aligned``): each level's single selections are shared by all lanes.
    One lane (no stash there): under a mask, like ``tile_rows``."""
    if lanes == 1:
        return masked(em, [r], base, size, lambda: _tile(em, st, r, base, lanes, size,
                                                         aligned, first))
    return _tile(em, st, r, base, lanes, size, aligned, first)


def _tile(em: Emitter, st: States, r, base, lanes: int, size: int, aligned: bool,
          first: bool):
    at = 0 if first else lanes
    dots = tile_dots(em, [r], base, lanes * size)[0] if lanes == 1 else None
    with _lane_loop(lanes) as lane:
        _start(st, at + lane, size)
    grouped = levels(em.rule, em.components)
    for level in grouped:
        with _lane_loop(lanes) as lane:
            _hold(em, st, level, at + lane, r)
        bases = tile_bases(em, st, level, r, base, size, dots, at) if lanes == 1 else \
            [None] * len(level)
        with T.serial(0, size) as k:
            if em.plan.ahead and level is grouped[-1]:  # the row is in L1 by now
                prefetch_rows(em, r, base + k * lanes, lanes, em.plan.ahead)
            with _lane_loop(lanes) as lane:
                for comp, pre in zip(level, bases, strict=True):
                    em.tile_step(st, comp, lane if em.lowering(comp).direct else at + lane,
                                 base + k * lanes + lane, r, dots(k) if dots else {},
                                 pre and (pre[0], pre[1](k)))
        if aligned:
            _share_best(em, st, level, lanes, at)
    if not first:
        with _lane_loop(lanes) as lane:
            em.merge(st, lane, lanes + lane, r, tile=True)


def tile_rows(em: Emitter, sts: list, rows: list, base, size: int):
    """A block of rows, one lane each: lane 1 of every row's registers holds the tile."""
    masked(em, rows, base, size, lambda: _tile_rows(em, sts, rows, base, size))


def masked(em: Emitter, rows: list, base, size: int, emit):
    """``emit`` the tile under a mask (``Emitter.block_mask``, e.g. causal attention's
    i <= pos): skipped where the mask excludes all of it (about half the tiles of a causal
    prefill), emitted with the mask true where it includes all of it (no select, no
    count), and as it is only across the mask's edge."""
    mask = em.block_mask(rows, base, size)
    if mask is None:
        return emit()
    cond, none, every = mask
    with T.If(tirx.Not(none)), T.Then():
        with T.If(every):
            with T.Then(), em.assuming({cond: sp.true}):
                emit()
            with T.Else():
                emit()


def _tile_rows(em: Emitter, sts: list, rows: list, base, size: int):
    dots = tile_dots(em, rows, base, size)
    for st in sts:
        _start(st, 1, size)
    for level in levels(em.rule, em.components):
        for st, r in zip(sts, rows, strict=True):
            _hold(em, st, level, 1, r)
        bases = [tile_bases(em, st, level, r, base, size, d)
                 for st, r, d in zip(sts, rows, dots, strict=True)]
        wide = [_wide(em, sts[0], comp) for comp in level]
        for j, comp in enumerate(level):
            if wide[j]:
                _vector_sums(em, sts, comp, rows, base, size, dots, [b[j] for b in bases])
        with T.serial(0, size) as k:
            for st, r, d, pre in zip(sts, rows, dots, bases, strict=True):
                for j, comp in enumerate(level):
                    if not wide[j]:
                        em.tile_step(st, comp, 0 if em.lowering(comp).direct else 1, base + k, r,
                                     d(k) if d else {}, pre[j] and (pre[j][0], pre[j][1](k)))
    for st, r in zip(sts, rows, strict=True):
        em.merge(st, 0, 1, r, tile=True)


def _hold(em: Emitter, st: States, level, lane, r):
    for comp in level:
        if comp.family.anchored:
            em.hold_for(st, comp, lane, r)


def _wide(em: Emitter, st: States, comp) -> bool:
    """A sum whose every column is a feature vector filling whole vectors."""
    if not comp.family.linear:
        return False
    cols = [c.name for r, c in enumerate(comp.columns) if not comp.counts(r)]
    return bool(cols) and all(st.widths[c] == em.geo.d for c in cols) and \
        em.geo.d % em.simd == 0


def _vector_sums(em: Emitter, sts, comp, rows, base, size: int, dots, pres):
    """S_row[slot] += basis(row, element, slot) over the tile, slot chunks outermost: the
    loop over the tile's elements sits between the chunk loop and the vectorized slots, so
    each row's chunk of S stays in a register and each streamed load serves every row."""
    cols = [c.name for r, c in enumerate(comp.columns) if not comp.counts(r)]
    names = [a.name for a in comp.anchors]
    lanes = em.simd
    with T.serial(0, em.geo.d // lanes) as chunk:
        with T.serial(0, size) as k:
            with T.vectorized(0, lanes) as lane:
                slot = chunk * lanes + lane
                for st, r, d, pre in zip(sts, rows, dots, pres, strict=True):
                    basis = em.basis_values(comp, r, base + k, em.held(st, 1, names),
                                      d(k) if d else {}, pre and (pre[0], pre[1](k)))
                    values = dict(zip([c.name for c in comp.columns], basis(slot),
                                      strict=True))
                    for c in cols:
                        st.set(c, 1, st.get(c, 1, slot) + values[c], slot)


def tile_dots(em: Emitter, rows: list, base, count: int) -> list:
    """Dot products of elements base .. base + count - 1, per row, into local buffers
    (computed once, the rows sharing each streamed load); per row None (no dots) or
    k -> {dot: value at element base + k}."""
    found = em.dot_list
    if not found:
        return [None] * len(rows)
    caches = [T.alloc_buffer((len(found), count), em.geo.compute, scope=em.scratch)
              for _ in rows]
    group = _feature_group(em, len(rows), count)
    for j, dot in enumerate(found):
        if group:
            _dots_along_features(em, caches, rows, base, count, j, dot, group)
            continue
        # the tile's elements in the vector lanes, the feature axis outermost: no horizontal
        # sums, and each (strided) load of the stream serves every row of the block
        with T.vectorized(0, count) as k:
            for cache in caches:
                T.buffer_store(cache, const(0.0), [j, k])
        with T.serial(0, em.geo.d) as f:
            with T.vectorized(0, count) as k:
                for cache, r in zip(caches, rows, strict=True):
                    look = em.base_lookup(r, base + k, f)
                    T.buffer_store(cache, cache[j, k] + em.expr(dot.args[0], look) *
                                   em.expr(dot.args[1], look), [j, k])
    return [lambda k, cache=cache: {dot: cache[j, k] for j, dot in enumerate(found)}
            for cache in caches]


def _feature_group(em: Emitter, rows: int, count: int) -> int:
    """Elements whose dot products run together along the feature axis (0: keep the tile's
    elements in the lanes).  Along the features every load is contiguous (the other way
    reads the stream's column: a gather per vector), but each (row, element) sum ends in a
    horizontal add, so it pays where D spans at least FEATURE_CHUNKS vectors; the group's
    sums (rows x group vectors, one panel vector each and a broadcast) must fit the
    registers."""
    if em.geo.d % em.simd or em.geo.d // em.simd < FEATURE_CHUNKS:
        return 0  # (``ISA.fits`` counts columns in float32 lanes: g * LANES is g vectors)
    return next((g for g in FEATURE_GROUPS if count % g == 0 and ISA.fits(rows, g * LANES)),
                0)


def _dots_along_features(em: Emitter, caches, rows, base, count: int, j: int, dot,
                         group: int):
    """cache[j, k] = dot at element base + k for every row: ``group`` elements at a time,
    a vector of features per step into rows x group register sums, then one horizontal sum
    each (a pairwise tree: the same order every run)."""
    lanes = em.simd
    acc = T.alloc_buffer((len(rows), group, lanes), em.geo.compute, scope="local")
    with T.serial(0, count // group) as g:
        for ri in range(len(rows)):
            with T.unroll(0, group) as e:
                with T.vectorized(0, lanes) as lane:
                    T.buffer_store(acc, const(0.0), [ri, e, lane])
        with T.serial(0, em.geo.d // lanes) as chunk:
            with T.unroll(0, group) as e:
                with T.vectorized(0, lanes) as lane:
                    for ri, r in enumerate(rows):
                        look = em.base_lookup(r, base + g * group + e, chunk * lanes + lane)
                        T.buffer_store(acc, acc[ri, e, lane] + em.expr(dot.args[0], look) *
                                       em.expr(dot.args[1], look), [ri, e, lane])
        for ri, cache in enumerate(caches):
            with T.unroll(0, group) as e:
                parts = [acc[ri, e, lane] for lane in range(lanes)]
                while len(parts) > 1:
                    parts = [a + b for a, b in zip(parts[::2], parts[1::2], strict=True)]
                T.buffer_store(cache, parts[0], [j, g * group + e])


def tile_bases(em: Emitter, st: States, comps, r, base, count: int, dots,
               lane: int = 1) -> list:
    """One-lane tiles: the slot-invariant parts of the bases of ``comps`` for every element
    of the tile, in one loop vectorized over the elements (attention's exp(s - m) for 16
    keys at once instead of one scalar exp per key).  Returns, per comp, None or (basis
    with those parts as symbols, k -> {symbol: value at base + k})."""
    split = [split_invariant(c.basis, em.vec)
             if c.family.linear else None for c in comps]
    parts = [(e, sym) for one in split if one for e, sym in one[1].items()]
    if not parts:
        return [None] * len(comps)
    cache = T.alloc_buffer((len(parts), count), em.geo.compute, scope=em.scratch)
    names = sorted({a.name for c in comps for a in c.anchors if c.family.linear})
    with T.vectorized(0, count) as k:
        look = em.base_lookup(r, base + k, 0, {**(dots(k) if dots else {}),
                                               **em.row_values(em.held(st, lane, names))})
        for j, (e, _) in enumerate(parts):
            T.buffer_store(cache, em.expr(e, look), [j, k])
    column = {sym: j for j, (_, sym) in enumerate(parts)}

    def at(syms):
        return lambda k: {sym: cache[column[sym], k] for sym in syms}

    return [one and (one[0], at(list(one[1].values()))) for one in split]
