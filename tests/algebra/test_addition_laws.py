"""Addition laws (``algebra.separate.ADDITION_LAWS``) and coinciding Taylor columns: what is
derived, that it is proven, and that the one-pass rule (``evaluate``, any chunking and merge
tree) and its kernels match the float64 oracle.

Regression tests of the repros ``misleading_reasons.py`` (sin(x - m), cos(x - m) rank 2,
2**(x - m) rank 1) and ``derive_incomplete.py`` (two anchors whose top Taylor coefficients
are both 1).

Tolerances (float32 eps = 1.19e-7, N <= 12, |x| <= 8 for waves):

* Waves: an element adds sin(x - m') with x - m' rounded (error <= eps * max|x - m'| <=
  2 eps max|x|) plus sin's own rounding (eps); each time the anchor moves the state (norm <= n)
  is rotated by cos/sin of a rounded shift (error <= n * (2 eps max|x| + 2 eps)), at most N
  times.  So ``WAVE_ATOL = N * (N + 1) * eps * (2 + 2 max|x|)`` (at most 1.4e-3 for N = 12,
  |x| <= 8; the errors seen are ~1e-6).  Waves of huge arguments are not compared: float32
  x - m then rounds by more than 2 pi, in the reference's own float32 inputs too.
* 2**(x - m) is exp((x - m) log 2): a sum of positive terms as softmax's d, RTOL 1e-4.
* Polynomial blocks (squared deviations): cancellation is relative to the data's scale,
  ``1e-5 * N * (1 + 2 max|x|)**2``.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from hypothesis import given
from hypothesis import strategies as st

import redfuser
from algebra.addition import ADDITION_LAWS, MAX_WAVE_DEGREE
from algebra.components import LinearComponent
from redfuser.lowering.texpr import to_tir
from redfuser.tvm.cuda import nvcc_compile
from redfuser.tvm.ir import tirx
from tests.support import (
    EPS32,
    VARIANTS,
    assert_matches,
    finite_max_abs,
    float32_streams,
    needs_nvcc,
    row_shapes,
    rule_for,
    schedules,
    stream_lengths,
    streamed_case,
)

RTOL = 1e-4
NEG_INF = -np.inf
SIN = "m = max(x[i]); s = sum(sin(x[i] - m))"
COS = "m = max(x[i]); c = sum(cos(x[i] - m))"
POW2 = "m = max(x[i]); s = sum(pow(2, x[i] - m))"
WAVES = (SIN, COS,
         "m = max(x[i]); mu = sum(x[i]) / N; s = sum(cos(x[i] - m - mu) * (x[i] - mu))",
         "m = max(x[i]); c = min(x[i]); s = sum(sin(x[i] - m) * cos(x[i] - c))",
         "m = max(x[i]); s = sum(sin(x[i] - m)**3 + exp(x[i] - m) * cos(x[i] - m))",
         "m = max(x[i]); s = sum(where(x[i] > 0, sin(2 * (x[i] - m)), 0))")
COINCIDING = ("m = max(x[i]); c = sum(x[i]); d = sum((x[i] - m)**2 + c)",
              "m = max(x[i]); mu = sum(x[i] - m) / N; v = sum((x[i] - m - mu)**2) / N",
              "a = sum(x[i]) / N; b = max(y[i]); v = sum((x[i] - a - b)**2)")


def _last(rule) -> LinearComponent:
    return rule.components[-1]


def run_both(spec: str, inputs: dict, chunks, tree):
    fused = rule_for(spec).evaluate(inputs, chunks=chunks, tree=tree)
    return fused, redfuser.reference(spec, inputs)


def wave_atol(x: np.ndarray) -> np.ndarray:
    n = x.shape[-1]
    return n * (n + 1) * EPS32 * (2 + 2 * finite_max_abs(x, axis=-1))


# -- what is derived ---------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "partner"), [(SIN, "cos(m - x)"), (COS, "sin(m - x)")])
def test_a_wave_rotates_with_its_partner(spec, partner):
    rule = redfuser.derive(spec)
    comp = _last(rule)
    assert comp.matrix.shape == (2, 2) and partner in str(comp.basis[1])
    m, m1 = sp.Symbol("m", real=True), sp.Symbol("m'", real=True)
    shift = m - m1
    entries = {sp.simplify(v) for v in comp.matrix}
    assert {sp.cos(shift), sp.sin(shift), -sp.sin(shift)} <= entries  # a rotation by m - m'
    assert ADDITION_LAWS[sp.sin if "sin" in spec else sp.cos].identity in comp.case
    assert all(rule.status) and rule.verify()


def test_a_constant_base_power_is_rank_one_like_exp():
    comp = _last(redfuser.derive(POW2))
    assert comp.matrix.shape == (1, 1) and "rank-1 re-anchoring" in comp.case
    assert comp.matrix[0, 0].has(sp.exp) and comp.matrix[0, 0].has(sp.log(2))


@pytest.mark.parametrize("spec", COINCIDING)
def test_coinciding_taylor_columns_share_one_column(spec):
    rule = redfuser.derive(spec)
    comp = _last(rule)
    assert len(set(comp.basis)) == len(comp.basis), comp.basis
    assert list(comp.basis).count(1) == 1  # the count, once (both top coefficients are 1)
    assert all(rule.status) and rule.verify()


@pytest.mark.parametrize(("spec", "culprit", "why"), [
    ("m = max(x[i]); s = sum(sin(x[i] * m))", "sin(m*x)", "does not split into a stream part"),
    ("m = max(x[i]); s = sum(cos(exp(x[i] - m)))", "cos(exp(-m + x))", "does not split"),
    ("m = max(x[i]); s = sum(pow(-2, x[i] - m))", "(-2)**(-m + x)", "negative number"),
    ("m = max(x[i]); s = sum(expm1(x[i] - m))", "expm1(-m + x)", "exp(e) - 1, a rank-2 form"),
    ("m = max(x[i]); s = sum(sin(x[i] - m)**9)", f"sin(m - x)**{MAX_WAVE_DEGREE + 1}",
     f"limit of {MAX_WAVE_DEGREE} waves"),
    ("m = max(x[i]); s = sum(tanh(x[i] - m))", "tanh(m - x)", "no finite-rank"),
])
def test_what_stays_refused_says_why_truly(spec, culprit, why):
    with pytest.raises(redfuser.NotFusable) as err:
        redfuser.derive(spec)
    assert f"`{culprit}`" in str(err.value) and why in str(err.value)


# -- against the oracle: random chunkings and merge trees ------------------------------------

@given(streamed_case(kinds=("normal", "grid", "ties"), inject=NEG_INF), st.sampled_from(WAVES))
def test_waves_match_the_reference(case, spec):
    x, chunks, tree = case
    fused, ref = run_both(spec, {"x": x}, chunks, tree)
    name = rule_for(spec).outputs[-1]
    scale = 1 + finite_max_abs(x, axis=-1)  # (x - mu) factors and exp(x - m) <= 1
    assert_matches(fused[name], ref[name], RTOL, wave_atol(x) * scale, name)


@given(streamed_case(inject=NEG_INF))
def test_constant_base_power_matches_the_reference(case):
    x, chunks, tree = case
    fused, ref = run_both(POW2, {"x": x}, chunks, tree)
    assert_matches(fused["s"], ref["s"], RTOL, 0, "s")  # s in [1, N] where finite


@st.composite
def two_streams(draw):
    rows, n = draw(row_shapes()), draw(stream_lengths())
    kinds = ("normal", "grid", "ties")
    x, y = (draw(float32_streams(rows + (n,), kinds=kinds)) for _ in range(2))
    return x, y, *draw(schedules(n))


@given(two_streams(), st.sampled_from(COINCIDING))
def test_coinciding_columns_match_the_reference(case, spec):
    x, y, chunks, tree = case
    inputs = {"x": x, "y": y} if "y[i]" in spec else {"x": x}
    fused, ref = run_both(spec, inputs, chunks, tree)
    name = rule_for(spec).outputs[-1]
    scale = 1 + 2 * np.maximum(finite_max_abs(x, axis=-1), finite_max_abs(y, axis=-1))
    assert_matches(fused[name], ref[name], RTOL, 1e-5 * x.shape[-1] * scale ** 2, name)


# -- kernels ---------------------------------------------------------------------------------

# every spec fused; the split and unfused nests (their own code paths) on the basic laws
KERNEL_CASES = [(spec, "rolling") for spec in (*WAVES, POW2, *COINCIDING)] + [
    (spec, variant) for spec in (SIN, COS, POW2, COINCIDING[0])
    for variant in VARIANTS[1:]]


@pytest.mark.parametrize(("spec", "variant"), KERNEL_CASES)
def test_kernels_match_the_reference(spec, variant):
    rng = np.random.default_rng(7)
    x = (rng.normal(size=(4, 45)) * 3).astype(np.float32)
    if spec not in COINCIDING:  # (their inf semantics are the settle rule's, tested elsewhere)
        x[0, :3] = -np.inf  # a stream starting with -inf: NaN for waves, as in the reference
    x[1, ::5] = x[1, 0]  # ties
    inputs = {"x": x, "y": rng.normal(size=(4, 45)).astype(np.float32)}
    inputs = {k: v for k, v in inputs.items() if f"{k}[i]" in spec}
    out = redfuser.compile(spec, variant=variant)(**inputs)
    ref = redfuser.reference(spec, inputs)
    for name in ref:
        scale = 1 + 2 * finite_max_abs(x, axis=-1)
        assert_matches(out[name], ref[name], RTOL, 1e-5 * x.shape[-1] * scale ** 2, name)


# -- powers with a non-constant exponent ---------------------------------------------------

def test_texpr_lowers_a_power_with_an_expression_exponent():
    x, n = sp.symbols("x n")
    vx, vn = tirx.Var("vx", "float32"), tirx.Var("vn", "float32")
    out = to_tir(x ** n, lambda s: {"x": vx, "n": vn}[s.name], fast_math=False)
    assert "pow" in str(out) and "vn" in str(out)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("spec", "exponent"), [
    ("s = sum(x[i]) / N; p = prod(x[i] / s)", "n"),  # finalize p / s**n: the running count
    ("s = sum(x[i]); r = s ** (N / 2)", "n/2"),
    ("s = sum(x[i]); r = 2 ** s", "s"),
])
def test_count_in_a_finalize_exponent_lowers(spec, exponent, variant):
    rule = redfuser.derive(spec)
    assert any(exponent in str(v) for _, v in rule.finalize_lines())
    x = np.random.default_rng(3).uniform(0.5, 1.5, size=(3, 11)).astype(np.float32)
    out = redfuser.compile(spec, variant=variant)(x=x)
    ref = redfuser.reference(spec, {"x": x})
    for name in ref:
        # a power of a float32 sum: relative error ~ |exponent| * N * eps, exponent <= 17
        assert_matches(out[name], ref[name], 17 * 11 * 4 * EPS32, 0, name)


@needs_nvcc
@pytest.mark.parametrize("spec", [SIN, POW2, "s = sum(x[i]) / N; p = prod(x[i] / s)"])
def test_cuda_source_of_the_new_laws_compiles_for_sm90(spec):
    kernel = redfuser.compile(spec, target="cuda")
    kernel.prepare(x=np.ones((4, 300), np.float32))
    assert b".target sm_90" in nvcc_compile(kernel.cuda_source(), arch="sm_90")
