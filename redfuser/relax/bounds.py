"""Slices a symbolic function's variable bounds keep in range, marked so before lifting.

torch.export records each dynamic dimension's range on the function
(``tir_var_lower_bound`` / ``tir_var_upper_bound``), but Relax infers shapes without it: a
slice of a table of 64 positions to the sequence length ``s`` has ``min(s, 64)`` rows, the
add of that to a ``(B, s, D)`` tensor gets only a rank, and so does every value after it
(BERT's embeddings, then each LayerNorm, which TVM's own legalization then cannot build).
A ``strided_slice`` whose shape the bounds decide is rebuilt with ``assume_inbound`` (its
indices are in range for every length the export admits: that is what the bounds say, and
the rewrite is kept only where the new shape equals the old one under them), so its shape
is ``s`` and the ops after it infer full shapes again; shape arguments (a reshape to
``min(s, 64)``) are simplified under the bounds too.
"""

from __future__ import annotations

from ..tvm.graph import relax
from ..tvm.ir import bounded_simplify, provably_equal

SLICE = "relax.strided_slice"


def tightened(func):
    """``func`` with every slice its variables' bounds keep in range marked so (the function
    itself when it has no bounds)."""
    bounds = _bounds(func)
    if not bounds:
        return func
    return _Tighten(bounded_simplify(bounds)).visit_expr(func)


def tightened_module(mod):
    """A copy of ``mod`` with every Relax function ``tightened``."""
    out = mod.clone()
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            out[gv] = tightened(func)
    return out


def _bounds(func) -> dict:
    """TIR variable -> (lowest, highest) from the function's attributes, where both known."""
    attrs = func.attrs or {}
    low, high = (dict(attrs[k]) if k in attrs else {}
                 for k in ("tir_var_lower_bound", "tir_var_upper_bound"))
    names = {v.name: v for v in relax.analysis.defined_symbolic_vars(func)}
    return {names[n]: (int(low.get(n, 0)), int(high[n])) for n in high if n in names}


@relax.expr_functor.mutator
class _Tighten(relax.PyExprMutator):
    def __init__(self, simplify):
        super().__init__()
        self.simplify = simplify

    def visit_shape_expr_(self, op):
        """A shape argument (a reshape's, a broadcast's) in its simplest form under the
        bounds: the same value for every admitted length."""
        dims = [self.simplify(v) for v in op.values]
        if all(provably_equal(a, b) for a, b in zip(dims, op.values, strict=True)):
            return op
        return relax.ShapeExpr(dims)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if getattr(call.op, "name", None) != SLICE or call.attrs.assume_inbound:
            return call
        inbound = self.builder_.normalize(relax.op.strided_slice(*call.args,
                                                                 assume_inbound=True))
        old, new = (_dims(c) for c in (self.builder_.normalize(call), inbound))
        if old is None or new is None or len(old) != len(new):
            return call
        if all(provably_equal(self.simplify(a), b) for a, b in zip(old, new, strict=True)):
            return inbound
        return call


def _dims(expr):
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    return list(ty.shape.values)
