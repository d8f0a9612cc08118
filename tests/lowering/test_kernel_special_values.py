"""Generated cascades through ``compile``, fed NaN, infinities, ties and huge values, in every
variant: the kernel must put NaN, +inf and -inf exactly where the float64 oracle has them,
pick the same indices, and match it elsewhere.  The cascades and the tolerance are those of
test_kernel_properties.py (``cascades`` and ``sensitivity`` in tests/support/generated.py: the twin
moves inputs and results by a few float32 ulps; where that flips the oracle to or from
NaN/inf, or moves it by half its size, no float32 computation can be held to it).
Derandomized by default (tests/conftest.py).

Huge values (magnitudes 1e9 to 1e12: their cubes stay in float32's range; intermediates
that do not: below) are held to the oracle rounded to float32 (a result beyond 3.4e38 is an
infinity of its sign), except the indices: at r = sum(x**2) ~ 1e24 every small x - r rounds
to the same value, in float64 too, so the oracle's argmax(x - r) is the first element where
the kernel, ranking x (the proven commutation), picks the real-number argmax.

Intermediate overflow: a result that fits float32 can need an intermediate that does not,
e.g. ``r1 = sum((x[i] - r0)**2) / r0`` with ``r0 = sum(x[i]**2)`` ~ 1e25: each term is ~1e50,
so the sum the kernel holds before dividing is +inf in float32 while the oracle's r1 ~ 1e26
fits.  No float32 computation of the cascade as written can get it, so the oracle's
float64 intermediates are evaluated too (``overflowing``): the values a kernel must hold
for a reduction, whatever order it folds in, are each of its terms and, for a sum, the sum
before any epilogue.  Where one of them is finite but beyond float32's range (|v| > 3.4e38)
in a row, that reduction and every result reading it, directly or through others, may be
inf or NaN in that row; a finite value there is still held to the oracle, and so is every
other row and result.  (Partial sums beyond the range whose total fits are not allowed for:
a kernel could avoid them.  An infinite value comes from an infinite input, whose
propagation the oracle already states.)
"""

from __future__ import annotations

import ast

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import redfuser
from tests.support import (
    SAFETY,
    VARIANTS,
    assert_indices_equal,
    assert_matches,
    cascades,
    examples,
    rule_for,
    sensitivity,
)

# under the name it had when the derandomized examples were chosen: hypothesis seeds them
# from each test's source text, so renaming a call inside a test draws other examples
from tests.support import cascade_inputs as make_inputs

SPECIAL = ("nan", "inf", "ties", "huge")  # what replaces entries of x (module docstring)
SHARE = 0.2  # of the entries of the other rows: most rows hold a special value, some none
HUGE = (9, 12)  # decades of the huge magnitudes
F32_MAX = float(np.finfo(np.float32).max)


def inject(x: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """x with special values at random entries and in the whole first row (NaN, +-inf, or
    huge magnitudes of both signs), or few distinct values (ties)."""
    x = x.copy()
    if kind == "ties":
        return np.round(x).astype(np.float32)
    if kind == "huge":
        value = rng.choice([-1.0, 1.0], x.shape) * 10.0 ** rng.uniform(*HUGE, x.shape)
    else:
        value = np.float32(np.nan) if kind == "nan" else rng.choice([-np.inf, np.inf],
                                                                     x.shape)
    value = np.broadcast_to(np.asarray(value, np.float32), x.shape)
    special = rng.random(x.shape) < SHARE
    special.reshape(-1, x.shape[-1])[0] = True  # the first row is all special
    return np.where(special, value, x).astype(np.float32)


def in_float32(ref: np.ndarray) -> np.ndarray:
    """The oracle rounded to float32's range: beyond it, an infinity of its sign."""
    with np.errstate(invalid="ignore"):  # (NaN compares false: it stays)
        return np.where(np.abs(ref) > F32_MAX, np.copysign(np.inf, ref), ref)


REDUCTIONS = ("sum", "max", "min", "argmax", "argmin", "topk")  # what the cascades call


def target(stmt: ast.Assign) -> str:
    """The name a spec statement defines (``e`` for ``e[i] = ...``)."""
    node = stmt.targets[0]
    return node.value.id if isinstance(node, ast.Subscript) else node.id


def with_held(spec: str) -> tuple[str, dict[str, list[str]]]:
    """``spec`` plus, for each reduction, lines giving the values its kernel must hold in
    float32 (module docstring): its largest |term| and, for a sum, the sum itself.  Returns
    the text and {statement's name: the names of its reductions' lines}."""
    lines, held = [spec], {}
    for stmt in ast.parse(spec).body:
        names = held[target(stmt)] = []
        for call in ast.walk(stmt.value):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) in REDUCTIONS:
                body = ast.unparse(call.args[0])
                forms = [f"max(abs({body}))"] + ([f"sum({body})"] if call.func.id == "sum"
                                                 else [])
                for form in forms:
                    names.append(f"{target(stmt)}_held{len(names)}")
                    lines.append(f"{names[-1]} = {form}")
    return "\n".join(lines), held


def reads(spec: str) -> dict[str, set[str]]:
    """{statement's name: the statements it reads, directly or through others, itself
    included}."""
    out: dict[str, set[str]] = {}
    for stmt in ast.parse(spec).body:
        used = {n.id for n in ast.walk(stmt.value) if isinstance(n, ast.Name)}
        out[target(stmt)] = {target(stmt)}.union(*(out[n] for n in used if n in out))
    return out


def overflowing(spec: str, inputs: dict, rows: tuple) -> dict[str, np.ndarray]:
    """{output: per-row bool}: rows where the output reads a reduction whose float32
    intermediates provably leave float32's range (module docstring)."""
    text, held = with_held(spec)
    with np.errstate(all="ignore"):
        values = redfuser.reference(text, inputs)
    own = {}
    for name, lines in held.items():
        v = np.abs(np.concatenate([values[h].reshape(rows + (-1,)) for h in lines] +
                                  [np.zeros(rows + (0,))], axis=-1))
        own[name] = ((v > F32_MAX) & np.isfinite(v)).any(axis=-1)
    return {name: np.logical_or.reduce([own[s] for s in sources])
            for name, sources in reads(spec).items()}


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=examples(0.6))  # 15 cascades per variant: each compiles a kernel
@given(specs=cascades(), seed=st.integers(0, 2**32 - 1), n=st.integers(2, 40),
       rows=st.sampled_from([(3,), (2, 2)]), kind=st.sampled_from(SPECIAL))
def test_generated_kernels_follow_the_oracle_on_special_values(variant, specs, seed, n, rows,
                                                               kind):
    spec, twin = specs
    try:
        rule = rule_for(spec)
    except (redfuser.NotFusable, redfuser.SpecError):
        assume(False)  # a template combination the engine rightly refuses
    rng = np.random.default_rng(seed)
    inputs = make_inputs(rule, rng, rows, n, d=3)
    inputs["x"] = inject(inputs["x"], kind, rng)
    out = redfuser.compile(spec, variant=variant, tune=False)(**inputs)
    with np.errstate(all="ignore"):
        ref = redfuser.reference(spec, inputs)
        slack = sensitivity(spec, twin, inputs, rows, rng)
    over = overflowing(spec, inputs, rows)
    assert list(out) == list(ref)
    for name in ref:
        where = f"{spec!r} [{variant}, {kind}] {name}"
        if ref[name].dtype.kind in "iu":
            if kind != "huge":  # (module docstring)
                assert_indices_equal(out[name], ref[name], where)
            continue
        ref[name] = in_float32(ref[name])
        stable = np.isfinite(slack[name])
        scale = np.abs(np.where(np.isfinite(ref[name]), ref[name], 0.0))
        atol = SAFETY * np.where(stable, slack[name], 0.0) + 1e-5 * (1 + scale)
        rows_over = over[name].reshape(rows + (1,) * (out[name].ndim - len(rows)))
        held = stable & ~(rows_over & ~np.isfinite(out[name]))  # (module docstring)
        assert_matches(np.where(held, out[name], ref[name]), ref[name], 1e-4, atol, where)


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_intermediate_beyond_float32_may_overflow_where_the_result_fits(variant):
    """Found by the property test above (a fresh clone's random run, [rolling]): with
    r0 = sum(x**2) ~ 1e25 every term of r1's sum is ~1e50, so the kernel's sum is inf before
    the division while the oracle's r1 ~ 1e26 fits.  ``overflowing`` flags exactly that row:
    not r0, not a row of ordinary values, not a row whose bound is inf because its input is
    (the oracle's own infinities), and not a row whose terms come near but stay in range."""
    spec = "r0 = sum(x[i]**2)\nr1 = sum((x[i] - r0)**2) / r0"
    x = np.array([[1e12, -3e12, 2e12, 5e11], [0.5, -1.0, 2.0, 0.25], [1.0, np.inf, 2.0, 3.0],
                  [2.5e8, -5e8, 7.5e8, 3.75e8]], np.float32)  # terms' sum 4e36: in range
    over = overflowing(spec, {"x": x}, (4,))
    assert over["r0"].tolist() == [False] * 4 and over["r1"].tolist() == [True] + [False] * 3
    ref = redfuser.reference(spec, {"x": x})
    assert np.abs(ref["r1"][0]) < F32_MAX  # the result fits: only the intermediate does not
    out = redfuser.compile(spec, variant=variant, tune=False)(x=x)
    assert not np.isfinite(out["r1"][0])  # what this test allows (module docstring)
    assert_matches(out["r1"][1:], in_float32(ref["r1"][1:]), 1e-4, 0.0, "r1")


@pytest.mark.parametrize("row", [[np.inf, -np.inf], [-np.inf, np.inf], [np.inf, np.inf]])
def test_a_recomputed_sum_gets_its_anchor_factor_once(row):
    """Found by the property test above: with a non-finite final anchor the state of
    ``o = sum(v[i, :] * r0)`` is folded again, and that pass folded the whole body (v * r0)
    where the state holds v (r0 is applied at finalize): -inf * 2 * -inf came out +inf."""
    spec = "r0 = min(x[i])\nr1 = sum((x[i] - r0)**2)\no = sum(v[i, :] * r0)"
    x = np.array([row, [1.0, 2.0], [0.5, 3.0]], np.float32)
    v = np.ones((3, 2, 3), np.float32)
    out = redfuser.compile(spec, variant="rolling", tune=False)(x=x, v=v)
    with np.errstate(all="ignore"):
        ref = redfuser.reference(spec, {"x": x, "v": v})
    np.testing.assert_array_equal(out["o"], ref["o"].astype(np.float32))


@pytest.mark.parametrize("variant", ["rolling", "unfused"])
def test_a_selection_flat_at_a_finite_anchor_is_made_over_the_body(variant):
    """Found by the property test above: ``r2 = max(x * r0)`` commutes (r0 > 0 over the
    reals), but r0 = min(sigmoid(x)) is 0 in a row holding -inf, where the reference's
    max holds -inf * 0 = NaN and r0 * max(x) was 0; the kernel and ``rule.evaluate`` now
    select over the body where a factor of dF/du (r0) is 0 or not finite."""
    spec = "r0 = min(sigmoid(x[i]))\nr2 = max(x[i] * r0)"
    x = np.array([[-np.inf, -0.8, 0.5], [-np.inf, np.inf, 2.0], [-2.0, 1.0, 0.5],
                  [-800.0, 1.0, 2.0]], np.float32)  # the last: sigmoid underflows to 0
    out = redfuser.compile(spec, variant=variant, tune=False)(x=x)
    with np.errstate(all="ignore"):
        ref = redfuser.reference(spec, {"x": x})
        evaluated = redfuser.derive(spec).evaluate({"x": x})
    assert np.isnan(ref["r2"][:2]).all() and np.isfinite(ref["r2"][2:]).all()
    for got in (out["r2"], evaluated["r2"]):
        assert_matches(got, ref["r2"], 1e-6, 1e-6, "r2")


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_reselected_top_k_list_takes_a_minus_inf_after_a_nan(variant):
    """Found by the property test above once it moved to tests/lowering/ (other derandomized
    examples): where r0 = inf the top-k list is selected again over 2x - r0 = [NaN, -inf,
    -inf]; its empty slots held 0, which ranks before -inf, so the second slot stayed
    empty and read the row at the index sentinel (NaN instead of -inf)."""
    spec = "r0 = max(x[i])\np = topk(x[i] * 2 - r0, 2)"
    inf = np.inf
    x = np.array([[inf, -1.0, -inf], [inf, -inf, inf], [inf, -inf, -inf], [-1.0, inf, -inf]],
                 np.float32)
    out = redfuser.compile(spec, variant=variant, tune=False)(x=x)
    with np.errstate(all="ignore"):
        ref = redfuser.reference(spec, {"x": x})
    assert ref["p"][0].tolist()[1] == -inf  # the case itself, as the oracle states it
    assert_matches(out["p"], ref["p"], 0, 0, "p")
