"""The CPU's integer dot products: one ``DotIsa`` per instruction, a column of the CPU's
one table of instruction sets (``vector.VECTOR_ISAS``, which picks the best one a target
has: ``isa_for``), and the checks that keep its int32 sums exact.

The register micro-kernels use ``vpdpbusd`` or, on AVX2, ``vpmaddubsw`` with the weight's
sign moved onto the activation (``_signed_byte_dot``).  ``vpdpbusd``
(``llvm.x86.avx512.vpdpbusd.512``) adds to each of 16 int32 lanes the dot product of four
unsigned bytes with four signed bytes.  The activations are signed, so each is stored as
``u = q + 128`` (0..255) and the offset is taken back exactly per column:
``sum_k q[k] w[k, n] = sum_k u[k] w[k, n] - 128 * colsum[n]``.  Every value is an integer
and every sum fits int32 (``K <= DotIsa.max_k``), so the result is the exact integer
product.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...tvm.ir import tirx

QMAX = 127  # the quantized range [-127, 127] (symmetric: -128 is never produced)
I8, U8 = "int8", "uint8"


@dataclass(frozen=True)
class DotIsa:
    """One integer dot-product instruction: each int32 lane of ``acc`` gains the dot product
    of ``group`` activations (stored as ``a_dtype``, shifted by ``offset`` into its range)
    with ``group`` weights, both packed into the lane's 32 bits."""

    name: str
    feature: str  # the LLVM CPU feature it needs
    intrinsic: str
    lanes: int  # int32 lanes of a register
    group: int  # k values per lane
    a_dtype: str
    offset: int  # u = q + offset is in a_dtype's range (vpdpbusd: unsigned bytes)
    operand: str  # the intrinsic's type for both packed operands
    accumulates: bool  # the intrinsic adds into its first operand
    mr: int  # micro-kernel rows
    nr: int  # micro-kernel columns: mr * nr / lanes accumulator registers
    tiles: bool = False  # AMX: the micro-kernel is ``amx.TileGemm`` on tile registers
    k_step: int = 1  # groups per step of K (a tile row is 64 bytes): K is padded to it
    signs: bool = False  # u8 x s8 pairs on signed bytes: the sign moved onto the activation
    lowest: int = -128  # the most negative activation it multiplies exactly

    @property
    def max_k(self) -> int:
        """The largest K whose sums of |u * w| <= top * 128 stay in int32 (top: the largest
        |u| of an int8 activation after the offset)."""
        top = max(abs(self.lowest + self.offset), 127 + self.offset)
        return (2**31 - 1) // (top * 128)

    def groups(self, k: int) -> int:
        """Groups of ``group`` k values, K padded with zero weights to whole steps."""
        return round_up(k, self.group * self.k_step) // self.group

    def rows(self, m: int) -> int:
        """Rows of the activation buffer: tiles load whole blocks (zero rows past m)."""
        return round_up(m, self.mr) if self.tiles else m

    def dot(self, acc, a_words, b_words):
        a, b = (tirx.reinterpret(self.operand, v) for v in (a_words, b_words))
        if self.signs:
            return acc + _signed_byte_dot(self, a, b)
        if self.accumulates:
            return tirx.call_llvm_pure_intrin(acc.ty.dtype, self.intrinsic, acc, a, b)
        return acc + tirx.call_llvm_pure_intrin(acc.ty.dtype, self.intrinsic, a, b)


# Best first; LLVM 17+ types vpdpbusd's byte operands as <64 x i8>.  All are exact: s8 x s8
# and u8 x s8 products summed in int32.  AVX2 (one run, 2 cores, 256 x 4096 -> 4096, packed
# weights): the signed-byte dot runs as fast as the int16 ``pmaddwd`` (about 96 GMAC/s, the
# rate of a C loop of either), and its weights are half the bytes: 16 MB, so one row
# (m = 1) takes 0.85 ms against 1.87.  It is exact down to -127 only, so ``int8_gemm``'s
# activations (any int8) take the int16 row.
AMX_INT8 = DotIsa("amx-int8", "amx-int8", "llvm.x86.tdpbssd", 16, 4, I8, 0, "int8x1024",
                  True, 32, 32, tiles=True, k_step=16)  # 2 x 2 tiles of 16 x 16 int32 sums
AVX512_VNNI = DotIsa("avx512-vnni", "avx512vnni", "llvm.x86.avx512.vpdpbusd.512", 16, 4, U8,
                     128, "int8x64", True, 6, 64)  # 24 of 32 zmm accumulate
AVX2_BYTES = DotIsa("avx2", "avx2", "llvm.x86.avx2.pmadd.ub.sw", 8, 4, I8, 0, "int8x32",
                    False, 4, 16, signs=True, lowest=-QMAX)  # 8 of 16 ymm; |w|, w, 2 temps
AVX2_INT16 = DotIsa("avx2-int16", "avx2", "llvm.x86.avx2.pmadd.wd", 8, 2, "int16", 0,
                    "int16x16", False, 6, 16)  # any int8 (-128 too); 12 of 16 ymm accumulate
PSIGN, PAIRS = "llvm.x86.avx2.psign.b", "llvm.x86.avx2.pmadd.wd"


def _signed_byte_dot(isa: DotIsa, x, w):
    """Per int32 lane, the exact dot product of four signed activation bytes ``x`` with four
    signed weight bytes ``w``, on u8 x s8 ``vpmaddubsw``: ``x w = |w| (x sgn w)``, with
    ``|w|`` (``psign(w, w)``; -128 gives the byte 0x80, which is 128 unsigned) as the
    unsigned operand and ``x sgn w`` (``psign(x, w)``, in [-127, 127]) as the signed one.
    A pair sum is then at most 2 * 128 * 127 < 2**15: the int16 saturation never happens
    (it does for fbgemm's offset activations, ``u = x + 128``).  ``pmaddwd`` by ones adds
    the pairs into int32."""
    bytes_, pairs = x.ty.dtype, f"int16x{isa.lanes * 2}"
    magnitude = tirx.call_llvm_pure_intrin(bytes_, PSIGN, w, w)
    signed = tirx.call_llvm_pure_intrin(bytes_, PSIGN, x, w)
    sums = tirx.call_llvm_pure_intrin(pairs, isa.intrinsic, magnitude, signed)
    ones = tirx.Broadcast(tirx.const(1, "int16"), isa.lanes * 2)
    return tirx.call_llvm_pure_intrin(f"int32x{isa.lanes}", PAIRS, sums, ones)


def round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def check_range(isa: DotIsa, lowest: int) -> None:
    """Refuse an ISA whose dot product is not exact for activations down to ``lowest``."""
    if isa.lowest > lowest:
        raise ValueError(f"the {isa.name} dot product is exact for activations in "
                         f"[{isa.lowest}, 127]; these reach {lowest} (use isa_for(target, "
                         f"lowest={lowest}))")


def check_k(isa: DotIsa, k: int) -> None:
    """Refuse a K whose int32 sums could overflow (so no sum is ever silently wrong)."""
    if k > isa.max_k:
        raise ValueError(f"the int8 GEMM accumulates in int32: K = {k} exceeds {isa.max_k}")
