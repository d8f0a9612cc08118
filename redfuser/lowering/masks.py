"""Emitter steps for masked reductions: the conditions a block of elements is known to
meet (``algebra.skip``), so a block the mask excludes is skipped and one it includes is
emitted with the condition true (no select); mixed into ``emitter.Emitter``."""

from __future__ import annotations

from contextlib import contextmanager

from algebra.skip import index_bound, skip_conditions

from ..tvm.ir import T, tirx
from .steps import all_of


class MaskSteps:
    @contextmanager
    def assuming(self, facts: dict):
        """Emit with conditions replaced by known truth values: inside a block where a
        select's condition holds everywhere, ``where(c, a, b)`` is ``a`` (select semantics,
        exact for inf and NaN in b)."""
        before, self.assumed = self.assumed, {**self.assumed, **facts}
        try:
            yield
        finally:
            self.assumed = before

    # Skipped blocks (``algebra.skip``) --------------------------------------------------
    def block_mask(self, rows: list, base, size: int):
        """(cond, none, every): for the rule's skip condition ``cond`` (``algebra.skip``)
        monotone in the element index, TIR tests that it holds on no element of [base,
        base + size) for any row of ``rows`` (the block leaves them unchanged: skip it),
        and on every element for every row (emit it with ``cond`` true); None if there
        is no such condition.  Tested at the block's two ends."""
        for cond in skip_conditions(self.rule):
            found = index_bound(cond)
            if found is None:
                continue
            op, bound = found
            dtype = self.geo.compute
            first, last = tirx.Cast(dtype, base), tirx.Cast(dtype, base + size - 1)
            none, every = [], []
            for r in rows:
                e = T.bind(self.expr(bound, self.base_lookup(r)))
                lo, hi = (first, last) if op in ("<=", "<") else (last, first)
                none.append(_holds(op, lo, e, negate=True))
                every.append(_holds(op, hi, e))
            return cond, all_of(none), all_of(every)
        return None


def _holds(op: str, i, e, negate: bool = False):
    """``i op e`` (or its negation) in TIR."""
    if negate:
        op = {"<=": ">", "<": ">=", ">=": "<", ">": "<="}[op]
    return {"<=": i <= e, "<": i < e, ">=": i >= e, ">": i > e}[op]
