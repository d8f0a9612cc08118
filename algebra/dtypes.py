"""Storage and compute dtypes: what an array may hold in memory, and what a kernel computes in.

A kernel computes in float32 (``COMPUTE``) unless an input is float64: then in float64
(``WIDE``; ``compute_of``), and ``compile(..., compute_dtype=...)`` may say otherwise.  A
rule does not change with the dtypes (its state, updates, merges and finalize are proven
once, over the reals); only the loads (converted to the compute dtype in registers), the
stores of per-element outputs (rounded to nearest even) and the width of the registers do.
One row per dtype, with the facts the call path, the tests and the bench read: its numpy
dtype, the bits of its fraction (one unit in the last place is 2**(exponent - fraction)),
and the dtype a kernel argument declares: bfloat16 is declared as its int16 bits and
converted by the lowering (a shift in, a round to nearest even out), because TVM 0.27's
bfloat16 legalization does not reach a buffer read through a view of the argument, as every
kernel's are (it then converts the bits as an integer), and because DLPack from numpy
cannot carry ml_dtypes' bfloat16 while its int16 view goes over as it is.  Per-row results
are stored in the compute dtype: they are what a backward or a later stage reads, and a sum
of many chunks needs float32 at least (``algebra.precision``).

``STORAGE`` holds the dtypes a float32 kernel reads as they are (and what the Relax pass,
the torch ops and ``quant_gemm`` accept); float64 is no storage dtype of a float32 kernel
(a load would round it), it is the other compute dtype, and ``ARRAYS`` holds every float
dtype a kernel's arrays may have.

Examples
--------
>>> import ml_dtypes
>>> storage(np.dtype(ml_dtypes.bfloat16)).name, storage("torch.float16").fraction
('bfloat16', 10)
>>> storage(np.float64) is None, array_dtype("torch.float64").fraction  # computes in float64
(True, 52)
>>> widest([storage(np.float16), storage(np.float16)]).name
'float16'
>>> widest([storage(np.float16), storage(ml_dtypes.bfloat16)]).name  # neither holds the other
'float32'
>>> widest([storage(np.float16), array_dtype(np.float64)]).name
'float64'
>>> compute_of([storage(np.float16), storage(np.float32)]).name, compute_of([WIDE]).name
('float32', 'float64')
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class Storage:
    """One dtype of a kernel's arrays (its TVM and torch name is ``name``)."""

    name: str
    numpy: np.dtype
    fraction: int  # explicit fraction bits: a unit in the last place is 2**(e - fraction)
    bits_as: np.dtype | None  # its bits' dtype where a kernel declares it as its bits
    why: str

    @property
    def argument(self) -> str:
        """The dtype a kernel argument of this storage declares."""
        return self.bits_as.name if self.bits_as is not None else self.name


STORAGE = {s.name: s for s in (
    Storage("float32", np.dtype(np.float32), 23, None, "the compute dtype itself"),
    Storage("bfloat16", np.dtype(ml_dtypes.bfloat16), 7, np.dtype(np.int16),
            "float32's range with 8 significant bits: what transformers' checkpoints and "
            "training recipes hold"),
    Storage("float16", np.dtype(np.float16), 10, None,
            "11 significant bits, range +-65504: inference checkpoints and vLLM"),
)}
COMPUTE = STORAGE["float32"]
WIDE = Storage("float64", np.dtype(np.float64), 52, None,
               "float64 in, float64 computed: for sums whose float32 error is too large")
ARRAYS = {**STORAGE, WIDE.name: WIDE}  # every float dtype a kernel's arrays may have
COMPUTES = {s.name: s for s in (COMPUTE, WIDE)}  # what a kernel may compute in, narrowest first
STORED = frozenset(STORAGE)  # the names, as ``algebra.layout.resolve`` keeps them


def storage(dtype) -> Storage | None:
    """The storage row of a numpy dtype, a torch dtype or a name; None if it is not one."""
    return STORAGE.get(_name(dtype))


def _name(dtype) -> str:
    """The name of a numpy dtype, a torch dtype or a name ("torch." dropped)."""
    name = str(dtype).removeprefix("torch.")
    try:
        return np.dtype(dtype).name if not isinstance(dtype, str) else name
    except TypeError:  # a torch dtype: numpy does not know it
        return name


def array_dtype(dtype) -> Storage | None:
    """The row of ``ARRAYS`` of a numpy dtype, a torch dtype or a name (float64's too);
    None if a kernel's arrays cannot have it."""
    return ARRAYS.get(_name(dtype))


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a kernel argument's dtype name (ml_dtypes' for bfloat16)."""
    return STORAGE[name].numpy if name in STORAGE else np.dtype(name)


def argument_dtype(name: str) -> str:
    """The dtype a kernel declares for an argument whose dtype is ``name``."""
    return STORAGE[name].argument if name in STORAGE else name


def widest(dtypes) -> Storage:
    """The narrowest dtype that holds every one of ``dtypes`` exactly: theirs where they
    agree, else the narrowest compute dtype whose fraction holds theirs (float32 for
    bfloat16 with float16: neither holds the other; each compute dtype also holds the range
    of every narrower one; float32 for none)."""
    rows = {s.name: s for s in dtypes}
    if len(rows) == 1:
        return next(iter(rows.values()))
    fraction = max((s.fraction for s in rows.values()), default=COMPUTE.fraction)
    return next(c for c in COMPUTES.values() if c.fraction >= fraction)


def compute_of(dtypes) -> Storage:
    """The dtype a kernel on arrays of ``dtypes`` computes in by default: the narrowest
    compute dtype that holds ``widest`` of them (float32 for every storage dtype, float64
    where one is float64)."""
    held = widest(dtypes)
    return next(c for c in COMPUTES.values() if c.fraction >= held.fraction)
