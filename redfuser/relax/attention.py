"""``R.nn.attention`` and ``R.nn.attention_bias`` lifted: softmax(q k^T * scale + bias) v.

The op's layout is BSNH: q (B, S, H, D), k and v (B, S_kv, H_kv, D).  The kernel's rows
are (B, S, H_kv, G) with G = H / H_kv query heads per key head: q is read in place (its
head axis split, free), and each K/V row is shared by the G heads of its group through
the kernels' row broadcasting, so grouped-query attention reads K and V once, with no
repeated copy.  K, V and the bias are permuted to put the key axis before the features
(``permute_dims``, one copy each).  A causal mask is a comparison of the key index with a
per-row position, as the spec's ``where(i <= pos, s, -inf)``.  q, k, v and the bias are read
in their own dtype (float32, bfloat16 or float16: loads convert, the kernel computes in
float32, as torch's attention does on low-precision tensors); ``o`` takes the op's dtype,
stored by the kernel rounded once (a feature-vector result, ``signature.stored_results``).
Any other dtype is refused by name where the input is registered (``Lifter.input``).
"""

from __future__ import annotations

import math

import numpy as np

from ..tvm.graph import relax
from .frag import Unliftable, merge
from .values import Ext, Lifting, Node, literal, pad_shape, static_shape

KEYS_FIRST = (0, 2, 1, 3)  # BSNH -> BNSH: the key axis before the features
CAUSAL_OFFSET = {"TopLeft": lambda s, n: 0,  # key j visible from query i iff j <= i + offset
                 "BottomRight": lambda s, n: abs(s - n)}  # as TVM's own op documents it


def attention(lf: Lifting, call, ty) -> Node:
    """The attention op as one cascade: scores, max, sum of exponentials, weighted sum."""
    q, k, v = call.args[:3]
    (b, s, h, d), (_, n, hk, dk), sv = (static_shape(a.ty) for a in (q, k, v))
    if h % hk or dk != d or sv[-1] != d or n < 2:
        raise Unliftable(f"attention of q {(b, s, h, d)}, k {(b, n, hk, dk)}, v {sv}: needs "
                         "whole groups of query heads and one head size")
    if call.attrs.window_size is not None:
        raise Unliftable("sliding-window attention (window_size): no lifting")
    frame = (b, s, hk, h // hk)
    qref, qf = lf.input(_read(q, (*frame, d)), "param", True, frame, frame, n, d)
    kv = [lf.input(_read(x, (b, hk, n, d), (("perm", KEYS_FIRST),)), "stream", True,
                   (b, 1, hk, 1), frame, n, d) for x in (k, v)]
    frags = [qf, kv[0][1], kv[1][1]]
    scale = call.attrs.scale
    score = f"dot({qref}, {kv[0][0]}) * " \
            f"{literal(float(scale.value) if scale is not None else 1 / math.sqrt(d))}"
    if len(call.args) > 3:
        ref, frag = _bias(lf, call.args[3], frame, n)
        score, frags = f"({score} + {ref})", [*frags, frag]
    if call.attrs.causal_mask is not None:
        ref, frag = _positions(lf, str(call.attrs.causal_mask), frame, n)
        score, frags = f"where(i <= {ref}, {score}, -inf)", [*frags, frag]
    frag = merge(frags, frame, n)
    steps = (("let", score), ("red", "max({0})"), ("red", "sum(exp({0} - {1}))"),
             ("red", f"sum(exp({{0}} - {{1}}) / {{2}} * {kv[1][0]})"))
    names = []
    for kind, template in steps:
        stmt = lf.stmt(template.format(*names), kind, frozenset(names), call.op.name)
        frag, names = frag.with_stmt(stmt), [*names, stmt.name]
    return Node("vec", frag, names[-1], frozenset({names[-1]}), static_shape(ty))


def _read(arg, shape: tuple, prep: tuple = ()) -> Ext:
    """An operand read in its own dtype: float32, or bfloat16 / float16, which the kernel
    converts as it loads (exact) and computes in float32, as torch's attention does on
    low-precision tensors; ``lf.input`` refuses any other dtype by name.  The output ``o``
    is then stored in the model's dtype (a feature-vector result, rounded once)."""
    dtype = str(arg.ty.dtype)
    return Ext(arg, shape, dtype, prep, dtype)


def _bias(lf: Lifting, bias, frame: tuple, n: int):
    """The bias (broadcastable to (B, H, S, S_kv)) as a stream on the kernel's rows."""
    b, s, hk, g = frame
    own = static_shape(bias.ty)
    if len(own) != 4:
        raise Unliftable(f"an attention bias of rank {len(own)}: the op takes rank 4")
    shape = pad_shape(own, 4, (b, hk * g, s, n))
    heads = (hk, g) if shape[1] > 1 else (1, 1)
    rows = (shape[0], shape[2], *heads)
    ext = _read(bias, (*rows, n), (("perm", KEYS_FIRST),))
    return lf.input(ext, "stream", False, rows, frame, n)


def _positions(lf: Lifting, mask: str, frame: tuple, n: int):
    """The last visible key of each query row, a constant parameter of the kernel."""
    if mask not in CAUSAL_OFFSET:
        raise Unliftable(f"causal mask {mask!r}")
    s = frame[1]
    last = np.arange(s, dtype=np.float32) + CAUSAL_OFFSET[mask](s, n)
    return lf.input(Ext(relax.const(last), (s,), "float32"), "param", False, (1, s, 1, 1),
                    frame, 0)
