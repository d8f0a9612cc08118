"""The int8 GEMM's weights, packed, and the buffers its kernels take.

W (K, N) int8 is packed (per call, as it is an input and may change; or once by
``pack_weights`` for weights that do not) into ``nr``-column panels of int32 words, word
(panel, kq, c) holding ``W[4 kq : 4 kq + 4, panel * NR + c]``: a 4 x 16 byte transpose
done with vector loads, widening and shifts; the column sums come with it.  K and N are
padded with zero weights, which add nothing.  These are also the B tiles of AMX.
"""

from __future__ import annotations

from ...tvm.ir import IRBuilder, T, arg_buffer, tirx
from ..signature import F32, I32
from .int8_isa import I8, DotIsa, round_up

WORD = 32  # bits of an accumulator lane
ROW_LANES = 16  # lanes of the per-row passes (amax, quantize, column sums)
PACK_GROUPS = 32  # groups of W rows packed by one task: 64-128 rows, 256-512 KB
COLSUM_CHUNK = 1024  # columns summed by one task: 4 KB of int32 sums stay in L1


def pack_into(isa: DotIsa, w, packed, colsum, k: int, n: int):
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
        with T.serial(0, round_up(n, nr) // nr) as p:
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


def scratch_shapes(isa: DotIsa, m: int, k: int, n: int,
                   packed: bool = False) -> dict[str, tuple[tuple, str]]:
    """The kernels' scratch arguments, name -> (shape, dtype), after the inputs and outputs
    (``packed``: the weights come packed, as arguments of their own, ``weight_shapes``).
    The caller allocates them once per shape: as workspaces of the kernel, the 16-32 MB of
    packed weights were fresh pages every call (page faults cost more than the packing).

    Examples
    --------
    >>> from redfuser.lowering.cpu.int8_isa import AMX_INT8, AVX2_BYTES, AVX512_VNNI
    >>> scratch_shapes(AVX2_BYTES, 6, 10, 20)["packed"]  # AVX2: 4-byte groups, 16-column panels
    ((2, 3, 16), 'int32')
    >>> list(scratch_shapes(AMX_INT8, 6, 10, 20))  # AMX: no partial sums, no column sums
    ['u', 'packed', 'amax']
    >>> list(scratch_shapes(AVX512_VNNI, 6, 10, 20, packed=True))  # VNNI, weights given packed
    ['u', 'partial', 'amax']
    """
    panels = round_up(n, isa.nr) // isa.nr
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
    >>> from redfuser.lowering.cpu.int8_isa import AVX512_VNNI
    >>> weight_shapes(AVX512_VNNI, 10, 20)
    {'packed': ((1, 3, 64), 'int32'), 'colsum': ((20,), 'int32')}
    """
    shapes = {"packed": ((round_up(n, isa.nr) // isa.nr, isa.groups(k), isa.nr), I32)}
    if isa.offset:
        shapes["colsum"] = ((n,), I32)
    return shapes


def arguments(shapes: dict) -> dict:
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
            out = arguments(weight_shapes(isa, k, n))
            pack_into(isa, w, out["packed"], out.get("colsum"), k, n)
    return ib.get()
