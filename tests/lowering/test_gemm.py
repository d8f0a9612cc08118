"""Matrix products as a blocked GEMM (``lowering.products``, ``lowering.cpu.gemm``).

Property tests: every GEMM-blocked kernel (fused and unfused, the policy's blocking and
random ones small enough that every tail shows: row blocks and micro-kernels that do not
divide the rows, K pieces that do not divide N, panels and column blocks that do not divide
D) must match the float64 oracle; the split variant of the same cascades too.

Tolerance: a float32 sum of n products is within about n * eps32 of the sum of their
magnitudes (recursive summation, Higham's gamma_n; blocked sums do no worse), so each output
is held to ``(2 n + 16) * eps32 * M`` where M is the output's *magnitude*: the same cascade
with every summed term taken in absolute value (the "+ 16" covers the few roundings of the
finalize: 1/r, 1/d, sqrt), plus rtol 1e-5.  An indexing error is off by O(M).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import redfuser
from redfuser.lowering import choose, shape_geometry
from redfuser.lowering.cpu.plan import GEMM, LANES, gemm_blocks, gemm_plan
from redfuser.lowering.products import products, why_not
from redfuser.tune import describe, plan_from_params, plan_params, space
from tests.support import EPS32, assert_indices_equal, assert_matches, examples, rule_for

# (spec, its magnitude: every summed term in absolute value)
CASCADES = (
    ("r = sqrt(sum(x[i]**2) / N + eps)\ny = sum(x[i] / r * w[i, :])",
     "r = sqrt(sum(x[i]**2) / N + eps)\ny = sum(abs(x[i] / r * w[i, :]))"),
    ("y = sum(x[i] * w[i, :])", "y = sum(abs(x[i] * w[i, :]))"),
    ("y = sum(tanh(x[i]) * w[i, :]) / N", "y = sum(abs(tanh(x[i]) * w[i, :])) / N"),
    ("m = max(x[i])\nd = sum(exp(x[i] - m))\ny = sum(x[i] * w[i, :]) / d",
     "m = max(x[i])\nd = sum(exp(x[i] - m))\ny = sum(abs(x[i] * w[i, :])) / d"),
    ("mean = sum(x[i]) / N\nvar = sum((x[i] - mean)**2) / N\n"
     "y = sum(x[i] * g[i] * w[i, :]) / sqrt(var + eps)",
     "mean = sum(abs(x[i])) / N\nmu = sum(x[i]) / N\nvar = sum((x[i] - mu)**2) / N\n"
     "y = sum(abs(x[i] * g[i] * w[i, :])) / sqrt(var + eps)"),
    ("t = argmax(x[i])\ny = sum(x[i] * w[i, :])\nz = sum(exp(x[i]) * w[i, :])",
     "y = sum(abs(x[i] * w[i, :]))\nz = sum(abs(exp(x[i]) * w[i, :]))"),
    ("r = sqrt(sum(x[i]**2) / N + eps)\ny = sum(x[i] / r * w[i, :])\ne[i] = x[i] / r",
     "r = sqrt(sum(x[i]**2) / N + eps)\ny = sum(abs(x[i] / r * w[i, :]))\n"
     "e[i] = abs(x[i] / r)"),
)
SPECIAL = (np.inf, -np.inf, np.nan, 0.0, 3e15)  # 3e15**2 = 9e30 stays finite in float32


def make_inputs(spec: str, rng: np.random.Generator, rows: tuple, n: int, d: int,
                special: bool) -> dict:
    """x ~ N(0, 1.5) per row (a few entries special), g in [0.5, 1.5] per row, one weight
    matrix w (n, d) ~ N(0, 1/n) shared by every row, eps in [1e-6, 1e-3]."""
    rule = rule_for(spec)
    x = rng.normal(0, 1.5, (*rows, n))
    if special:
        flat = x.reshape(-1)
        spots = rng.choice(flat.size, size=min(3, flat.size), replace=False)
        flat[spots] = rng.choice(SPECIAL, size=spots.size)
    inputs = {"x": x.astype(np.float32),
              "w": (rng.normal(size=(n, d)) / np.sqrt(n)).astype(np.float32)}
    if "g" in {s.name for s in rule.cascade.streams}:
        inputs["g"] = rng.uniform(0.5, 1.5, (*rows, n)).astype(np.float32)
    if "eps" in {p.name for p in rule.cascade.params}:
        inputs["eps"] = float(rng.uniform(1e-6, 1e-3))
    return inputs


def check(out: dict, spec: str, magnitude: str, inputs: dict, n: int, what: str):
    ref, mag = redfuser.reference(spec, inputs), redfuser.reference(magnitude, inputs)
    assert list(out) == list(ref)
    for name in ref:
        if ref[name].dtype.kind in "iu":
            assert_indices_equal(out[name], ref[name], f"{what} {name}")
            continue
        scale = np.nan_to_num(np.abs(mag.get(name, ref[name])), nan=0.0, posinf=0.0)
        assert_matches(out[name], ref[name], 1e-5, (2 * n + 16) * EPS32 * scale,
                       f"{what} {name}")


@st.composite
def blockings(draw) -> dict:
    """Blocks small enough that small shapes have several of each, and tails everywhere."""
    mr = draw(st.integers(1, 8))
    nr = draw(st.sampled_from([16, 32, 64]))
    return {"mr": mr, "nr": nr, "kc": draw(st.integers(1, 300)),
            "nc": nr * draw(st.integers(1, 3)), "mc": mr * draw(st.integers(1, 5)),
            "nt": draw(st.integers(1, 3))}


@settings(max_examples=examples(0.8))  # each example compiles a kernel (~0.3 s)
@given(case=st.sampled_from(CASCADES), blocks=blockings(),
       variant=st.sampled_from(["rolling", "unfused"]), seed=st.integers(0, 2**32 - 1),
       rows=st.sampled_from([(1,), (5,), (7,), (13,), (2, 5), (37,)]),
       n=st.integers(1, 600), d=st.integers(1, 150), special=st.booleans())
def test_blocked_gemm_matches_the_oracle(case, blocks, variant, seed, rows, n, d, special):
    spec, magnitude = case
    rng = np.random.default_rng(seed)
    # the variance fold itself (every variant, GEMM or not) turns [inf, inf] into var = inf
    # where the reference has NaN: a known issue of that fold, not of the blocked product
    special = special and "var" not in spec
    inputs = make_inputs(spec, rng, rows, n, d, special)
    rule = rule_for(spec)
    geo = redfuser.compile(rule).geometry(**inputs)
    plan = gemm_plan(rule, geo, variant, True, blocks)
    out = redfuser.compile(rule, plan=plan)(**inputs)
    check(out, spec, magnitude, inputs, n, f"{spec!r} {plan}")


@pytest.mark.parametrize("variant", [None, "unfused", "split"])
@pytest.mark.parametrize("case", CASCADES[:1] + CASCADES[3:5])
def test_policy_plans_match_the_oracle(case, variant):
    """The hand-written policy's plan (rows that do not divide the threads, D not a multiple
    of 16, N not a multiple of KC) for fused, unfused and split kernels."""
    spec, magnitude = case
    inputs = make_inputs(spec, np.random.default_rng(3), (19,), 300, 70, special=False)
    kernel = redfuser.compile(spec, variant=variant)
    out = kernel(**inputs)
    assert (kernel.plan.mr > 0) == (variant != "split"), kernel.plan
    check(out, spec, magnitude, inputs, 300, f"{spec!r} {kernel.plan}")


def test_rmsnorm_gemm_plan_blocks_the_bench_shape():
    """256 x 4096 -> 4096 (the bench row) gets the GEMM table's blocking; with few rows and
    a large W the two threads split the columns (W packed once, x read twice) rather than
    the rows (W packed twice); many rows split the rows.  A small weight matrix keeps the
    row-at-a-time plan."""
    rule = redfuser.derive("rmsnorm_gemm")
    geo = shape_geometry(rule, {"x": (256, 4096), "w": (4096, 4096)})
    plan = choose(rule, geo, threads=2)
    assert (plan.mr, plan.nr, plan.kc) == tuple(GEMM[k][0] for k in ("mr", "nr", "kc"))
    assert plan.nc == GEMM["nc"][0] // plan.nr * plan.nr  # whole panels
    assert plan.mc % plan.mr == 0 and plan.mc >= 256 and plan.nt == 2
    many = choose(rule, shape_geometry(rule, {"x": (4096, 512), "w": (512, 256)}), threads=2)
    assert many.nt == 1 and many.mc <= 256 + many.mr
    assert plan.lanes > 1, "the sum(x**2) beside the GEMM folds in vector lanes"
    assert f"GEMM micro-kernel {plan.mr} x {plan.nr}" in str(plan)
    small = shape_geometry(rule, {"x": (256, 64), "w": (64, 8)})
    assert gemm_blocks(rule, small, 2) is None and choose(rule, small).mr == 0


def test_products_are_found_from_the_structure():
    """A product needs one shared feature-axis stream as a factor; attention (re-anchored),
    a per-row value stream (softmin_average) and a cascade without one have none."""
    rule = redfuser.derive("rmsnorm_gemm")
    shared = shape_geometry(rule, {"x": (8, 64), "w": (64, 32)})
    assert [(p.state, p.weight, str(p.row_factor)) for p in products(rule, shared)] == \
        [("y", "w", "x")]
    per_row = shape_geometry(rule, {"x": (8, 64), "w": (8, 64, 32)})
    assert products(rule, per_row) == ()
    assert "shared by every row" in why_not(rule.components[1], per_row)
    att = redfuser.derive("attention")
    geo = shape_geometry(att, {"q": (2, 4, 16), "k": (2, 1, 64, 16), "v": (2, 1, 64, 16)})
    assert products(att, geo) == ()
    assert why_not(att.components[-1], geo) == "its state is re-anchored during the pass"
    soft = redfuser.derive("softmin_average")
    assert products(soft, shape_geometry(soft, {"x": (4, 64), "v": (4, 64, 16)})) == ()


def test_a_product_read_by_a_later_anchor_stays_on_the_rolling_path():
    """``m = sum((x[i] - y)**2 * w[i, :])`` is anchored at the product y, so it needs y's
    running value mid-pass, which a blocked GEMM only has at the end: no GEMM."""
    rule = redfuser.derive("y = sum(x[i] * w[i, :])\nm = sum((x[i] - y)**2 * w[i, :])")
    geo = shape_geometry(rule, {"x": (8, 64), "w": (64, 32)})
    assert why_not(rule.components[0], geo) is None and products(rule, geo) == ()


def test_an_empty_stream_is_no_product():
    """(shape_geometry refuses N = 0 as a tuning shape: the empty geometry is made here.)"""
    rule = redfuser.derive("y = sum(x[i] * w[i, :])")
    geo = dataclasses.replace(shape_geometry(rule, {"x": (8, 4), "w": (4, 32)}), n=0)
    assert products(rule, geo) == () and why_not(rule.components[0], geo) == \
        "the stream is empty"


def test_unfused_baseline_has_the_same_micro_kernel():
    """The unfused baseline's product pass is the same blocked GEMM (same scheduling
    quality): its plan carries the same blocking."""
    rule = redfuser.derive("rmsnorm_gemm")
    geo = shape_geometry(rule, {"x": (64, 512), "w": (512, 256)})
    fused, unfused = choose(rule, geo, threads=2), choose(rule, geo, "unfused", threads=2)
    assert dataclasses.replace(unfused, variant="rolling", reason="") == \
        dataclasses.replace(fused, reason="")


def test_the_schedule_space_searches_the_blocking_and_every_value_builds():
    """The tuner's space has mr, nr, kc for a rule with products; every value (a covering
    set of candidates) builds and matches the oracle; a GEMM plan survives the database's
    round trip and a plan without one shows no GEMM fields."""
    spec, magnitude = CASCADES[0]
    rule = rule_for(spec)
    inputs = make_inputs(spec, np.random.default_rng(5), (13,), 300, 70, special=False)
    geo = redfuser.compile(rule).geometry(**inputs)
    s = space(rule, geo)
    names = [p.name for p in s.variants["rolling"]]
    assert {"mr", "nr", "kc"} <= set(names) and "row_block" not in names
    gemm = [p for p in s.candidates() if p.mr]
    assert gemm and all(p.mr * p.nr // 16 + p.nr // 16 + 1 <= 32 for p in gemm)
    values = {(k, getattr(p, k)) for p in gemm for k in ("mr", "nr", "kc", "variant")}
    chosen = []
    while values:  # greedy cover: each next plan brings the most values not used yet
        best = max(gemm, key=lambda p: len(values & {(k, getattr(p, k)) for k in
                                                     ("mr", "nr", "kc", "variant")}))
        values -= {(k, getattr(best, k)) for k in ("mr", "nr", "kc", "variant")}
        chosen.append(best)
    for plan in chosen:
        check(redfuser.compile(rule, plan=plan)(**inputs), spec, magnitude, inputs, 300,
              str(plan))
    assert plan_from_params(plan_params(chosen[0])) == dataclasses.replace(chosen[0],
                                                                           reason="")
    assert all(s.why_not(p) is None for p in chosen)  # a tuned record of it would be used
    spilling = dataclasses.replace(chosen[0], mr=8, nr=4 * LANES)  # 32 sums + 4 > any ISA's
    assert "mr=8" not in (s.why_not(spilling) or "") and "registers" in s.why_not(spilling)
    assert "mr=" not in describe(choose(rule_for("softmax"),
                                        shape_geometry(rule_for("softmax"), {"x": (4, 64)})))
