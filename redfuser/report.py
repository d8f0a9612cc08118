"""What a fusion pass did, in one shape for both passes (``tensorir.fuse`` and the Relax
``FuseCascadedReductions``): every cascade found, fused or skipped with the reason."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupReport:
    """One cascade found in a function.

    ``values``: what it computes (TensorIR: the blocks it replaces; Relax: the variables);
    ``ops``: the lifted operations ("softmax lv9"; empty for TensorIR, where ``values``
    are the blocks); ``reason``: the kernel's plan when fused, else why it was skipped;
    ``spec``: the lifted spec ("" when lifting itself failed); ``kernel``: the fused
    function's name, where the pass adds one.
    """

    function: str
    values: tuple[str, ...]
    fused: bool
    reason: str = ""
    ops: tuple[str, ...] = ()
    spec: str = ""
    kernel: str = ""

    @property
    def status(self) -> str:
        return "fused" if self.fused else "skipped"

    def __str__(self) -> str:
        what = ", ".join(dict.fromkeys(o.split()[0] for o in self.ops)) or "blocks"
        head = f"{self.status:8s} {self.function}: {what} -> {', '.join(self.values) or '-'}"
        if self.fused and self.kernel:
            return f"{head} [{self.kernel}]"
        return f"{head}\n         {self.reason}"


@dataclass(frozen=True)
class FuseReport:
    """All cascades of one program, in program order; ``str(report)`` is a summary.

    Examples
    --------
    >>> r = FuseReport((GroupReport("main", ("lv1",), True, ops=("softmax lv1",),
    ...                             kernel="redfuser_main_0"),))
    >>> r.found, r.fused, r.skipped
    (1, 1, 0)
    """

    groups: tuple[GroupReport, ...] = ()

    @property
    def found(self) -> int:
        return len(self.groups)

    @property
    def fused(self) -> int:
        return sum(g.fused for g in self.groups)

    @property
    def skipped(self) -> int:
        return self.found - self.fused

    def reasons(self) -> list[str]:
        """One line per skipped cascade: what and why."""
        return [f"{', '.join(g.values)}: {g.reason}" for g in self.groups if not g.fused]

    def __str__(self) -> str:
        head = f"{self.found} cascade(s) found, {self.fused} fused, {self.skipped} skipped"
        return "\n".join([head, *(f"  {g}" for g in self.groups)])
