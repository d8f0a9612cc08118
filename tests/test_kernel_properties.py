"""Kernels for cascades nobody wrote a test for: hypothesis writes a chain of 1-3 reductions
(each later body anchored at earlier results, plus epilogues, per-element outputs and feature
vectors), ``derive`` proves it, and every variant's kernel must match the float64 oracle.

Tolerance: the kernel computes in float32, the oracle in float64 on the same (float32)
inputs.  A cascade may be ill-conditioned (``sum(x - mean)`` is all cancellation), so the
bound is taken from the problem itself: how far the float64 results move when the inputs and
every intermediate result move by a few float32 ulps (``SENSITIVITY_ULPS``; the spec's *twin*
multiplies each use of a result by a per-row 1 + u), times a safety factor, plus float32
rounding of the result (rtol 1e-4: sums over N <= 40 elements, exp/log within 1e-7).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_indices_equal, assert_matches, examples, rule_for
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import redfuser

# First-level reductions, each tagged with what its result bounds: "max" results bound x
# from above, "min" from below, "any" neither.
FIRST = (("max(x[i])", "max"), ("min(x[i])", "min"), ("sum(x[i]) / N", "any"),
         ("sum(exp(x[i]))", "any"), ("sum(x[i]**2)", "any"), ("max(abs(x[i]))", "any"),
         ("sum(tanh(x[i]) * y[i])", "any"), ("min(sigmoid(x[i]))", "any"),
         ("sum(x[i] * y[i])", "any"), ("sum(exp(x[i] / a))", "any"))
# Bodies anchored at an earlier result r, by the bound r must give.  An exponential is only
# re-anchored at a result that bounds its exponent (the online-softmax condition): at any other
# anchor the one-pass state under- or overflows float32 where the multi-pass form does not
# (``sum(exp(x - min(exp(x))))`` loses every term folded before the minimum arrives).
ANCHORED = {"any": ("(x[i] - {r})**2", "x[i] * {r}", "(x[i] - {r})**3", "y[i] * (x[i] - {r})",
                    "x[i] - {r}", "abs(x[i]) * {r}", "sin(x[i] - {r})",
                    "cos(x[i] - {r}) * y[i]"),
            "max": ("exp(x[i] - {r})", "exp(x[i] - {r}) * y[i]", "exp((x[i] - {r}) / a)",
                    "exp(x[i] - {r}) * x[i]", "pow(2, x[i] - {r})"),
            "min": ("exp({r} - x[i])", "exp({r} - x[i]) * y[i]")}
VECTOR = {"any": ("(x[i] - {r}) * v[i, :]", "v[i, :] * {r}"),
          "max": ("exp(x[i] - {r}) * v[i, :]",), "min": ("exp({r} - x[i]) * v[i, :]",)}
SUM_LIKE = ("sum", "sum", "sum", "max", "min")
EPILOGUES = ("{s}", "{s} / {r}", "{s} * {r}")
# log only of sums of positive terms: the log of a sum that cancels to about 0 is NaN or not
# by the sign of a rounding error, in float32 and float64 alike
LOG_EPILOGUE = "log({s}) + {r}"
POSITIVE = ("exp(x[i] - @", "exp((x[i] - @", "exp(@")
ELEMENTWISE = ("exp(x[i] - {r})", "(x[i] - {r}) * {s}", "x[i] / {r}")
SELECTIONS = ("max(exp(x[i] - {r}))", "argmax(x[i] - {r})", "topk(x[i] * 2 - {r}, 2)",
              "argmin(x[i])")
SENSITIVITY_ULPS = 4
SAFETY = 50
VARIANTS = ("rolling", "split", "unfused")


@st.composite
def anchored(draw, table: dict, results: list) -> str:
    """A body from ``table`` anchored at one of ``results`` [(name, bound)]."""
    name, bound = draw(st.sampled_from(results))
    options = table["any"] + (table[bound] if bound != "any" else ())
    return draw(st.sampled_from(options)).format(r=use(name))


def use(name: str) -> str:
    """A use of result ``name`` (rK), rendered by ``render``."""
    return f"@{name[1:]}"


def render(text: str, twin: bool) -> str:
    """The spec, or its twin where each use of rK is rK * (1 + uK) (uK: a per-row input)."""
    for k in range(4):
        text = text.replace(f"@{k}", f"(r{k} * (1 + u{k}))" if twin else f"r{k}")
    return text


@st.composite
def cascades(draw) -> tuple[str, str]:
    """A random chain: r0 from the streams, r1.. anchored at earlier results, maybe an
    epilogue, a vector sum, a selection or a per-element output at the end.  Returns the
    spec and its twin (see ``render``)."""
    first, bound = draw(st.sampled_from(FIRST))
    lines, results = [f"r0 = {first}"], [("r0", bound)]
    for k in range(1, draw(st.integers(1, 3))):
        op = draw(st.sampled_from(SUM_LIKE))
        red = f"{op}({draw(anchored(ANCHORED, results))})"
        if op == "sum":
            positive = red.startswith(tuple(f"sum({p}" for p in POSITIVE)) and \
                ") * x[i]" not in red
            form = draw(st.sampled_from(EPILOGUES + ((LOG_EPILOGUE,) if positive else ())))
            red = form.format(s=red, r=use(draw(st.sampled_from([n for n, _ in results]))))
        lines.append(f"r{k} = {red}")
        results.append((f"r{k}", "any"))
    last, first_bound = results[-1][0], results[0][1]
    extra = draw(st.sampled_from(["none", "vector", "selection", "element"]))
    if extra == "vector":
        lines.append(f"o = sum({draw(anchored(VECTOR, results))})")
    elif extra == "selection":
        lines.append(f"p = {draw(st.sampled_from(SELECTIONS)).format(r=use('r0'))}")
    elif extra == "element" and first_bound == "max":
        lines.append("e[i] = " + draw(st.sampled_from(ELEMENTWISE)).format(r=use("r0"),
                                                                            s=use(last)))
    text = "\n".join(lines)
    return render(text, False), render(text, True)


def make_inputs(rule, rng: np.random.Generator, rows: tuple, n: int, d: int) -> dict:
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
    SENSITIVITY_ULPS float32 ulps: the error any float32 computation of this cascade, which
    rounds its inputs and every intermediate result, can be expected to have."""
    eps = SENSITIVITY_ULPS * float(np.finfo(np.float32).eps)
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


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=examples(0.6))  # 15 cascades per variant: each one compiles a kernel
@given(specs=cascades(), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40),
       rows=st.sampled_from([(1,), (3,), (2, 2)]))
def test_generated_cascade_kernels_match_the_oracle(variant, specs, seed, n, rows):
    spec, twin = specs
    try:
        rule = rule_for(spec)
    except (redfuser.NotFusable, redfuser.SpecError):
        assume(False)  # a template combination the engine rightly refuses
    rng = np.random.default_rng(seed)
    n = max(n, 2) if "topk" in spec else n  # top-2 of one element is a documented ValueError
    inputs = make_inputs(rule, rng, rows, n, d=3)
    out = redfuser.compile(rule, variant=variant)(**inputs)
    ref = redfuser.reference(spec, inputs)
    slack = sensitivity(spec, twin, inputs, rows, rng)
    assert list(out) == list(ref)
    for name in ref:
        if ref[name].dtype.kind in "iu":
            assert_indices_equal(out[name], ref[name], name)
            continue
        stable = np.isfinite(slack[name])
        scale = np.abs(np.where(np.isfinite(ref[name]), ref[name], 0.0))
        atol = SAFETY * np.where(stable, slack[name], 0.0) + 1e-5 * (1 + scale)
        assert_matches(np.where(stable, out[name], ref[name]), ref[name], 1e-4, atol,
                       f"{spec!r} [{variant}] {name}")
