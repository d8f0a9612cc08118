"""The errors users see: a bad spec, a cascade with no exact one-pass form, a gradient the
engine does not derive."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec that cannot be read: the message names line, column and problem."""

    def __init__(self, message: str, line: int | None = None, col: int | None = None):
        self.line, self.col = line, col
        where = f"line {line}, column {col}: " if line is not None else ""
        super().__init__(where + message)

    @classmethod
    def at(cls, node: object, message: str) -> SpecError:
        """The error at an ``ast`` node's position (1-based column, as editors count)."""
        return cls(message, getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1)


class NotFusable(ValueError):
    """A cascade the engine cannot fuse exactly: names the reduction, sub-expression and why."""

    def __init__(self, reduction: str, culprit: object, why: str):
        self.reduction, self.culprit, self.why = reduction, culprit, why
        super().__init__(f"reduction '{reduction}' cannot be fused: `{culprit}` {why}")


class NoBackward(ValueError):
    """A gradient the engine does not derive: names the value and why (``algebra.backward``
    lists the reasons)."""
