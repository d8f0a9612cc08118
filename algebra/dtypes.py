"""Storage dtypes: what an array may hold in memory while every kernel computes in float32.

A rule does not change with the storage dtype (its state, updates, merges and finalize are
float32 and proven once); only the loads (converted to float32 in registers) and the
stores of per-element outputs (rounded to nearest even) do.  One row per dtype, with the
facts the call path, the tests and the bench read: its numpy dtype, the bits of its
fraction (one unit in the last place is 2**(exponent - fraction)), and the dtype a kernel
argument declares: bfloat16 is declared as its int16 bits and converted by the lowering
(a shift in, a round to nearest even out), because TVM 0.27's bfloat16 legalization does
not reach a buffer read through a view of the argument, as every kernel's are (it then
converts the bits as an integer), and because DLPack from numpy cannot carry ml_dtypes'
bfloat16 while its int16 view goes over as it is.  Per-row results stay float32: they
are what a backward or a later stage reads, and a sum of many chunks needs float32
anyway (``algebra.precision``).

Examples
--------
>>> import ml_dtypes
>>> storage(np.dtype(ml_dtypes.bfloat16)).name, storage("torch.float16").fraction
('bfloat16', 10)
>>> storage(np.float64) is None  # not a storage dtype: float64 computes in float64
True
>>> widest([storage(np.float16), storage(np.float16)]).name
'float16'
>>> widest([storage(np.float16), storage(ml_dtypes.bfloat16)]).name  # neither holds the other
'float32'
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class Storage:
    """One storage dtype (its TVM and torch name is ``name``)."""

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
STORED = frozenset(STORAGE)  # the names, as ``algebra.layout.resolve`` keeps them


def storage(dtype) -> Storage | None:
    """The storage row of a numpy dtype, a torch dtype or a name; None if it is not one."""
    name = str(dtype).removeprefix("torch.")
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else name
    except TypeError:  # a torch dtype: numpy does not know it
        pass
    return STORAGE.get(name)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a kernel argument's dtype name (ml_dtypes' for bfloat16)."""
    return STORAGE[name].numpy if name in STORAGE else np.dtype(name)


def argument_dtype(name: str) -> str:
    """The dtype a kernel declares for an argument whose dtype is ``name``."""
    return STORAGE[name].argument if name in STORAGE else name


def widest(dtypes) -> Storage:
    """The narrowest storage dtype that holds every one of ``dtypes`` exactly (float32 where
    they differ: neither bfloat16 nor float16 holds the other)."""
    names = {s.name for s in dtypes}
    return STORAGE[names.pop()] if len(names) == 1 else COMPUTE
