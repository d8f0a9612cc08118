"""Exact int8 GEMM on AMX tiles, AVX-512 VNNI or AVX2 (the best the CPU has, ``ISAS``), and
the per-token quantization + GEMM kernel on it.

AMX (``amx.TileGemm``) multiplies signed bytes by signed bytes into int32 tiles; the
register micro-kernels below use ``vpdpbusd`` or, on AVX2, ``vpmaddubsw`` with the weight's
sign moved onto the activation (``_signed_byte_dot``).  ``vpdpbusd``
(``llvm.x86.avx512.vpdpbusd.512``) adds to each of 16 int32 lanes the dot product of four
unsigned bytes with four signed bytes.  The activations are signed, so each is stored as
``u = q + 128`` (0..255) and the offset is taken back exactly per column:
``sum_k q[k] w[k, n] = sum_k u[k] w[k, n] - 128 * colsum[n]``.  Every value is an integer
and every sum fits int32 (``K <= DotIsa.max_k``), so the result is the exact integer
product.

- W (K, N) int8 is packed per call (it is an input and may change) into ``nr``-column panels
  of int32 words, word (panel, kq, c) holding ``W[4 kq : 4 kq + 4, panel * NR + c]``: a
  4 x 16 byte transpose done with vector loads, widening and shifts; the column sums come
  with it.  K and N are padded with zero weights, which add nothing.  These are also the
  B tiles of AMX.
- The register micro-kernel keeps ``mr x nr`` int32 sums in ``mr * nr / 16`` zmm registers;
  per k-quad it loads ``nr / 16`` panel vectors and broadcasts one 4-byte word per row.
  Rows past the end repeat the last row (stored twice by the same task).
- Per-token quantization (``quant_gemm``) runs per row while the row is in cache: the
  absolute max on the float bits (int max: exact, and NaN sorts above inf), then
  ``clip(round(x * 127 / a), -127, 127)`` evaluated as numpy does in float32 (the product,
  then a true division, then round half to even), stored as bytes.  The epilogue is the
  spec's ``((acc * a) / 127) * ws`` in float32, left to right, as numpy evaluates it.  A row
  whose ``a`` is 0, inf or NaN is NaN in numpy (0/0, inf/inf, NaN), and NaN here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ...tvm.ir import IRBuilder, T, arg_buffer, tirx
from ...tvm.target import cpu_has
from ..signature import F32, I32
from ..texpr import const, round_half_even
from .amx import TileGemm

QMAX = 127  # the quantized range [-127, 127] (symmetric: -128 is never produced)
INF_BITS = 0x7F800000  # float32 bits of +inf; |x| bits above it are NaN
WORD = 32  # bits of an accumulator lane
ROW_LANES = 16  # lanes of the per-row passes (amax, quantize, column sums)
KC = 512  # k values per K block: a panel's KC x nr slice (16-32 KB) stays in L1
PACK_GROUPS = 32  # groups of W rows packed by one task: 64-128 rows, 256-512 KB
COLSUM_CHUNK = 1024  # columns summed by one task: 4 KB of int32 sums stay in L1
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
        return _round_up(k, self.group * self.k_step) // self.group

    def rows(self, m: int) -> int:
        """Rows of the activation buffer: tiles load whole blocks (zero rows past m)."""
        return _round_up(m, self.mr) if self.tiles else m

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
ISAS: tuple[DotIsa, ...] = (
    DotIsa("amx-int8", "amx-int8", "llvm.x86.tdpbssd", 16, 4, I8, 0, "int8x1024", True, 32,
           32, tiles=True, k_step=16),  # 2 x 2 tiles of 16 x 16 int32 sums
    DotIsa("avx512-vnni", "avx512vnni", "llvm.x86.avx512.vpdpbusd.512", 16, 4, U8, 128,
           "int8x64", True, 6, 64),  # 24 of 32 zmm accumulate
    DotIsa("avx2", "avx2", "llvm.x86.avx2.pmadd.ub.sw", 8, 4, I8, 0, "int8x32", False,
           4, 16, signs=True, lowest=-QMAX),  # 8 of 16 ymm accumulate; |w|, w, 2 temporaries
    DotIsa("avx2-int16", "avx2", "llvm.x86.avx2.pmadd.wd", 8, 2, "int16", 0, "int16x16",
           False, 6, 16),  # any int8 activation (-128 too); 12 of 16 ymm accumulate
)
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


def isa_for(target: dict, lowest: int = -QMAX) -> DotIsa:
    """The best integer dot product ``target`` has for activations down to ``lowest`` (the
    quantized range by default; -128 for any int8), a clear error when it has none.

    Examples
    --------
    >>> isa_for({"kind": "llvm", "mcpu": "icelake-server"}).name
    'avx512-vnni'
    >>> isa_for({"kind": "llvm", "mcpu": "znver3"}).name
    'avx2'
    >>> isa_for({"kind": "llvm", "mcpu": "znver3"}, lowest=-128).name
    'avx2-int16'
    """
    for isa in ISAS:
        if cpu_has(target, isa.feature) and isa.lowest <= lowest:
            return isa
    raise ValueError(f"the int8 GEMM needs one of {[i.feature for i in ISAS]}; "
                     f"target {target} has none")


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def _ramp(start, lanes: int):
    return tirx.Ramp(start, 1, lanes)


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


def _pack_weights(isa: DotIsa, w, packed, colsum, k: int, n: int):
    """packed[p, kg, c] = W[g kg : g kg + g, p nr + c] packed into one int32 word (zero past
    K and N), in blocks of PACK_GROUPS groups (in parallel): a block's rows stay in L2 while
    every panel takes its columns, and each panel's words are written contiguously (by
    panel alone every row read is a new page; by row alone every word written); colsum[col] =
    sum_k W[k, col] where the activations are offset (it takes the offset back)."""
    nr, g = isa.nr, isa.group
    groups, full = isa.groups(k), n // nr
    with T.parallel(0, -(-groups // PACK_GROUPS)) as blk:
        first = T.bind(blk * PACK_GROUPS)
        count = T.bind(tirx.min(groups - first, PACK_GROUPS))
        inside = T.bind(tirx.max(tirx.min(k // g - first, count), 0))  # the K tail: checked
        with T.serial(0, full) as p:
            with T.serial(0, inside) as j:
                with T.vectorized(0, nr) as c:
                    _pack_word(isa, w, packed, (p, first + j, c), k, n, checked=False)
        with T.serial(0, _round_up(n, nr) // nr) as p:
            lo = tirx.Select(p < full, inside, 0)  # the N tail: every group checked
            with T.serial(lo, count) as j:
                with T.serial(0, nr) as c:
                    _pack_word(isa, w, packed, (p, first + j, c), k, n, checked=True)
    if isa.offset:
        _column_sums(w, colsum, k, n)


def _column_sums(w, colsum, k: int, n: int):
    """colsum[col] = sum_k W[k, col]: chunks of columns in parallel, rows in order."""
    chunks = -(-n // COLSUM_CHUNK)
    with T.parallel(0, chunks) as ch:
        c0 = ch * COLSUM_CHUNK
        width = tirx.min(n - c0, COLSUM_CHUNK)
        with T.serial(0, width) as c:
            T.buffer_store(colsum, tirx.const(0, I32), [c0 + c])
        with T.serial(0, k) as row:
            with T.serial(0, width // ROW_LANES) as v:
                with T.vectorized(0, ROW_LANES) as j:
                    col = c0 + v * ROW_LANES + j
                    T.buffer_store(colsum, colsum[col] + tirx.Cast(I32, w[row, col]), [col])
            with T.serial(width // ROW_LANES * ROW_LANES, width) as c:
                T.buffer_store(colsum, colsum[c0 + c] + tirx.Cast(I32, w[row, c0 + c]),
                               [c0 + c])


def _pack_word(isa: DotIsa, w, packed, at, k: int, n: int, checked: bool):
    """One packed word; ``checked``: zero past K and N, the loads clamped inside W."""
    p, kg, c = at
    col, bits = p * isa.nr + c, WORD // isa.group
    word = tirx.const(0, I32)
    for q in range(isa.group):
        row = kg * isa.group + q
        value = tirx.Cast(I32, w[row, col])
        if checked:
            inside = tirx.Cast(I32, w[tirx.min(row, k - 1), tirx.min(col, n - 1)])
            value = tirx.Select(tirx.And(row < k, col < n), inside, tirx.const(0, I32))
        low = tirx.bitwise_and(value, tirx.const(2**bits - 1, I32))  # two's complement bits
        word = tirx.bitwise_or(word, tirx.shift_left(low, tirx.const(bits * q, I32)))
    T.buffer_store(packed, word, [p, kg, c])


class _Gemm:
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
        panels, strips = _round_up(self.n, isa.nr) // isa.nr, -(-self.m // isa.mr)
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
                    body(i, [i, _ramp(v * lanes, lanes)],
                         [row(i), _ramp(p * isa.nr + v * lanes, lanes)])

        with T.If(kb == 0):
            with T.Then():
                each(lambda i, at, sums: T.buffer_store(
                    acc, tirx.Broadcast(tirx.const(0, I32), lanes), at))
            with T.Else():
                each(lambda i, at, sums: T.buffer_store(acc, self.partial[sums[0], sums[1]], at))
        g0 = kb * self.block
        with T.serial(g0, tirx.min(g0 + self.block, self.groups)) as kg:
            b = [tirx.BufferLoad(self.packed, [p, kg, _ramp(v * lanes, lanes)])
                 for v in range(vectors)]
            for i in range(isa.mr):
                word = tirx.Broadcast(tirx.reinterpret(I32, tirx.BufferLoad(
                    self.u, [row(i), _ramp(kg * isa.group, isa.group)])), lanes)
                for v in range(vectors):
                    at = [i, _ramp(v * lanes, lanes)]
                    T.buffer_store(acc, isa.dot(acc[at[0], at[1]], word, b[v]), at)
        with T.If(kb == blocks - 1):
            with T.Then():
                for i in range(isa.mr):
                    _store_row(isa, self.n, p, row(i), i, acc, epilogue)
            with T.Else():
                each(lambda i, at, sums: T.buffer_store(self.partial, acc[at[0], at[1]], sums))



def _store_row(isa: DotIsa, n: int, p, r, i, acc, epilogue):
    """The epilogue over row ``i`` of a block's sums ``acc``: output row ``r`` of panel ``p``,
    ``lanes`` columns at a time (one at a time in the last, partial panel)."""
    col0 = p * isa.nr
    with T.If(col0 + isa.nr <= n):
        with T.Then():
            for v in range(isa.nr // isa.lanes):
                epilogue(r, _ramp(col0 + v * isa.lanes, isa.lanes),
                         acc[i, _ramp(v * isa.lanes, isa.lanes)])
        with T.Else():
            with T.serial(0, tirx.max(tirx.min(n - col0, isa.nr), 0)) as c:
                epilogue(r, col0 + c, acc[i, c])


def _gemm(isa: DotIsa, bufs: dict, mkn: tuple, epilogue):
    """The ISA's micro-kernel over the workspaces ``bufs`` (``scratch_shapes``' buffers)."""
    if isa.tiles:
        TileGemm(isa, bufs["u"], bufs["packed"], mkn[0]).run(
            epilogue, functools.partial(_store_row, isa, mkn[2]))
    else:
        _Gemm(isa, (bufs["u"], bufs["packed"], bufs["partial"]), *mkn).run(epilogue)


def _lanes(e) -> int:
    return e.ty.dtype.lanes


def _like(value, like):
    """``value`` broadcast to the lanes of ``like``."""
    lanes = _lanes(like)
    return value if lanes == 1 else tirx.Broadcast(value, lanes)


def scratch_shapes(isa: DotIsa, m: int, k: int, n: int,
                   packed: bool = False) -> dict[str, tuple[tuple, str]]:
    """The kernels' scratch arguments, name -> (shape, dtype), after the inputs and outputs
    (``packed``: the weights come packed, as arguments of their own, ``weight_shapes``).
    The caller allocates them once per shape: as workspaces of the kernel, the 16-32 MB of
    packed weights were fresh pages every call (page faults cost more than the packing).

    Examples
    --------
    >>> scratch_shapes(ISAS[2], 6, 10, 20)["packed"]  # AVX2: 4-byte groups, 16-column panels
    ((2, 3, 16), 'int32')
    >>> list(scratch_shapes(ISAS[0], 6, 10, 20))  # AMX: no partial sums, no column sums
    ['u', 'packed', 'amax']
    >>> list(scratch_shapes(ISAS[1], 6, 10, 20, packed=True))  # VNNI, weights given packed
    ['u', 'partial', 'amax']
    """
    panels = _round_up(n, isa.nr) // isa.nr
    shapes = {"u": ((isa.rows(m), isa.groups(k) * isa.group), isa.a_dtype),
              **({} if packed else weight_shapes(isa, k, n))}
    if not isa.tiles:  # the tiles sum all of K in their registers
        shapes["partial"] = ((m, panels * isa.nr), I32)
    return {**shapes, "amax": ((m,), F32)}


def weight_shapes(isa: DotIsa, k: int, n: int) -> dict[str, tuple[tuple, str]]:
    """The packed weights (``pack_weights``' outputs): the panels, and the column sums
    where the activations are offset.

    Examples
    --------
    >>> weight_shapes(ISAS[1], 10, 20)
    {'packed': ((1, 3, 64), 'int32'), 'colsum': ((20,), 'int32')}
    """
    shapes = {"packed": ((_round_up(n, isa.nr) // isa.nr, isa.groups(k), isa.nr), I32)}
    if isa.offset:
        shapes["colsum"] = ((n,), I32)
    return shapes


def _arguments(shapes: dict) -> dict:
    """One argument buffer per (shape, dtype) of ``shapes``, in its order."""
    return {key: arg_buffer(key, shape, dtype) for key, (shape, dtype) in shapes.items()}


def pack_weights(isa: DotIsa, k: int, n: int, name: str = "pack_weights"):
    """PrimFunc ``(wq int8 (k, n), *weight_shapes)``: the weights packed once, for
    ``quant_gemm(..., packed=True)`` (weights that do not change between calls)."""
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            w = arg_buffer("wq", (k, n), I8)
            out = _arguments(weight_shapes(isa, k, n))
            _pack_weights(isa, w, out["packed"], out.get("colsum"), k, n)
    return ib.get()


def _exact(isa: DotIsa, colsum, col, acc):
    """The integer product from the offset one: sum u w - offset * colsum."""
    if not isa.offset:
        return acc
    return acc - _like(tirx.const(isa.offset, I32), acc) * colsum[col]


def _zero_rows(u, first: int):
    """The padding rows of ``u`` past the m real ones (tile loads read whole blocks)."""
    with T.serial(first, u.shape[0]) as r:
        with T.serial(0, u.shape[1]) as kk:
            T.buffer_store(u, tirx.Cast(u.dtype, tirx.const(0, I32)), [r, kk])


def int8_gemm(isa: DotIsa, m: int, k: int, n: int, name: str = "int8_gemm"):
    """PrimFunc ``(q int8 (m, k), w int8 (k, n), y int32 (m, n))``: ``y = q @ w`` exactly, for
    any int8 ``q`` (an ISA exact only above -128 is refused).

    Examples
    --------
    >>> "vpdpbusd" in int8_gemm(ISAS[1], 8, 64, 64).script()
    True
    """
    check_range(isa, -128)
    check_k(isa, k)
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            q, w = arg_buffer("q", (m, k), I8), arg_buffer("w", (k, n), I8)
            y = arg_buffer("y", (m, n), I32)
            bufs = _arguments(scratch_shapes(isa, m, k, n))
            u, colsum = bufs["u"], bufs.get("colsum")
            _pack_weights(isa, w, bufs["packed"], colsum, k, n)
            with T.parallel(0, m) as r:
                with T.serial(0, u.shape[1]) as kk:
                    inside = tirx.Cast(I32, q[r, tirx.min(kk, k - 1)]) + isa.offset
                    value = tirx.Select(kk < k, inside, tirx.const(0, I32))
                    T.buffer_store(u, tirx.Cast(isa.a_dtype, value), [r, kk])
            _zero_rows(u, m)
            _gemm(isa, bufs, (m, k, n), lambda r, col, acc: T.buffer_store(
                y, _exact(isa, colsum, col, acc), [r, col]))
    return ib.get()


def quant_gemm(isa: DotIsa, m: int, k: int, n: int, name: str = "quant_gemm",
               packed: bool = False):
    """PrimFunc ``(x f32 (m, k), wq int8 (k, n), ws f32 (n,), y f32 (m, n), *scratch)`` of the
    cascade ``a = max(abs(x[i])); y = sum(clip(round(x[i] * 127 / a), -127, 127) * wq[i, :])
    * a / 127 * ws[:]``: per-token quantization while the row is in cache, then the integer
    GEMM.  ``packed``: the weights come as ``pack_weights`` left them (``weight_shapes``'
    buffers in place of ``wq``, not in the scratch).

    Examples
    --------
    >>> script = quant_gemm(ISAS[2], 8, 64, 64).script()
    >>> "pmadd" in script and "T.parallel" in script
    True
    """
    check_range(isa, -QMAX)
    check_k(isa, k)
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            x = arg_buffer("x", (m, k), F32)
            given = _arguments(weight_shapes(isa, k, n) if packed else {"wq": ((k, n), I8)})
            ws, y = arg_buffer("ws", (n,), F32), arg_buffer("y", (m, n), F32)
            bufs = {**_arguments(scratch_shapes(isa, m, k, n, packed)), **given}
            if not packed:
                _pack_weights(isa, given["wq"], bufs["packed"], bufs.get("colsum"), k, n)
            with T.parallel(0, m) as r:
                _quantize_row(isa, x, bufs["u"], bufs["amax"], r, k)
            _zero_rows(bufs["u"], m)
            _gemm(isa, bufs, (m, k, n), _scaled(isa, y, bufs.get("colsum"), bufs["amax"], ws))
    return ib.get()


def _row_amax_bits(x, r, k: int):
    """The int32 bits of max |x[r, :]|: an int max of the bits is exact and keeps NaN (above
    inf), which a float max under LLVM's no-NaN flags may drop."""
    lanes = T.alloc_buffer((ROW_LANES,), I32, scope="local")
    with T.vectorized(0, ROW_LANES) as j:
        T.buffer_store(lanes, tirx.const(0, I32), [j])
    with T.serial(0, k // ROW_LANES) as c:
        with T.vectorized(0, ROW_LANES) as j:
            bits = _abs_bits(x[r, c * ROW_LANES + j])
            T.buffer_store(lanes, tirx.max(lanes[j], bits), [j])
    with T.serial(k // ROW_LANES * ROW_LANES, k) as kk:
        T.buffer_store(lanes, tirx.max(lanes[0], _abs_bits(x[r, kk])), [0])
    with T.serial(1, ROW_LANES) as j:
        T.buffer_store(lanes, tirx.max(lanes[0], lanes[j]), [0])
    return lanes[0]


def _abs_bits(v):
    return tirx.bitwise_and(tirx.reinterpret(I32, v), tirx.const(0x7FFFFFFF, I32))


def _quantize_row(isa: DotIsa, x, u, amax, r, k: int):
    """amax[r] = max |x[r, :]| (NaN when 0, inf or NaN: the row is NaN in numpy, 0/0 or
    inf/inf or NaN), u[r, :] = clip(round(x * 127 / a), -127, 127) + offset."""
    bits = T.bind(_row_amax_bits(x, r, k))
    good = T.bind(tirx.And(bits > 0, bits < INF_BITS))
    a = T.bind(tirx.Select(good, tirx.reinterpret(F32, bits), const(1)))
    T.buffer_store(amax, tirx.Select(good, a, const(float("nan"))), [r])

    def store(kk):
        v = x[r, kk] * const(QMAX) / a  # numpy's order: the product, then a true division
        q = tirx.min(tirx.max(round_half_even(v), const(-QMAX)), const(QMAX))
        value = tirx.Cast(I32, tirx.Select(good, q, const(0))) + isa.offset
        T.buffer_store(u, tirx.Cast(isa.a_dtype, value), [r, kk])

    with T.serial(0, k // ROW_LANES) as c:
        with T.vectorized(0, ROW_LANES) as j:
            store(c * ROW_LANES + j)
    with T.serial(k // ROW_LANES * ROW_LANES, k) as kk:
        store(kk)
    with T.serial(k, u.shape[1]) as kk:  # the padding of the last group: its weights are 0
        T.buffer_store(u, tirx.Cast(isa.a_dtype, tirx.const(0, I32)), [r, kk])


def _scaled(isa: DotIsa, y, colsum, amax, ws):
    """y = ((acc * a) / 127) * ws in float32, left to right (numpy's order); the int32 ->
    float32 conversion rounds to nearest, as numpy's astype."""
    def store(r, col, acc):
        exact = tirx.Cast(_f32_like(acc), _exact(isa, colsum, col, acc))
        scaled = exact * _like(amax[r], acc) / _like(const(QMAX), acc) * ws[col]
        T.buffer_store(y, scaled, [r, col])
    return store


def _f32_like(e) -> str:
    lanes = _lanes(e)
    return F32 if lanes == 1 else f"{F32}x{lanes}"
