"""The int8 GEMM on AMX tiles: ``tdpbssd`` multiplies two tiles of signed bytes into a tile
of int32 sums.

A tile register holds 16 rows of 64 bytes.  ``tdpbssd C, A, B`` adds to each int32 C[r, c]
(16 x 16) the dot product of row r of A (16 x 64 signed bytes: 64 k values) with column c
of B, where B's row kq holds the 4-byte words of k values 4 kq .. 4 kq + 3 for its 16
columns: exactly the packed weight panels of ``int8_pack`` (word (panel, kq, c)), so a B tile is
16 k-quads of 16 columns of a panel, loaded with the panel's row stride.  The activations
are signed bytes as they are (no offset, no column sums).  Every product and sum is an
integer in int32 (``DotIsa.max_k`` bounds K), so the result is the exact integer product.

The block: 2 x 2 tiles of C (32 rows x 32 columns, tmm0-3) from two A tiles (tmm4-5) and
two B tiles (tmm6-7): per 64 k values, 4 tile loads feed 4 products.  Column panels run in
parallel; a panel (K x 32 bytes) and the activations (rows x K bytes) stay in L2 while every
row block passes, and the C tiles sum over all of K in the tile registers.  Each task loads
the tile configuration (a per-thread state) and releases it at the end.
"""

from __future__ import annotations

from ...tvm.ir import T, tirx
from ..signature import I32

TILE_ROWS, TILE_BYTES = 16, 64  # every tile register is configured as 16 rows of 64 bytes
TILES = 8
C_TILES = ((0, 0), (0, 1), (1, 0), (1, 1))  # tmm0-3: (A tile, B tile) of each product
A_TILES, B_TILES = (4, 5), (6, 7)
PALETTE = 1  # the tile palette of 8 tmm registers of up to 16 x 64 bytes
CONFIG_BYTES = 64
COLSB, ROWS = 16, 48  # byte offsets of colsb[8] (uint16) and rows[8] (uint8) in the config
U8 = "uint8"


def tile_op(name: str, *args) -> None:
    """A tile instruction (``llvm.x86.`` + its name, or a full intrinsic name)."""
    full = name if name.startswith("llvm.") else f"llvm.x86.{name}"
    T.evaluate(tirx.call_llvm_intrin("void", full, *args))


def tile_reg(index: int):
    return tirx.const(index, U8)  # tile numbers are immediates of the instructions


def address(buf, *index):
    return tirx.address_of(tirx.BufferLoad(buf, list(index)))


def byte_stride(nbytes) -> object:
    return tirx.const(int(nbytes), "int64")


def zero_rows(u, first: int) -> None:
    """The padding rows of ``u`` past the ``first`` real ones: tile loads read whole
    blocks of rows, and a zero row adds nothing."""
    with T.serial(first, u.shape[0]) as r:
        with T.serial(0, u.shape[1]) as k:
            T.buffer_store(u, tirx.Cast(u.dtype, tirx.const(0, "int32")), [r, k])


def configure() -> None:
    """ldtilecfg: palette 1, every tile 16 rows of 64 bytes (zero elsewhere, as required)."""
    cfg = T.alloc_buffer((CONFIG_BYTES,), U8, scope="local")
    with T.serial(0, CONFIG_BYTES) as i:
        T.buffer_store(cfg, tirx.const(0, U8), [i])
    T.buffer_store(cfg, tirx.const(PALETTE, U8), [0])
    for t in range(TILES):
        T.buffer_store(cfg, tirx.const(TILE_BYTES, U8), [COLSB + 2 * t])  # little-endian low
        T.buffer_store(cfg, tirx.const(TILE_ROWS, U8), [ROWS + t])
    tile_op("ldtilecfg", address(cfg, 0))


class TileGemm:
    """acc = U @ W in 32 x 32 blocks of AMX tiles (``U`` int8 (rows, K'), rows a multiple of
    32 and K' of 64, padded with zeros; ``packed`` ``int8_pack``'s 32-column panels);
    ``epilogue(row, col, acc)`` stores one result, as ``int8_kernel.RegisterGemm`` calls it."""

    def __init__(self, isa, u, packed, m: int):
        self.isa, self.u, self.packed, self.m = isa, u, packed, m
        assert isa.mr == 2 * TILE_ROWS and isa.nr == 2 * TILE_ROWS and isa.group == 4

    def run(self, epilogue, store) -> None:
        """``store(p, row, i, acc, epilogue)``: the epilogue over row i of a block's acc."""
        isa = self.isa
        blocks = self.u.shape[0] // isa.mr
        with T.parallel(0, self.packed.shape[0]) as p:
            configure()
            acc = T.alloc_buffer((isa.mr, isa.nr), I32, scope="local")
            with T.serial(0, blocks) as b:
                self._block(p, b, acc)
                for i in range(isa.mr):
                    with T.If(b * isa.mr + i < self.m):  # the padding rows are not results
                        with T.Then():
                            store(p, b * isa.mr + i, i, acc, epilogue)
            tile_op("tilerelease")

    def _block(self, p, b, acc) -> None:
        isa, u, packed = self.isa, self.u, self.packed
        for t in range(len(C_TILES)):
            tile_op("tilezero", tile_reg(t))
        row_bytes, panel_bytes = u.shape[1], isa.nr * 4
        with T.serial(0, packed.shape[1] // TILE_ROWS) as ks:
            for i, a in enumerate(A_TILES):
                tile_op("tileloadd64", tile_reg(a),
                        address(u, b * isa.mr + i * TILE_ROWS, ks * TILE_BYTES),
                        byte_stride(row_bytes))
            for j, bt in enumerate(B_TILES):
                tile_op("tileloadd64", tile_reg(bt),
                        address(packed, p, ks * TILE_ROWS, j * TILE_ROWS), byte_stride(panel_bytes))
            for t, (i, j) in enumerate(C_TILES):
                tile_op(isa.intrinsic, tile_reg(t), tile_reg(A_TILES[i]), tile_reg(B_TILES[j]))
        for t, (i, j) in enumerate(C_TILES):
            tile_op("tilestored64", tile_reg(t), address(acc, i * TILE_ROWS, j * TILE_ROWS),
                    byte_stride(panel_bytes))
