"""Helpers shared by the test modules: hypothesis strategies, oracle comparisons and
tolerances, rule and input factories, a hang detector.  Test modules import them from here
(``from tests.support import ...``), never from each other (tests/test_house.py); the
hypothesis profiles and the session's cache directory are set up in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import signal

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import redfuser
from algebra.library import STAGED
from algebra.oracle_measures import central_differences as central_differences
from redfuser.tvm.graph import relax

# the generated specs and cascades live in their own module; test modules import them from here
from tests.support.generated import SAFETY as SAFETY
from tests.support.generated import TEXT as TEXT
from tests.support.generated import cascade_inputs as cascade_inputs
from tests.support.generated import cascades as cascades
from tests.support.generated import make_inputs as make_inputs
from tests.support.generated import sensitivity as sensitivity
from tests.support.generated import specs as specs

VARIANTS = ("rolling", "split", "unfused")  # of a one-pass rule
STAGED_VARIANTS = ("resident", "unfused")  # a staged rule: its stages per row, or per kernel
# float32 kernels against a float64 oracle (torch or redfuser.reference), sums of at most a few
# hundred O(1) terms, polynomial exp within 1 ulp: measured errors are ~5e-7, so this has room
KERNEL_TOL = 2e-5
# CUDA source can be compiled wherever the toolchain is, with or without a GPU
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc is not on PATH: the CUDA build cannot be checked")


def kernel_variants(spec: str) -> tuple[str, ...]:
    """The kernel variants of a spec's rule: a staged rule has no one-pass variants."""
    staged = spec in STAGED or isinstance(rule_for(spec), redfuser.StagedRule)
    return STAGED_VARIANTS if staged else VARIANTS


def examples(factor: float) -> int:
    """A per-test example count relative to the loaded profile's (25 by default), so that
    HYPOTHESIS_PROFILE=thorough scales the tests that set their own count as well."""
    return max(1, round(settings.default.max_examples * factor))


F32 = np.float32
EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-07
# Smallest normal float32 (1.2e-38): below it float32 holds only an absolute accuracy, so every
# comparison allows this much (e.g. the mean of [0, 1e-45] is 7e-46, which float32 cannot hold).
TINY32 = float(np.finfo(np.float32).tiny)

# -- rules ----------------------------------------------------------------------------------


@functools.cache
def rule_for(spec: str):
    """Derive once per spec and process (a FusionRule is immutable; its numpy closures are
    cached inside it, so reusing it keeps the property tests fast)."""
    return redfuser.derive(spec)


# -- shapes, chunkings, merge trees ---------------------------------------------------------

def row_shapes(max_axes: int = 2, max_size: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    """Row axes: () up to ``max_axes`` axes, each of size 1..``max_size``."""
    return st.lists(st.integers(1, max_size), max_size=max_axes).map(tuple)


def stream_lengths(min_n: int = 1, max_n: int = 12) -> st.SearchStrategy[int]:
    return st.integers(min_n, max_n)


@st.composite
def chunkings(draw, n: int) -> list[int]:
    """A random split of N elements into positive chunk lengths (1 to N chunks)."""
    cuts = draw(st.lists(st.integers(1, n - 1), unique=True, max_size=n - 1)) if n > 1 else []
    edges = [0, *sorted(cuts), n]
    return [b - a for a, b in zip(edges[:-1], edges[1:], strict=True)]


@st.composite
def merge_trees(draw, n_chunks: int):
    """None (left to right) or nested tuples using each chunk number once, in a random order,
    with binary and ternary nodes; a single chunk is the bare leaf 0."""
    if draw(st.integers(0, 4)) == 0:
        return None
    leaves = draw(st.permutations(range(n_chunks)))

    def build(items):
        if len(items) == 1:
            return items[0]
        if len(items) >= 3 and draw(st.booleans()):
            a = draw(st.integers(1, len(items) - 2))
            b = draw(st.integers(a + 1, len(items) - 1))
            return (build(items[:a]), build(items[a:b]), build(items[b:]))
        cut = draw(st.integers(1, len(items) - 1))
        return (build(items[:cut]), build(items[cut:]))

    return build(list(leaves))


@st.composite
def schedules(draw, n: int):
    """(chunks, tree) for a stream of length ``n``."""
    chunks = draw(chunkings(n))
    return chunks, draw(merge_trees(len(chunks)))


# -- float32 streams --------------------------------------------------------------------------

GRID = st.integers(-16, 16).map(lambda k: k * 0.25)  # exact in float32 and float64
TIES = st.sampled_from([-1.0, 0.0, 0.5, 2.0])  # few distinct values: many ties


def _f32_below(limit: float) -> float:
    """The largest float32 not above ``limit`` (hypothesis wants float32-exact bounds)."""
    v = np.float32(limit)
    return float(v if float(v) <= limit else np.nextafter(v, np.float32(0)))


def values(kind: str, limit: float = 8.0) -> st.SearchStrategy[float]:
    """Elements by kind: 'normal' and 'huge' (any float32 with |x| <= limit; tests pass a limit
    up to 1e30 for 'huge'), 'grid' (multiples of 0.25 in [-4, 4]), 'ties' (four values)."""
    if kind == "grid":
        return GRID
    if kind == "ties":
        return TIES
    lim = _f32_below(limit)
    return st.floats(-lim, lim, width=32, allow_nan=False, allow_infinity=False)


@st.composite
def float32_streams(draw, shape: tuple[int, ...],
                    kinds: tuple[str, ...] = ("normal", "huge", "grid", "ties"),
                    limit: float = 8.0, huge: float = 1e30,
                    inject: float | None = None) -> np.ndarray:
    """A float32 array of ``shape`` (the stream axis last; or (..., N, D) for feature rows).

    The element kind is drawn from ``kinds`` ('huge' uses the ``huge`` limit, the others
    ``limit``).  With ``inject`` (e.g. -inf; meant for (*rows, N) streams) that value may
    replace a random subset of the entries, the first element of every row, or whole rows."""
    kind = draw(st.sampled_from(kinds))
    x = draw(hnp.arrays(F32, shape, elements=values(kind, huge if kind == "huge" else limit)))
    x = x.copy()
    if inject is not None and x.size:
        how = draw(st.sampled_from(["none", "mask", "first", "rows", "mask"]))
        if how == "mask":
            x[draw(hnp.arrays(np.bool_, shape))] = inject
        elif how == "first":
            x[..., 0] = inject
        elif how == "rows":
            x[draw(hnp.arrays(np.bool_, shape[:-1])) if len(shape) > 1 else ...] = inject
    return x


@st.composite
def streamed_case(draw, min_n: int = 1, max_n: int = 12, **kw):
    """(x, chunks, tree): a float32 stream (*rows, N) and a random schedule over it."""
    rows, n = draw(row_shapes()), draw(stream_lengths(min_n, max_n))
    x = draw(float32_streams(rows + (n,), **kw))
    chunks, tree = draw(schedules(n))
    return x, chunks, tree


# -- comparisons ------------------------------------------------------------------------------

def finite_max_abs(a, axis=None, keepdims: bool = False) -> np.ndarray:
    """max |a| over the finite entries (0 where there are none), in float64: the scale that
    absolute tolerances are taken relative to."""
    a = np.abs(np.asarray(a, np.float64))
    return np.max(np.where(np.isfinite(a), a, 0.0), axis=axis, keepdims=keepdims, initial=0.0)


def assert_matches(fused: np.ndarray, ref: np.ndarray, rtol: float, atol, name: str = ""):
    """fused ~ ref within rtol/atol (atol may be an array broadcasting over the output);
    NaN and +-inf must sit at exactly the same places (NaN only where the reference has one)."""
    fused, ref = np.asarray(fused), np.asarray(ref)
    assert fused.shape == ref.shape, f"{name}: shape {fused.shape} != reference {ref.shape}"
    np.testing.assert_array_equal(np.isnan(fused), np.isnan(ref),
                                  err_msg=f"{name}: NaN at different places")
    np.testing.assert_array_equal(np.isposinf(fused), np.isposinf(ref),
                                  err_msg=f"{name}: +inf at different places")
    np.testing.assert_array_equal(np.isneginf(fused), np.isneginf(ref),
                                  err_msg=f"{name}: -inf at different places")
    fin = np.isfinite(ref)
    with np.errstate(invalid="ignore"):  # inf - inf at the (already matched) infinities
        err = np.abs(fused.astype(np.float64) - ref)
        bound = np.broadcast_to(np.asarray(atol, np.float64) + rtol * np.abs(ref) + TINY32,
                                ref.shape)
    bad = fin & ~(err <= bound)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} value(s) off; first at {np.argwhere(bad)[0].tolist()}: fused "
        f"{fused[bad][0]!r} vs reference {ref[bad][0]!r} (tolerance {bound[bad][0]:.3g})")


def assert_indices_equal(fused: np.ndarray, ref: np.ndarray, name: str = ""):
    assert fused.dtype.kind in "iu", f"{name}: index output has dtype {fused.dtype}"
    np.testing.assert_array_equal(fused, ref, err_msg=f"{name}: indices differ")


# -- a rule against the oracle (tests/algebra/test_properties.py explains the tolerances) ----

# sums of positive terms and their ratios: ~840 float32 ulps, two orders of magnitude above
# the ~1e-6 that a few roundings per element and exp's argument error give
RULE_RTOL = 1e-4
MOE_K2 = ("m = max(x[i]); d = sum(exp(x[i] - m)); p = topk(exp(x[i] - m) / d, 2); "
          "e = argtopk(exp(x[i] - m) / d, 2)")


def run_both(spec: str, inputs: dict, chunks=None, tree=None):
    """(fused, reference) outputs; checks names, shapes and the float32 working dtype."""
    rule = rule_for(spec)
    fused = rule.evaluate(inputs, chunks=chunks, tree=tree)
    ref = redfuser.reference(spec, inputs)
    assert list(fused) == list(ref) == list(rule.outputs)
    dtype = np.result_type(*[v.dtype for v in inputs.values()
                             if isinstance(v, np.ndarray) and v.ndim])
    for name in fused:
        assert fused[name].shape == ref[name].shape, name
        if ref[name].dtype.kind == "f":
            assert fused[name].dtype == dtype, f"{name} computed in {fused[name].dtype}"
    return fused, ref


def library_inputs(name: str, rng: np.random.Generator, rows: tuple, n: int, d: int = 3):
    """Inputs of the documented shapes for a library entry (float32, |values| <= ~3)."""
    def f(*shape):
        return rng.uniform(-3, 3, shape).astype(F32)

    if name == "attention":
        return {"q": f(*rows, d), "k": f(*rows, n, d), "v": f(*rows, n, d), "scale": 0.5}
    if name == "causal_attention":  # pos -1: a fully masked row
        return {"q": f(*rows, d), "k": f(*rows, n, d), "v": f(*rows, n, d), "scale": 0.5,
                "pos": rng.integers(-1, n, rows).astype(F32)}
    if name == "cross_entropy":
        return {"x": f(*rows, n), "t": f(*rows, n)}
    if name == "layernorm":
        return {"x": f(*rows, n), "g": f(n), "b": f(n), "eps": 1e-5}
    if name == "rmsnorm":
        return {"x": f(*rows, n), "g": f(n), "eps": 1e-6}
    if name == "rmsnorm_gemm":
        return {"x": f(*rows, n), "w": f(n, d), "eps": 1e-6}
    if name == "softmax_entropy":
        return {"x": f(*rows, n), "T": 1.5}
    if name == "linear_cross_entropy":  # label -1: a row no class is picked in
        return {"h": f(*rows, d), "w": f(n, d), "label": rng.integers(-1, n, rows).astype(F32)}
    if name == "softmin_average":
        return {"x": f(*rows, n), "v": f(*rows, n, d)}
    if name in ("relu_sum", "threshold_mass"):  # a threshold that selects some elements
        return {"x": f(*rows, n), "t": 1.0 if name == "relu_sum" else 0.5 / max(n, 1)}
    return {"x": f(*rows, n)}


def loose_compare(fused, ref):
    """Generic check: values within RULE_RTOL of the reference, or 1e-4 of the output's own scale
    (every library output here is O(1) to O(N * 9) for |inputs| <= 3); indices exactly."""
    for name in ref:
        if ref[name].dtype.kind in "iu":
            assert_indices_equal(fused[name], ref[name], name)
        else:
            atol = 1e-4 * (1.0 + finite_max_abs(ref[name]))
            assert_matches(fused[name], ref[name], RULE_RTOL, atol, name)


# -- Relax modules -------------------------------------------------------------------------

def softmax_module(shape: tuple):
    """A Relax module whose main is ``softmax(x)`` over the last axis of a float32 ``x``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.softmax(x))
        bb.emit_func_output(y)
    return bb.get()


# -- hangs ----------------------------------------------------------------------------------

class Hang(BaseException):
    """A call ran past its wall-clock limit.  Not an Exception on purpose: hypothesis then
    reports the example at once instead of shrinking it (each shrink step would cost the full
    limit), and no ``except Exception`` in the code under test can swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Raise ``Hang`` if the block runs for more than ``seconds`` of wall-clock time (a hang
    detector with a generous limit, never a speed assertion)."""
    def expire(signum, frame):
        raise Hang(f"{what} ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
