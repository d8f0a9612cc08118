"""What one run of the pass did: every cascade found, fused or skipped with the reason."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupReport:
    """One cascade found in a Relax function.

    ``values``: the Relax variables it computes; ``ops``: the lifted bindings ("softmax
    lv9"); ``status``: "fused" or "skipped"; ``reason``: why it was skipped, or the kernel's
    plan when fused; ``spec``: the lifted spec ("" when lifting itself failed).
    """

    function: str
    values: tuple[str, ...]
    ops: tuple[str, ...]
    status: str
    reason: str = ""
    spec: str = ""
    kernel: str = ""

    def __str__(self) -> str:
        what = ", ".join(dict.fromkeys(o.split()[0] for o in self.ops))
        head = f"{self.status:8s} {self.function}: {what} -> {', '.join(self.values)}"
        return head + (f" [{self.kernel}]" if self.kernel else f"\n         {self.reason}")


@dataclass(frozen=True)
class FuseReport:
    """All cascades of one module; ``str(report)`` is a readable summary.

    Examples
    --------
    >>> r = FuseReport((GroupReport("main", ("lv1",), ("softmax lv1",), "fused",
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
        return sum(g.status == "fused" for g in self.groups)

    @property
    def skipped(self) -> int:
        return self.found - self.fused

    def reasons(self) -> list[str]:
        """One line per skipped cascade: what and why."""
        return [f"{', '.join(g.values)}: {g.reason}" for g in self.groups
                if g.status != "fused"]

    def __str__(self) -> str:
        head = f"{self.found} cascade(s) found, {self.fused} fused, {self.skipped} skipped"
        return "\n".join([head, *(f"  {g}" for g in self.groups)])
