"""The array convention shared by every array-level API (evaluate, reference, kernels).

Rows may have any number of axes and broadcast like numpy.  Streamed inputs are
(*rows, N) or (*rows, N, D); per-row parameters are scalars, (*rows,) or (*rows, D).
Internally every array is viewed (never copied) as (*rows, L, F): L is N for streams
and 1 otherwise (k for top-k results), F is D for feature vectors and 1 otherwise.

Which inputs carry the feature axis: those written ``x[i, :]`` / ``g[:]`` or passed to
``dot``; any other stream whose trailing axes can only be read as (N, D) is read so;
a stream that could be read both ways is an error that asks for ``x[i, :]``.

Inputs that disagree are errors naming the input and the shape expected: a parameter whose
rows and the other inputs' would broadcast to an outer product (T of shape (4, 1) next to
x (4, N): a parameter may widen the others' rows, as q (H, L, D) does K's (H, 1, N, D), or be
widened by them, not both), and an ``N`` passed next to streams of another length.
"""

from __future__ import annotations

import importlib
import operator
from dataclasses import dataclass
from numbers import Number

import numpy as np

from .cascade import LENGTH, Cascade, carries_feature_axis
from .dtypes import storage


@dataclass(frozen=True)
class Layout:
    """Resolved inputs: rows, N, D and every input viewed as (*rows, L, F)."""

    rows: tuple[int, ...]
    n: int
    d: int | None
    dtype: np.dtype
    arrays: dict[str, np.ndarray]
    vector: frozenset[str] = frozenset()  # inputs read with the feature axis


def _fail(name: str, shape, expected: str):
    raise ValueError(f"input '{name}' has shape {tuple(shape)}; expected {expected}")


def resolve(cascade: Cascade, inputs: dict, dtype=None, keep: frozenset = frozenset()) -> Layout:
    """Check ``inputs`` against the cascade and view them in the internal layout, converted
    to ``dtype`` (default: the widest float input's) except those of a dtype named in
    ``keep`` (a kernel's storage dtypes, ``algebra.dtypes``), which stay as they are.

    Examples
    --------
    >>> from algebra.spec import parse
    >>> c = parse("s = dot(q, k[i]); m = max(s)")
    >>> lay = resolve(c, {"q": np.ones((2, 3, 4)), "k": np.ones((2, 1, 5, 4))})
    >>> lay.rows, lay.n, lay.d, lay.arrays["k"].shape, lay.arrays["q"].shape
    ((2, 3), 5, 4, (2, 1, 5, 4), (2, 3, 1, 4))
    """
    streams = [s.name for s in cascade.streams]
    params = [p.name for p in cascade.params]
    expected = set(streams) | set(params)
    missing = sorted(expected - set(inputs))
    if missing:
        raise ValueError(f"missing input(s) {missing}: the spec reads streams {streams} "
                         f"((*rows, N) or (*rows, N, D)) and parameters {params}")
    extra = sorted(set(inputs) - expected - {LENGTH})
    if extra:
        raise ValueError(f"unexpected input(s) {extra}: the spec reads {sorted(expected)}")
    arrays = {k: _as_array(k, inputs[k]) for k in sorted(expected)}
    dtype = np.dtype(dtype) if dtype is not None else _working_dtype(arrays)
    vec = set(cascade.vector_inputs)
    n = _stream_length(cascade, arrays, vec, _length(inputs.get(LENGTH)))
    d = _feature_length(arrays, vec, streams)
    known = [a.ndim - (2 if k in vec else 1 if k in streams else 1 if k in vec else 0)
             for k, a in arrays.items() if k in vec or k in params]
    for s in streams:
        if s not in vec:
            if _reads_as_vector(arrays[s].shape, n, d, max(known, default=0)):
                vec.add(s)
                d = arrays[s].shape[-1]
            elif arrays[s].ndim < 1 or arrays[s].shape[-1] != n:
                _fail(s, arrays[s].shape, f"(*rows, {n}) or (*rows, {n}, D)")
    views, row_shapes = {}, {}
    for name, a in arrays.items():
        tail = (2 if name in vec else 1) if name in streams else (1 if name in vec else 0)
        if a.ndim < tail:
            _fail(name, a.shape, "(*rows, N, D)" if tail == 2 else "(*rows, D)")
        row_shapes[name] = a.shape[:a.ndim - tail]
        shape = a.shape if name in streams else a.shape[:a.ndim - tail] + (1,) + a.shape[a.ndim -
                                                                                       tail:]
        a = a if a.dtype.name in keep else a.astype(dtype, copy=False)
        views[name] = a.reshape(shape + (() if name in vec else (1,)))
    for r in cascade.reductions:
        if r.k and r.k > n:
            raise ValueError(f"{r.op}({r.name}) asks for k = {r.k} values of a stream of "
                             f"length N = {n}")
        if n == 0 and r.op in ("argmax", "argmin"):
            raise ValueError(f"{r.op}({r.name}) of an empty stream (N = 0) has no index to "
                             "return (the value reductions give their identities: sum 0, "
                             "prod 1, max -inf, min +inf)")
    try:
        rows = np.broadcast_shapes(*row_shapes.values())
    except ValueError:
        desc = ", ".join(f"{k}: {v}" for k, v in row_shapes.items())
        raise ValueError(f"row axes do not broadcast ({desc})") from None
    _check_parameter_rows(row_shapes, params, arrays, vec)
    return Layout(tuple(rows), n, d, dtype, views, frozenset(vec))


def _length(given) -> int | None:
    """The ``N`` a caller passed: a non-negative integer (or None: not passed)."""
    if given is None:
        return None
    try:
        if isinstance(given, bool):
            raise TypeError
        n = operator.index(given)
    except TypeError:
        raise ValueError(f"input '{LENGTH}' is the stream length: a non-negative integer, "
                         f"not {given!r}") from None
    if n < 0:
        raise ValueError(f"input '{LENGTH}' is the stream length: a non-negative integer, "
                         f"not {n}")
    return n


def _check_parameter_rows(row_shapes: dict, params: list, arrays: dict, vec):
    """Refuse a parameter whose row axes and the other inputs' would broadcast to an outer
    product: a size-1 axis of its own that the others widen *and* an axis that widens
    theirs (numpy would pair every parameter value with every row of the others: T of shape
    (4, 1) next to x (4, N) gives 4 x 4 results; the mistake is a keepdim column).  A
    parameter may widen the others' rows (q (H, L, D) over a K of (H, 1, N, D)) or be
    widened by them (causal attention's pos (1, L) next to that q)."""
    for p in params:
        own = row_shapes[p]
        others = np.broadcast_shapes(*(r for k, r in row_shapes.items() if k != p))
        aligned = ((1,) * len(own) + tuple(others))[-len(own):] if own else ()
        widened = any(a == 1 and b > 1 for a, b in zip(own, aligned, strict=True))
        widens = any(a > 1 and b == 1 for a, b in zip(own, aligned, strict=True))
        if widened and widens:
            tail = f"(*rows, D) = {(*others, arrays[p].shape[-1])}" if p in vec else \
                f"(*rows,) = {tuple(others)}"
            _fail(p, arrays[p].shape, f"a scalar or {tail} (axes of size 1 broadcast): its "
                  f"row axes {tuple(own)} and the other inputs' {tuple(others)} would pair "
                  f"every value of '{p}' with every row of theirs "
                  f"({np.broadcast_shapes(own, others)} results)")


def _as_array(name: str, value) -> np.ndarray:
    if isinstance(value, Number) and not isinstance(value, bool):
        return np.asarray(value)
    if hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray):
        if getattr(value, "requires_grad", False):  # DLPack refuses it; detach is a view
            value = value.detach()
        value = host_view(resolved(value))
    if not isinstance(value, np.ndarray):
        raise TypeError(f"input '{name}' must be a number or an array, not "
                        f"{type(value).__name__}")
    if value.dtype.kind not in "fiu" and storage(value.dtype) is None:
        raise TypeError(f"input '{name}' has dtype {value.dtype}; expected a real number type")
    return value


def host_view(tensor) -> np.ndarray:
    """A DLPack tensor as a numpy array, zero-copy; a dtype numpy lacks (torch's bfloat16)
    goes over as its bits, viewed back as ml_dtypes' (``algebra.dtypes``)."""
    kind = storage(tensor.dtype)
    if kind is None or kind.bits_as is None:
        return np.from_dlpack(tensor)
    return np.from_dlpack(bits_view(tensor)).view(kind.numpy)


def bits_view(tensor):
    """A bfloat16 array or tensor (ml_dtypes' or torch's) as its int16 bits, in its own
    framework and memory (what a kernel declares it as: ``algebra.dtypes``); any other
    as it is."""
    kind = storage(tensor.dtype)
    if kind is None or kind.bits_as is None:
        return tensor
    if isinstance(tensor, np.ndarray):
        return tensor.view(kind.bits_as)
    framework = importlib.import_module(type(tensor).__module__.split(".")[0])
    return tensor.view(getattr(framework, kind.bits_as.name))


# Lazy views a framework keeps as a bit on the tensor, not in its memory: DLPack hands over
# the memory alone (torch's x.conj().imag reads as -x).  Method names, as torch spells them.
VIEW_BITS = (("is_neg", "resolve_neg"), ("is_conj", "resolve_conj"))


def resolved(tensor):
    """``tensor`` with its lazy view bits applied (a copy, only where a bit is set), so that
    its memory holds its values.

    Examples
    --------
    >>> class Flipped:  # a view whose memory holds -x, as torch's negative bit marks
    ...     def is_neg(self):
    ...         return True
    ...     def resolve_neg(self):
    ...         return "a copy holding x"
    >>> resolved(Flipped())
    'a copy holding x'
    >>> a = np.ones(2)
    >>> resolved(a) is a  # no bits: the same object, no copy
    True
    """
    for flag, resolve in VIEW_BITS:
        if getattr(tensor, flag, lambda: False)():
            tensor = getattr(tensor, resolve)()
    return tensor


def _working_dtype(arrays) -> np.dtype:
    floats = [a.dtype for a in arrays.values() if a.dtype.kind == "f" and a.ndim]
    return np.result_type(*floats) if floats else np.dtype(np.float64)


def _stream_length(cascade, arrays, vec, given: int | None) -> int:
    """N: the streams' length (``given``, the caller's N, must agree), else ``given``."""
    n, source = _measured_length(cascade, arrays, vec)
    if n is None:
        if given is None:
            raise ValueError(f"the spec streams only the index i: pass {LENGTH}=<stream length>")
        return given
    if given is not None and given != n:
        raise ValueError(f"input '{LENGTH}' is {given}, but stream '{source}' has length {n} "
                         f"(shape {tuple(arrays[source].shape)}): {LENGTH} follows from the "
                         "streams; pass it only when the spec streams nothing but i")
    return n


def _measured_length(cascade, arrays, vec) -> tuple[int | None, str | None]:
    """(N, the stream it was read from), or (None, None) when nothing but i is streamed."""
    streams = [s.name for s in cascade.streams]
    for s in streams:
        if s in vec:
            if arrays[s].ndim < 2:
                _fail(s, arrays[s].shape, "(*rows, N, D): it carries a feature axis")
            return arrays[s].shape[-2], s
    if streams:
        s = min(streams, key=lambda k: arrays[k].ndim)
        if arrays[s].ndim < 1:
            _fail(s, arrays[s].shape, "(*rows, N): it is streamed")
        return arrays[s].shape[-1], s
    return None, None


def _feature_length(arrays, vec, streams) -> int | None:
    d = None
    for name in sorted(vec):
        a = arrays[name]
        if a.ndim < 1:
            _fail(name, a.shape, "a trailing feature axis D")
        if d is not None and a.shape[-1] != d:
            _fail(name, a.shape, f"feature axis D = {d} (as the other vector inputs)")
        d = a.shape[-1]
    return d


def _reads_as_vector(shape, n, d, other_rank: int) -> bool:
    """An undeclared stream x[i] is read as (*rows, N) whenever its shape allows, and as
    (*rows, N, D) only when it must: when (*rows, N) is impossible, or when reading it so
    would give it more row axes than any declared or parameter input has (attention's
    v (H, 1, N, D) with N == D next to q (H, L, D))."""
    as_vector = len(shape) >= 2 and shape[-2] == n and (d is None or shape[-1] == d)
    as_scalar = len(shape) >= 1 and shape[-1] == n
    if as_vector and as_scalar:
        return other_rank > 0 and len(shape) - 1 > other_rank >= len(shape) - 2
    return as_vector


def to_user(cascade: Cascade, layout: Layout, values: dict[str, np.ndarray]) -> dict:
    """Internal (*rows, L, F) results -> the documented output shapes, in spec order.

    (*rows,) for scalars, (*rows, D) for feature vectors (also when D = 1), (*rows, k) for
    top-k, and (*rows, N[, D]) for per-element outputs.
    """
    vector = vector_results(cascade, layout.vector)
    out = {}
    for name in cascade.outputs:
        v = np.asarray(values[name])
        if v.ndim < 2:  # a constant result (m - m): one value for every row
            v = v.reshape((1, 1))
        shape = cascade.shapes.get(name)
        v = np.broadcast_to(v, np.broadcast_shapes(layout.rows + v.shape[-2:], v.shape))
        if name in cascade.elementwise:  # dx[i] = t reads no stream: N elements too
            v = np.broadcast_to(v, np.broadcast_shapes(v.shape, (layout.n, 1)))
        if shape is not None and shape.k:
            v = v[..., :, 0]
        elif name in cascade.elementwise:
            v = v if name in vector else v[..., 0]
        else:
            v = v[..., 0, :] if name in vector else v[..., 0, 0]
        out[name] = np.array(v) if not v.flags.writeable or not v.flags.c_contiguous else v
    return out


def vector_results(cascade: Cascade, vector_inputs) -> set[str]:
    """Names of results and per-element outputs that carry the feature axis."""
    vec = set(vector_inputs)
    for r in cascade.reductions:
        if carries_feature_axis(r.body, vec) and not cascade.shapes[r.name].k:
            vec.add(r.name)
        for name, expr in cascade.epilogues.items():
            if carries_feature_axis(expr, vec):
                vec.add(name)
    vec |= {n for n, e in cascade.elementwise.items() if carries_feature_axis(e, vec)}
    return vec
