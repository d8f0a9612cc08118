"""A plan: how one kernel instance is built.  ``Plan`` holds what every target shares
(variant, lanes, splits, fast math, symbolic shapes); each target's own knobs live on its
subclass (``lowering.cpu.plan.CpuPlan``: tiles, row blocks, the GEMM micro-kernel;
``lowering.cuda.plan.CudaPlan``: threads per block, the GEMM tiles), named by its
``Backend.plan_type``, so a field never means two things.

Plans are data.  The policy that picks one lives with each target
(``lowering.cpu.plan.choose``, ``lowering.cuda.plan.choose``; ``lowering.backends`` maps a
target name to its own), the schedule search (``redfuser.tune``) enumerates them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

VARIANTS = ("rolling", "split", "unfused")  # of a one-pass rule (what the tuner searches)
STAGED_VARIANT = "resident"  # a staged rule's stages over each row (``lowering.staged``)
# The schedule space every target shares (each target's own parameters: ``Backend.params``)
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
    """How one kernel instance is built, in the fields every target shares; ``reason``
    says why (shown as ``kernel.plan``).  A target's plan is its subclass
    (``Backend.plan_type``), which adds its own fields (keyword-only) and text.

    Examples
    --------
    >>> print(Plan("split", lanes=16, splits=4, reason="requested"))
    split (16 lanes, 4 splits): requested
    >>> print(Plan("rolling", 64, dynamic=True, reason="one build"))
    rolling (64 lanes, dynamic shapes): one build
    >>> Plan("rolling", 1, 1, True, "why", 256)  # a target's field is never positional
    Traceback (most recent call last):
    ...
    TypeError: Plan.__init__() takes from 2 to 6 positional arguments but 7 were given
    """

    variant: str
    # elements of a row one step of the fold takes per thread: the CPU's vector lanes (of
    # the compute dtype); always 1 on CUDA, where a block's threads share the row
    # (``CudaPlan.threads``)
    lanes: int = 1
    # split: pieces each row is cut into, folded in parallel (CPU tasks, CUDA blocks) and
    # combined with the derived merge
    splits: int = 1
    fast_math: bool = True
    reason: str = ""
    # one kernel for every row count and stream length (``geometry.symbolic_geometry``)
    dynamic: bool = field(default=False, kw_only=True)

    # searched fields a one-line description (``tune.search.describe``) leaves out, and
    # those it shows only away from their default
    hidden: ClassVar[frozenset[str]] = frozenset()
    terse: ClassVar[frozenset[str]] = frozenset()
    # fields of the single flat plan older redfusers stored in every tuning record that
    # this type lacks, with the values a record of this target may hold in them: those
    # are read and dropped, any other value is refused (``tune.space.plan_from_params``)
    retired: ClassVar[Mapping[str, tuple[int, ...]]] = {}

    @property
    def span(self) -> int:
        """Elements of a row one thread's fold covers per step (a split piece holds at
        least two such steps)."""
        return self.lanes

    def row_by_row(self) -> Plan:
        """This plan with each thread folding one row at a time (a row-resident kernel
        runs every pass over a row before the next row)."""
        return self

    def details(self) -> str:
        """The target's own fields in words, after the shared ones (``__str__``)."""
        return ""

    def __str__(self) -> str:
        extra = ", dynamic shapes" if self.dynamic else ""
        extra += f", {self.splits} splits" if self.variant == "split" else ""
        return f"{self.variant} ({self.lanes} lanes{extra}{self.details()}): {self.reason}"


def check_variant(variant: str | None, dynamic: bool = False) -> None:
    """Refuse a variant name no target builds (None: the target's policy picks), and for a
    kernel of every N (``dynamic``) the split, whose pieces are cut by the row's length."""
    if variant is not None and variant not in (*VARIANTS, STAGED_VARIANT):
        raise ValueError(f"variant must be one of {(*VARIANTS, STAGED_VARIANT)}, not "
                         f"{variant!r}")
    if dynamic and variant == "split":
        raise ValueError("variant 'split' cuts each row by its length: it needs static "
                         "shapes (dynamic=False)")
