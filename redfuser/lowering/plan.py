"""A plan: how one kernel instance is built (variant, lanes, tiles, splits, threads).

Plans are data.  The policy that picks one lives with each target
(``lowering.cpu.plan.choose``, ``lowering.cuda.plan.choose``; ``lowering.backends`` maps a
target name to its own), the schedule search (``redfuser.tune``) enumerates them.
"""

from __future__ import annotations

from dataclasses import dataclass

VARIANTS = ("rolling", "split", "unfused")  # of a one-pass rule (what the tuner searches)
STAGED_VARIANT = "resident"  # a staged rule's stages over each row (``lowering.staged``)
# The schedule space every target shares (each target's own parameters: ``Backend.params``)
GEMM_FIELDS = ("mr", "nr", "kc", "nc", "mc", "nt")  # 0: no GEMM micro-kernel
SPLIT_VALUES = (2, 4, 8, 16, 32, 64)
MIN_PIECE = 32  # elements of a split piece: shorter ones cost more to merge than they save


@dataclass(frozen=True)
class Param:
    """One searched parameter of a variant: its values (one value: fixed) and why."""

    name: str
    values: tuple[int, ...]
    why: str


@dataclass(frozen=True)
class Plan:
    """How one kernel instance is built; ``reason`` says why (shown as ``kernel.plan``).

    Examples
    --------
    >>> print(Plan("split", lanes=16, splits=4, reason="requested"))
    split (16 lanes, 4 splits): requested
    >>> print(Plan("rolling", 16, mr=6, nr=64, kc=256, nc=512, mc=126, nt=1, reason="why"))
    rolling (16 lanes, GEMM micro-kernel 6 x 64, KC 256, NC 512, MC 126, NT 1): why
    >>> print(Plan("rolling", 64, tile=16, dynamic=True, reason="one build"))
    rolling (64 lanes, dynamic shapes): one build
    """

    variant: str
    lanes: int = 1
    splits: int = 1
    fast_math: bool = True
    reason: str = ""
    threads: int = 1  # CUDA: threads per block, combined by a shared-memory merge tree
    tile: int = 1  # CPU lanes: elements per lane folded at fixed anchors before a merge
    row_block: int = 1  # CPU, one lane: rows folded together, sharing each streamed load
    # CPU matrix products (``cpu/gemm.py``; 0: none): a micro-kernel of mr rows x nr columns,
    # K in blocks of kc, columns in packed blocks of nc; a parallel task per block of mc rows
    # and range of 1/nt of the columns
    mr: int = 0
    nr: int = 0
    kc: int = 0
    nc: int = 0
    mc: int = 0
    nt: int = 0
    # one kernel for every row count and stream length (``geometry.symbolic_geometry``)
    dynamic: bool = False

    def __str__(self) -> str:
        extra = ", dynamic shapes" if self.dynamic else ""
        extra += f", {self.splits} splits" if self.variant == "split" else ""
        extra += f", blocks of {self.row_block} rows" if self.row_block > 1 else ""
        extra += (f", GEMM micro-kernel {self.mr} x {self.nr}, KC {self.kc}, NC {self.nc}, "
                  f"MC {self.mc}, NT {self.nt}") if self.mr else ""
        return f"{self.variant} ({self.lanes} lanes{extra}): {self.reason}"


def check_variant(variant: str | None, dynamic: bool = False) -> None:
    """Refuse a variant name no target builds (None: the target's policy picks), and for a
    kernel of every N (``dynamic``) the split, whose pieces are cut by the row's length."""
    if variant is not None and variant not in (*VARIANTS, STAGED_VARIANT):
        raise ValueError(f"variant must be one of {(*VARIANTS, STAGED_VARIANT)}, not "
                         f"{variant!r}")
    if dynamic and variant == "split":
        raise ValueError("variant 'split' cuts each row by its length: it needs static "
                         "shapes (dynamic=False)")
