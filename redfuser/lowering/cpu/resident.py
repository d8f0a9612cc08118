"""Where a staged rule's row stays between its passes on a CPU core (``lowering.staged``
reads ``resident_fit`` through the backend), and the row stashes a row-resident kernel
uses (``variants.resident``)."""

from __future__ import annotations

from algebra.dtypes import numpy_dtype

from ..geometry import Geometry
from .plan import RESIDENT_CACHE_BYTES, single_tile, tile_for, vector_lanes


def row_stashes(rule, geo: Geometry) -> tuple:
    """The row stashes (``algebra.stages.RowStash``) a row-resident kernel of ``rule`` uses at
    ``geo``: those whose writer folds each row as one tile (``single_tile``: the values it
    writes share one set of anchors) and whose rewritten reader keeps the reader's state."""
    stages, out = rule.staged.stages, []
    if not geo.static:  # a tile fitted to the row needs its length
        return ()
    for s in rule.staged.stashes:
        writer = stages[s.writer].rule
        lanes = vector_lanes(writer, geo)
        same_state = [v.symbol.name for v in s.rule.state] == \
            [v.symbol.name for v in stages[s.reader].rule.state]
        if same_state and single_tile(writer, geo, lanes, tile_for(writer, lanes, geo.n)):
            out.append(s)
    return tuple(out)


def resident_fit(rule, geo: Geometry, dynamic: bool = False) -> str:
    """Whether a staged rule's row stays in the L2 (``RESIDENT_CACHE_BYTES``) between its
    passes, in words: a thread folds one row at a time, and what the passes after the first
    re-read is that row's share of their streams (``dynamic``: for rows of any length)."""
    later = {s.name for st in rule.staged.stages[1:] for s in st.rule.cascade.streams}
    cache = _size(RESIDENT_CACHE_BYTES)
    if dynamic:
        width = sum(geo.inputs[k].width * _itemsize(geo, k) for k in sorted(later))
        return (f"rows of any length: a row stays in the {cache} L2 between the passes while "
                f"its {width} bytes an element fit ({RESIDENT_CACHE_BYTES // max(width, 1)} "
                "elements)")
    size = sum(geo.n * geo.inputs[k].width * _itemsize(geo, k) for k in sorted(later))
    stashed = "".join(f"; stage {s.reader + 1} reads {rule.staged.stashed_value(s)} back "
                      f"from a row stage {s.writer + 1} wrote"
                      for s in row_stashes(rule, geo))
    if size <= RESIDENT_CACHE_BYTES:
        return (f"a row's {_size(size)} stay in the {cache} L2 between the passes: DRAM sees "
                f"each row once{stashed}")
    return (f"a row's {_size(size)} do not fit the {cache} L2: the later passes re-read it "
            f"from L3 or DRAM (one launch, per-row results stay in the core){stashed}")


def _itemsize(geo: Geometry, name: str) -> int:
    """Bytes of one element of input ``name`` as stored (float64: 8, bfloat16: 2)."""
    return numpy_dtype(geo.inputs[name].dtype).itemsize


def _size(nbytes: int) -> str:
    """Bytes in words: '16.0 KB', '2.0 MB'."""
    return f"{nbytes / 2**20:.1f} MB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.1f} KB"
