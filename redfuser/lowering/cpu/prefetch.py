"""Software prefetch of the rows a thread folds next (``CpuPlan.ahead``).

A many-lane row kernel reads each row from memory in its first level (softmax's max), then
works on it from L1 (the exp and the sum, the stash, the scale): while it computes, nothing
is loading, and the next row's first level waits on memory again.  So while the row's last
level folds, every cache line of the stream inputs ``ahead`` rows further is prefetched
into L2 (``prefetcht1``: the rows ahead would push the current row and the thread's stash
out of L1); the next rows' first level then finds them there.  Memory and compute overlap
instead of taking turns.

Measured on the 2-core Emerald Rapids (medians of five runs in one process, ms, the
policy's plan with ``ahead=0`` -> as chosen): softmax 4096 x 4096 bfloat16 4.50 -> 3.87,
float16 5.17 -> 3.93, float32 7.44 -> 7.26; LayerNorm statistics bfloat16 1.38 -> 1.12,
float32 1.72 -> 1.59; RMSNorm bfloat16 2.16 -> 1.92, float32 6.34 -> 6.11.  The narrow
dtypes gain most: they spend more instructions per byte (the conversions), so their loads
fell further behind.
"""

from __future__ import annotations

from algebra.dtypes import numpy_dtype

from ...tvm.ir import T, tirx
from ..geometry import Geometry, is_streamed, same_rows
from .amx import address
from .vector import host_caches

# Bytes of the stream inputs in flight ahead of the row being folded: one row of 4096
# float32.  bfloat16 softmax 4096 x 4096, medians in one process: none 6.30 ms, one row
# (8 KB) ahead 5.59, two rows 4.87; in another run two, three and four rows 5.13, 5.01, 4.62
AHEAD_BYTES = 16 << 10
L2_LOCALITY = 2  # llvm.prefetch's locality 2: prefetcht1 on x86, into L2
READ, DATA = 0, 1  # llvm.prefetch's rw (a read) and cache type (data)
LINE = host_caches().line


def rows_ahead(geo: Geometry, one_thread: bool) -> int:
    """Rows to prefetch ahead for ``geo``'s many-lane fold: enough rows for ``AHEAD_BYTES``
    of its own streams; 0 where there is nothing to overlap (one row, work for one thread:
    it is in cache; a symbolic shape; no stream of its own per row).

    Examples
    --------
    >>> import ml_dtypes, numpy as np, redfuser
    >>> softmax = redfuser.compile("softmax")
    >>> [rows_ahead(softmax.geometry(x=np.zeros((4096, 4096), dtype)), one_thread=False)
    ...  for dtype in (np.float32, ml_dtypes.bfloat16)]
    [1, 2]
    >>> rows_ahead(softmax.geometry(x=np.zeros((1, 4096), np.float32)), one_thread=True)
    0
    """
    if one_thread or not geo.static or geo.r < 2:
        return 0
    row = sum(g.length * _bytes(g.dtype) for g in _own_streams(geo).values())
    return min(geo.r - 1, -(-AHEAD_BYTES // row)) if row else 0


def prefetch_rows(em, r, start, elements: int, ahead: int) -> None:
    """Prefetch the cache lines of elements [start, start + elements) of every stream input
    of row ``r + ahead`` (the last row where that is past the end)."""
    row = tirx.min(r + ahead, em.geo.r - 1)
    for name, g in _own_streams(em.geo).items():
        per_line = max(1, LINE // _bytes(g.dtype))
        for offset in range(0, elements, per_line):
            T.evaluate(tirx.call_intrin("void", "tirx.prefetch", address(
                em.bufs[name], em.row_of(name, row), start + offset, 0), READ, L2_LOCALITY,
                DATA))


def _own_streams(geo: Geometry) -> dict:
    """The inputs that vary along the stream with a row of their own for each kernel row
    (not a weight every row shares: that one stays in cache)."""
    return {name: g for name, g in geo.inputs.items()
            if is_streamed(g.length) and g.width == 1 and same_rows(g.rows, geo.rows)}


def _bytes(dtype: str) -> int:
    return numpy_dtype(dtype).itemsize
