"""The int8 GEMM's micro-kernels: ``acc = U @ W`` on the packed weights (``int8_pack``),
in int32 registers (``RegisterGemm``) or AMX tiles (``amx.TileGemm``).

The register micro-kernel keeps ``mr x nr`` int32 sums in ``mr * nr / 16`` zmm registers;
per k-quad it loads ``nr / 16`` panel vectors and broadcasts one 4-byte word per row.  Rows
past the end repeat the last row (stored twice by the same task).
"""

from __future__ import annotations

import functools

from ...tvm.ir import T, tirx
from ..signature import I32
from .amx import TileGemm
from .int8_isa import DotIsa, round_up

KC = 512  # k values per K block: a panel's KC x nr slice (16-32 KB) stays in L1


def ramp(start, lanes: int):
    return tirx.Ramp(start, 1, lanes)


class RegisterGemm:
    """acc[rows, cols] = U[rows, :] @ W in mr x nr register blocks, BLIS-like: column panels
    in parallel, K in blocks of KC values (a panel's KC x nr slice stays in L1 while every
    strip of rows passes over it), the running sums kept in ``partial`` between K blocks;
    ``epilogue(row, col, acc)`` stores one result (``lanes`` columns, or one in the tail).
    Measured in one run on 2 loaded cores (256 x 4096 -> 4096, int16 AVX2 kernel): K blocks
    inside the panel loop 374 ms, K blocks outermost (U's block shared in L2, 8 parallel
    launches) 403 ms.  The AVX2 signed-byte kernel on Zen 3 (one run): 4 x 16 registers
    44.7 ms, 5 x 16 45.8, 6 x 16 48.9, 3 x 32 50.7, 4 x 24 53.0."""

    def __init__(self, isa: DotIsa, bufs: tuple, m: int, k: int, n: int):
        self.isa, (self.u, self.packed, self.partial), self.m, self.n = isa, bufs, m, n
        self.groups = isa.groups(k)
        self.block = KC // isa.group  # groups per K block

    def run(self, epilogue):
        isa = self.isa
        panels, strips = round_up(self.n, isa.nr) // isa.nr, -(-self.m // isa.mr)
        blocks = -(-self.groups // self.block)
        with T.parallel(0, panels) as p:  # one launch (a K-block-outer order takes 8)
            with T.serial(0, blocks) as kb:
                with T.serial(0, strips) as s:
                    self._micro(p, s, kb, blocks, epilogue)

    def _micro(self, p, s, kb, blocks: int, epilogue):
        isa = self.isa
        lanes, vectors = isa.lanes, isa.nr // isa.lanes
        acc = T.alloc_buffer((isa.mr, isa.nr), I32, scope="local")

        def row(i):
            return tirx.min(s * isa.mr + i, self.m - 1)

        def each(body):
            for i in range(isa.mr):
                for v in range(vectors):
                    body(i, [i, ramp(v * lanes, lanes)],
                         [row(i), ramp(p * isa.nr + v * lanes, lanes)])

        with T.If(kb == 0):
            with T.Then():
                each(lambda i, at, sums: T.buffer_store(
                    acc, tirx.Broadcast(tirx.const(0, I32), lanes), at))
            with T.Else():
                each(lambda i, at, sums: T.buffer_store(acc, self.partial[sums[0], sums[1]], at))
        g0 = kb * self.block
        with T.serial(g0, tirx.min(g0 + self.block, self.groups)) as kg:
            b = [tirx.BufferLoad(self.packed, [p, kg, ramp(v * lanes, lanes)])
                 for v in range(vectors)]
            for i in range(isa.mr):
                word = tirx.Broadcast(tirx.reinterpret(I32, tirx.BufferLoad(
                    self.u, [row(i), ramp(kg * isa.group, isa.group)])), lanes)
                for v in range(vectors):
                    at = [i, ramp(v * lanes, lanes)]
                    T.buffer_store(acc, isa.dot(acc[at[0], at[1]], word, b[v]), at)
        with T.If(kb == blocks - 1):
            with T.Then():
                for i in range(isa.mr):
                    store_row(isa, self.n, p, row(i), i, acc, epilogue)
            with T.Else():
                each(lambda i, at, sums: T.buffer_store(self.partial, acc[at[0], at[1]], sums))



def store_row(isa: DotIsa, n: int, p, r, i, acc, epilogue):
    """The epilogue over row ``i`` of a block's sums ``acc``: output row ``r`` of panel ``p``,
    ``lanes`` columns at a time (one at a time in the last, partial panel)."""
    col0 = p * isa.nr
    with T.If(col0 + isa.nr <= n):
        with T.Then():
            for v in range(isa.nr // isa.lanes):
                epilogue(r, ramp(col0 + v * isa.lanes, isa.lanes),
                         acc[i, ramp(v * isa.lanes, isa.lanes)])
        with T.Else():
            with T.serial(0, tirx.max(tirx.min(n - col0, isa.nr), 0)) as c:
                epilogue(r, col0 + c, acc[i, c])


def gemm(isa: DotIsa, bufs: dict, mkn: tuple, epilogue):
    """The ISA's micro-kernel over the workspaces ``bufs`` (``scratch_shapes``' buffers)."""
    if isa.tiles:
        TileGemm(isa, bufs["u"], bufs["packed"], mkn[0]).run(
            epilogue, functools.partial(store_row, isa, mkn[2]))
    else:
        RegisterGemm(isa, (bufs["u"], bufs["packed"], bufs["partial"]), *mkn).run(epilogue)


def lanes_of(e) -> int:
    return e.ty.dtype.lanes


def like(value, like):
    """``value`` broadcast to the lanes of ``like``."""
    lanes = lanes_of(like)
    return value if lanes == 1 else tirx.Broadcast(value, lanes)
