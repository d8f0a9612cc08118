"""A rule's matrix products on AMX tiles of 16-bit operands (``tile_dots``: bfloat16), the
rest of the cascade beside them: RMSNorm + GEMM with bfloat16 activations and weights.

``tdpbf16ps C, A, B`` adds to each float32 C[r, c] (16 x 16) the products of row r of A
(16 rows of 32 k values, 64 bytes) with column c of B, whose row kp holds the pairs
(W[2 kp, c], W[2 kp + 1, c]) of its 16 columns: W packed in k-pairs, one 32-bit word per
(kp, column).  The A tiles are loaded from ``a(row, i)`` as bfloat16 terms whose sum is
it exactly (``tile_dots.terms``: an input's own bits, or the two halves of a product of
two), padded with zeros to whole tiles; each term is one pass of the tiles.  Why the
result is the float32 kernel's is ``tile_dots``.

The nest, three passes:

1. rows in parallel: the rest of the cascade (RMSNorm's ``sum(x**2)``) over the whole row
   into a workspace, and the row's operand terms written into ``us`` (rows rounded up to
   blocks of 32, K to blocks of ``plan.kc``, zeros past the ends: tile loads read whole
   tiles, and a zero times W's zero padding adds nothing);
2. groups of ``plan.nc / 32`` panels of 32 columns in parallel.  Per K block of ``plan.kc``
   values a group packs its panels (W's rows read ``plan.nc`` columns at a time: one
   panel's 64 bytes a row would touch a new page per row, 2.5 ms of 9 at 256 x 4096 ->
   4096), then each panel's 2 x 2 C tiles pass over every block of 32 rows.  The sums go
   to a float32 buffer between K blocks;
3. rows in parallel: the statistics merged, and each result computed from the sums
   (``gemm.row_results``).
"""

from __future__ import annotations

from collections.abc import Callable

from algebra.rule import FusionRule

from ...tvm.ir import T, tirx
from ...tvm.target import cpu_has, host_target
from ..emitter import Emitter
from ..fastmath import isfinite, isnan
from ..geometry import Geometry
from ..invariants import rule_scores
from ..nests import workspace
from ..products import Product, products, without
from ..signature import F32
from ..texpr import BF16_BITS, share, stored
from .amx import (
    A_TILES,
    B_TILES,
    C_TILES,
    TILE_BYTES,
    TILE_ROWS,
    address,
    byte_stride,
    configure,
    tile_op,
    tile_reg,
    zero_rows,
)
from .gemm import fold_statistics, merged_statistics, row_results
from .plan import EMITTER_OPTIONS, CpuPlan, rows_loop
from .tile_dots import TileDot, refusal, terms, tile_dot_named

BLOCK = 2 * TILE_ROWS  # rows and columns of a block of 2 x 2 C tiles
PAIR = 2  # k values per 32-bit word of a B tile row
U16, U32 = "uint16", "uint32"


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def rolling(rule: FusionRule, geo: Geometry, plan: CpuPlan, bufs: dict, results: dict,
            elementwise: dict, rowvals: dict, fold: Callable) -> None:
    """The tiled nest of ``rule`` (its matrix products meet ``tile_dots.CONDITIONS``) into
    the active IRBuilder frame; ``fold`` folds a piece of a row (``variants._fold``),
    ``rowvals`` are per-row values of earlier passes."""
    found, dot = products(rule, geo), tile_dot_named(plan.tile_dot)
    _check(found, geo, dot, plan)
    rest = without(rule, found)
    scores = rule_scores(rule)
    values = {**rowvals, **results}
    em, em_rest = (Emitter(r, geo, plan, bufs, values, scores=scores, **EMITTER_OPTIONS)
                   for r in (rule, rest))
    rows, depth = _round_up(geo.r, BLOCK), _round_up(geo.n, plan.kc)
    width = _round_up(geo.d, BLOCK)
    us = {p.state: [T.alloc_buffer((rows, depth), BF16_BITS) for _ in range(terms(p, geo, dot))]
          for p in found}
    sums = {p.state: Flat(T.alloc_buffer((rows * width,), F32), width) for p in found}
    work = workspace(rest, geo, geo.r) if rest.components else None
    with rows_loop(geo)(0, geo.r) as r:
        if work is not None:
            fold_statistics(em_rest, plan, fold, work, r, 0, geo.n, r)
        for p in found:
            _operand_row(em, p, us[p.state], r, depth)
    for p in found:
        sums[p.state].declare()
        for u in us[p.state]:
            zero_rows(u, geo.r)
        Tiles(dot.intrinsic, plan, geo, us[p.state],
              bufs[p.weight]).product(sums[p.state])
    with rows_loop(geo)(0, geo.r) as r:
        st = merged_statistics(em_rest, work, r, 1)
        row_results(em, geo, found, sums, st, r, results)
        em.elementwise(r, elementwise)


def _check(found: list, geo: Geometry, dot: TileDot, plan: CpuPlan) -> None:
    """Refuse, by name, a plan asking for tiles the products or the host cannot take."""
    if not found:
        raise ValueError(f"plan {plan}: {dot.name} tiles need matrix products, and this "
                         "rule has none here")
    for p in found:
        why = refusal(p, geo, dot)
        if why is not None:
            raise ValueError(f"plan {plan}: product {p.state} may not run on {dot.name} "
                             f"tiles: {why}")
    if not cpu_has(host_target(), dot.feature):
        raise ValueError(f"plan {plan}: this host has no {dot.feature} that this process "
                         "may use")


def _operand_row(em: Emitter, p: Product, us: list, r, depth: int) -> None:
    """Row r of a(row, i) as ``len(us)`` bfloat16 terms (``tile_dots.terms``), zeros past N:
    one input's bits as they are, or the exact float32 product of two split into its top
    8 significant bits (``_top``) and the rest (``_rest``, exact in bfloat16)."""
    n, lanes = em.geo.n, TILE_BYTES // 2

    def store(k):
        if len(us) == 1:
            (name,) = (f.name for f in p.row_factor.free_symbols)
            T.buffer_store(us[0], em.bufs[name][em.row_of(name, r), k, 0], [r, k])
            return

        def a():  # a fresh expression per use: one that binds variables may appear once
            return em.expr(p.row_factor, em.base_lookup(r, k))

        T.buffer_store(us[0], share(a(), _top), [r, k])
        T.buffer_store(us[1], share(a(), _rest), [r, k])

    with T.serial(0, n // lanes) as c:
        with T.vectorized(0, lanes) as j:
            store(c * lanes + j)
    with T.serial(n // lanes * lanes, n) as k:
        store(k)
    with T.serial(n, depth) as k:
        for u in us:
            T.buffer_store(u, tirx.const(0, BF16_BITS), [r, k])


def _top(value):
    """The top half of value's bits (its first 8 significant bits, truncated: a finite
    value stays finite, where rounding could carry it past bfloat16's largest to inf); a
    NaN rounded, so that a payload in the low half stays a NaN."""
    bits = tirx.reinterpret(U32, value)
    top = tirx.Cast(BF16_BITS, tirx.shift_right(bits, tirx.const(16, U32)))
    return tirx.Select(isnan(value), stored(value, BF16_BITS), top)


def _rest(value):
    """value - top, exact in bfloat16 for a product of two bfloat16 values (at most 8 more
    significant bits, of value's sign); 0 where value is not finite."""
    def minus(hi):
        wide = tirx.reinterpret(F32, tirx.shift_left(tirx.Cast(U32, tirx.Cast(U16, hi)),
                                                     tirx.const(16, U32)))
        return tirx.Select(isfinite(value), stored(value - wide, BF16_BITS),
                           tirx.const(0, BF16_BITS))

    return share(_top(value), minus)


class Flat:
    """A rows x width float32 matrix in a flat buffer, indexed ``[row, column]``; a tile
    reaches it through ``tile``, the address of its first element.  TVM's buffer
    compaction counts such an access as that one element, and would shrink the buffer to
    what the results read (D columns of the real rows) under the tiles' stores: a store to
    the last element (``declare``) keeps all of it.  (``access_ptr`` would declare the
    tile's region, but TVM's storage rewrite then merges the buffer with an int16 one and
    refuses the pointer's float32 type.)"""

    def __init__(self, buf, width: int):
        self.buf, self.width = buf, width

    def declare(self) -> None:
        T.buffer_store(self.buf, tirx.const(0.0, F32), [self.buf.shape[0] - 1])

    def __getitem__(self, at):
        row, col = at
        return self.buf[row * self.width + col]

    def tile(self, row, col):
        return address(self.buf, row * self.width + col)


class Tiles:
    """sums = (sum of the terms us) @ W on 2 x 2 blocks of C tiles (see the module
    docstring): per 32 k values, W's two B tiles are loaded once and each term's two A
    tiles in turn."""

    def __init__(self, intrinsic: str, plan: CpuPlan, geo: Geometry, us: list, w):
        self.intrinsic, self.plan, self.geo, self.us, self.w = intrinsic, plan, geo, us, w
        self.u = us[0]  # the shape every term shares
        self.group = plan.nc // BLOCK  # panels packed together
        self.panels = _round_up(geo.d, BLOCK) // BLOCK

    def product(self, sums) -> None:
        plan, geo = self.plan, self.geo
        with T.parallel(0, -(-self.panels // self.group)) as g:
            packed = T.alloc_buffer((self.group, plan.kc // PAIR, BLOCK), U32)
            configure()
            with T.serial(0, self.u.shape[1] // plan.kc) as kb:
                inside = tirx.And((kb + 1) * plan.kc <= geo.n, (g + 1) * plan.nc <= geo.d)
                with T.If(inside):
                    with T.Then():
                        self._pack(packed, g, kb, checked=False)
                    with T.Else():
                        self._pack(packed, g, kb, checked=True)
                count = tirx.min(self.group, self.panels - g * self.group)
                with T.serial(0, count) as q:
                    with T.serial(0, self.u.shape[0] // BLOCK) as b:
                        self._block(packed, sums, (g * self.group + q) * BLOCK, q, b, kb)
            tile_op("tilerelease")

    def _pack(self, packed, g, kb, checked: bool) -> None:
        """packed[q, kp, c] = the pair W[k, col], W[k + 1, col] (k = kb kc + 2 kp, col the
        c-th column of the group's q-th panel) in one word, row by row across the group;
        ``checked``: zeros past N and D, the loads clamped inside W."""
        plan, geo, w = self.plan, self.geo, self.w
        with T.serial(0, plan.kc // PAIR) as kp:
            with T.serial(0, self.group) as q:
                loop = T.serial if checked else T.vectorized
                with loop(0, BLOCK) as c:
                    col, k = (g * self.group + q) * BLOCK + c, kb * plan.kc + PAIR * kp
                    halves = []
                    for h in range(PAIR):
                        bits = w[0, tirx.min(k + h, geo.n - 1), tirx.min(col, geo.d - 1)] \
                            if checked else w[0, k + h, col]
                        half = tirx.Cast(U32, tirx.Cast(U16, bits))
                        if checked:
                            half = tirx.Select(tirx.And(k + h < geo.n, col < geo.d), half,
                                               tirx.const(0, U32))
                        halves.append(half)
                    word = tirx.bitwise_or(halves[0], tirx.shift_left(halves[1],
                                                                      tirx.const(16, U32)))
                    T.buffer_store(packed, word, [q, kp, c])

    def _block(self, packed, sums, col0, q, b, kb) -> None:
        """Rows [32 b, 32 b + 32) x columns [col0, col0 + 32) of the sums, K block kb."""
        plan, u = self.plan, self.u
        sum_bytes, row_bytes = byte_stride(sums.width * 4), byte_stride(u.shape[1] * 2)
        with T.If(kb == 0):
            with T.Then():
                for t in range(len(C_TILES)):
                    tile_op("tilezero", tile_reg(t))
            with T.Else():
                for t, (i, j) in enumerate(C_TILES):
                    tile_op("tileloadd64", tile_reg(t),
                            sums.tile(b * BLOCK + i * TILE_ROWS, col0 + j * TILE_ROWS),
                            sum_bytes)
        with T.serial(0, plan.kc // (TILE_BYTES // 2)) as ks:
            k0 = kb * plan.kc + ks * (TILE_BYTES // 2)
            for j, bt in enumerate(B_TILES):
                tile_op("tileloadd64", tile_reg(bt),
                        address(packed, q, ks * TILE_ROWS, j * TILE_ROWS), byte_stride(BLOCK * 4))
            for term in self.us:
                for i, a in enumerate(A_TILES):
                    tile_op("tileloadd64", tile_reg(a),
                            address(term, b * BLOCK + i * TILE_ROWS, k0), row_bytes)
                for t, (i, j) in enumerate(C_TILES):
                    tile_op(self.intrinsic, tile_reg(t), tile_reg(A_TILES[i]),
                            tile_reg(B_TILES[j]))
        for t, (i, j) in enumerate(C_TILES):
            tile_op("tilestored64", tile_reg(t),
                    sums.tile(b * BLOCK + i * TILE_ROWS, col0 + j * TILE_ROWS), sum_bytes)
