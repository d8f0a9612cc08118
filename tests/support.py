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


# -- generated specs (the spec-language fuzzer, tests/algebra/test_fuzz.py) ----------------

_STREAMS = ("x[i]", "y[i]")
_PARAMS = ("a", "b")
_RESULTS = ("r0", "r1", "r2")  # statement k assigns _RESULTS[k]
_CONSTANTS = ("2", "3", "0.5", "1", "-1", "N", "i", "pi")
_UNARY = ("exp", "log", "sqrt", "abs", "tanh", "sigmoid", "relu")
_BINARY_FUNCTIONS = ("pow", "maximum", "dot")
_UNKNOWN = ("foo", "softmax", "expp", "mean", "Exp")
_REDUCTIONS = ("sum", "sum", "max", "min", "prod", "argmax")
_K_REDUCTIONS = ("topk", "argtopk")
_GARBAGE = "$?!@`{}[]()#:;,=.'\"\\\n\t x"
# Any text but NUL and lone surrogates: each is an engine bug with its own test in
# tests/algebra/test_fuzz.py (test_unreadable_characters_are_positioned_spec_errors) that would
# otherwise be all the text fuzzers ever report (hypothesis shrinks strings towards exactly
# these characters).
TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
               max_size=60)


_ANCHORED = ("exp(x[i] - {r})", "(x[i] - {r})**2", "x[i] * {r}", "exp({r} - x[i])",
            "x[i] / {r}", "exp(x[i] - {r}) * y[i]", "(x[i] - {r})**3", "exp((x[i] - {r}) / a)")


@st.composite
def expressions(draw, depth: int, n_results: int) -> str:
    """A random expression over streams, parameters, constants and the first ``n_results``
    of _RESULTS (the earlier statements' results)."""
    defined = _RESULTS[:n_results]
    if draw(st.integers(0, 49)) == 0:  # now and then: a result not defined yet, or a cycle
        leaf = st.sampled_from(_RESULTS)
    else:
        leaf = st.sampled_from(["x[i]"] * 4 + ["y[i]", *_PARAMS, *_CONSTANTS] + list(defined) * 3)
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(leaf)
    sub = expressions(depth - 1, n_results)
    kinds = ["unary"] * 3 + ["op"] * 4 + ["power", "binary", "binary", "neg"] + \
        ["anchored"] * (4 if defined else 0)
    rare = draw(st.integers(0, 39))  # 1 in 40 nodes: an unknown function, 1 in 40 a reduction
    kind = "unknown" if rare == 0 else "reduction" if rare == 1 else draw(st.sampled_from(kinds))
    if kind == "anchored":  # an earlier result inside a stream expression: re-anchoring
        return draw(st.sampled_from(_ANCHORED)).format(r=draw(st.sampled_from(defined)))
    if kind == "unary":
        return f"{draw(st.sampled_from(_UNARY))}({draw(sub)})"
    if kind == "op":
        return f"({draw(sub)} {draw(st.sampled_from('+-*/'))} {draw(sub)})"
    if kind == "power":
        return f"{draw(sub)}**{draw(st.sampled_from(['2', '3', '0.5', '-1']))}"
    if kind == "binary":
        fn = draw(st.sampled_from(_BINARY_FUNCTIONS))
        if fn == "dot":  # feature-axis operands: streams x[i, :] or parameters
            args = draw(st.lists(st.sampled_from(["x[i, :]", "y[i, :]", "a[:]", "a", "x[i]"]),
                                 min_size=2, max_size=2))
            return f"dot({args[0]}, {args[1]})"
        return f"{fn}({draw(sub)}, {draw(sub)})"
    if kind == "neg":
        return f"-{draw(sub)}"
    if kind == "reduction":  # nested in a body: a SpecError; in an epilogue: a hidden result
        return f"{draw(st.sampled_from(_REDUCTIONS))}({draw(sub)})"
    return f"{draw(st.sampled_from(_UNKNOWN))}({draw(sub)})"


@st.composite
def statements(draw, k: int) -> str:
    target = _RESULTS[k]
    body = draw(expressions(draw(st.integers(1, 3)), k))
    kind = draw(st.sampled_from(["reduce", "reduce", "reduce", "reduce_k", "let", "element"]))
    if kind == "reduce":
        return f"{target} = {draw(st.sampled_from(_REDUCTIONS))}({body})"
    if kind == "reduce_k":
        k_arg = draw(st.sampled_from(["1", "2", "3", "0", "a"]))
        return f"{target} = {draw(st.sampled_from(_K_REDUCTIONS))}({body}, {k_arg})"
    if kind == "let":
        return f"{target} = {body}"
    return f"{target}[i] = {body}"


@st.composite
def specs(draw) -> str:
    """Random cascades (1-3 statements), sometimes mangled into invalid syntax or garbage."""
    n = draw(st.integers(1, 3))
    text = draw(st.sampled_from(["\n", "; "])).join(draw(statements(k)) for k in range(n))
    mangle = draw(st.sampled_from(["none"] * 20 + ["insert", "delete", "truncate", "text"]))
    if mangle == "insert":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.text(_GARBAGE, min_size=1, max_size=3)) + text[at:]
    elif mangle == "delete" and text:
        at = draw(st.integers(0, len(text) - 1))
        text = text[:at] + text[at + 1:]
    elif mangle == "truncate":
        text = text[:draw(st.integers(0, len(text)))]
    elif mangle == "text":
        text = draw(TEXT)
    return text


def make_inputs(rule, rng: np.random.Generator, rows: int = 2, n: int = 5, d: int = 3):
    """float64 inputs in [0.5, 1.5] (positive, so that most bodies stay inside their functions'
    domains; where one leaves it, fused and reference must agree on the NaN); streams (rows, N)
    or (rows, N, D), parameters (rows,) or (rows, D).  N = 5, D = 3 and rows = 2 differ, so no
    input can be read two ways."""
    cascade = rule.cascade
    inputs = {}
    for s in cascade.streams:
        vec = s.name in cascade.vector_inputs
        inputs[s.name] = rng.uniform(0.5, 1.5, (rows, n, d) if vec else (rows, n))
    for p in cascade.params:
        vec = p.name in cascade.vector_inputs
        inputs[p.name] = rng.uniform(0.5, 1.5, (rows, d) if vec else (rows,))
    return inputs


# -- generated cascades (kernels for cascades nobody wrote: tests/lowering/) ------------------

# First-level reductions, each tagged with what its result bounds: "max" results bound x
# from above, "min" from below, "any" neither.
_FIRST = (("max(x[i])", "max"), ("min(x[i])", "min"), ("sum(x[i]) / N", "any"),
         ("sum(exp(x[i]))", "any"), ("sum(x[i]**2)", "any"), ("max(abs(x[i]))", "any"),
         ("sum(tanh(x[i]) * y[i])", "any"), ("min(sigmoid(x[i]))", "any"),
         ("sum(x[i] * y[i])", "any"), ("sum(exp(x[i] / a))", "any"))
# Bodies anchored at an earlier result r, by the bound r must give.  An exponential is only
# re-anchored at a result that bounds its exponent (the online-softmax condition): at any other
# anchor the one-pass state under- or overflows float32 where the multi-pass form does not
# (``sum(exp(x - min(exp(x))))`` loses every term folded before the minimum arrives).
_ANCHORED_BY_BOUND = {
    "any": ("(x[i] - {r})**2", "x[i] * {r}", "(x[i] - {r})**3", "y[i] * (x[i] - {r})",
            "x[i] - {r}", "abs(x[i]) * {r}", "sin(x[i] - {r})", "cos(x[i] - {r}) * y[i]"),
    "max": ("exp(x[i] - {r})", "exp(x[i] - {r}) * y[i]", "exp((x[i] - {r}) / a)",
            "exp(x[i] - {r}) * x[i]", "pow(2, x[i] - {r})"),
    "min": ("exp({r} - x[i])", "exp({r} - x[i]) * y[i]")}
_VECTOR = {"any": ("(x[i] - {r}) * v[i, :]", "v[i, :] * {r}"),
          "max": ("exp(x[i] - {r}) * v[i, :]",), "min": ("exp({r} - x[i]) * v[i, :]",)}
_SUM_LIKE = ("sum", "sum", "sum", "max", "min")
_EPILOGUES = ("{s}", "{s} / {r}", "{s} * {r}")
# log only of sums of positive terms: the log of a sum that cancels to about 0 is NaN or not
# by the sign of a rounding error, in float32 and float64 alike
_LOG_EPILOGUE = "log({s}) + {r}"
_POSITIVE = ("exp(x[i] - @", "exp((x[i] - @", "exp(@")
_ELEMENTWISE = ("exp(x[i] - {r})", "(x[i] - {r}) * {s}", "x[i] / {r}")
_SELECTIONS = ("max(exp(x[i] - {r}))", "argmax(x[i] - {r})", "topk(x[i] * 2 - {r}, 2)",
              "argmin(x[i])")
_SENSITIVITY_ULPS = 4
SAFETY = 50


@st.composite
def anchored(draw, table: dict, results: list) -> str:
    """A body from ``table`` anchored at one of ``results`` [(name, bound)]."""
    name, bound = draw(st.sampled_from(results))
    options = table["any"] + (table[bound] if bound != "any" else ())
    return draw(st.sampled_from(options)).format(r=_use(name))


def _use(name: str) -> str:
    """A use of result ``name`` (rK), rendered by ``_render``."""
    return f"@{name[1:]}"


def _render(text: str, twin: bool) -> str:
    """The spec, or its twin where each use of rK is rK * (1 + uK) (uK: a per-row input)."""
    for k in range(4):
        text = text.replace(f"@{k}", f"(r{k} * (1 + u{k}))" if twin else f"r{k}")
    return text


@st.composite
def cascades(draw) -> tuple[str, str]:
    """A random chain: r0 from the streams, r1.. anchored at earlier results, maybe an
    epilogue, a vector sum, a selection or a per-element output at the end.  Returns the
    spec and its twin (see ``_render``)."""
    first, bound = draw(st.sampled_from(_FIRST))
    lines, results = [f"r0 = {first}"], [("r0", bound)]
    for k in range(1, draw(st.integers(1, 3))):
        op = draw(st.sampled_from(_SUM_LIKE))
        red = f"{op}({draw(anchored(_ANCHORED_BY_BOUND, results))})"
        if op == "sum":
            positive = red.startswith(tuple(f"sum({p}" for p in _POSITIVE)) and \
                ") * x[i]" not in red
            form = draw(st.sampled_from(_EPILOGUES + ((_LOG_EPILOGUE,) if positive else ())))
            red = form.format(s=red, r=_use(draw(st.sampled_from([n for n, _ in results]))))
        lines.append(f"r{k} = {red}")
        results.append((f"r{k}", "any"))
    last, first_bound = results[-1][0], results[0][1]
    extra = draw(st.sampled_from(["none", "vector", "selection", "element"]))
    if extra == "vector":
        lines.append(f"o = sum({draw(anchored(_VECTOR, results))})")
    elif extra == "selection":
        lines.append(f"p = {draw(st.sampled_from(_SELECTIONS)).format(r=_use('r0'))}")
    elif extra == "element" and first_bound == "max":
        lines.append("e[i] = " + draw(st.sampled_from(_ELEMENTWISE)).format(r=_use("r0"),
                                                                            s=_use(last)))
    text = "\n".join(lines)
    return _render(text, False), _render(text, True)



def cascade_inputs(rule, rng: np.random.Generator, rows: tuple, n: int, d: int) -> dict:
    """float32 inputs: x ~ N(0, 1.5) (signs both ways), y and a in [0.5, 1.5] (positive, so
    ``exp(x / a)`` stays finite), v ~ N(0, 1) rows of D features."""
    cascade, inputs = rule.cascade, {}
    for s in cascade.streams:
        shape = (*rows, n, d) if s.name in cascade.vector_inputs else (*rows, n)
        inputs[s.name] = (rng.normal(0, 1.5, shape) if s.name == "x" else
                          rng.uniform(0.5, 1.5, shape)).astype(np.float32)
    for p in cascade.params:
        inputs[p.name] = rng.uniform(0.5, 1.5, rows).astype(np.float32)
    return inputs


def sensitivity(spec: str, twin: str, inputs: dict, rows: tuple,
                rng: np.random.Generator) -> dict:
    """|twin(inputs * (1 + delta), u = +-delta) - ref(inputs)| with |delta| about
    _SENSITIVITY_ULPS float32 ulps: the error any float32 computation of this cascade, which
    rounds its inputs and every intermediate result, can be expected to have."""
    eps = _SENSITIVITY_ULPS * float(np.finfo(np.float32).eps)
    moved = {k: np.asarray(v, np.float64) * (1 + eps * rng.choice([-1.0, 1.0], np.shape(v)))
             for k, v in inputs.items()}
    moved.update({f"u{k}": eps * rng.choice([-1.0, 1.0], rows) for k in range(4)
                  if f"u{k}" in twin})
    base = redfuser.reference(spec, inputs)
    other = redfuser.reference(twin, moved)
    out, shaky = {}, np.zeros(rows, bool)  # rows where an earlier result has no stable digit
    with np.errstate(invalid="ignore"):
        for k in base:
            diff = np.abs(other[k] - base[k])
            same = (np.isnan(other[k]) == np.isnan(base[k])) & (np.isinf(other[k]) ==
                                                                  np.isinf(base[k]))
            # inf where a few ulps flip the reference itself to or from NaN/inf (the log of
            # a sum that cancels to about 0), or move it by half its own size or more (a
            # ratio over such a sum: no digit, sign or finiteness of it survives float32):
            # no float32 computation can be held to it there
            kept = same & ~(diff > 0.5 * np.abs(base[k]))
            # a later result reading an unstable one is unstable too, even where the twin,
            # which perturbs both alike, keeps it (sum(x - mean) / sum(x - mean))
            kept = kept & ~shaky.reshape(shaky.shape + (1,) * (kept.ndim - shaky.ndim))
            shaky = shaky | ~kept.reshape(rows + (-1,)).all(axis=-1)
            out[k] = np.where(kept, np.nan_to_num(diff, nan=0.0, posinf=0.0), np.inf)
    return out


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
