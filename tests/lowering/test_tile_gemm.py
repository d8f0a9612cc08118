"""Matrix products on AMX-BF16 tiles (``lowering.cpu.tile_dots``, ``tile_gemm``): when they
apply (each condition with a case that fails it), and the kernels against the float64
oracle, in bfloat16 units of the last place, at shapes with every tail (rows, K and D not
multiples of the tiles) and with special values."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import redfuser
from redfuser.lowering import CpuPlan, shape_geometry
from redfuser.lowering.cpu.tile_dots import CONDITIONS, TILE_DOTS, host_tile_dot, refusal
from redfuser.lowering.products import products
from redfuser.tune.space import plan_from_params, plan_params
from redfuser.tvm.target import cpu_has, host_target
from tests.support.precision import assert_one_ulp, oracle

BF16 = ml_dtypes.bfloat16
AMX_BF16 = TILE_DOTS[0]
HOST_HAS = cpu_has(host_target(), AMX_BF16.feature)
RULE = redfuser.derive("rmsnorm_gemm")


def _geometry(m: int, k: int, n: int, dtypes: dict, compute: str = "float32"):
    geo = shape_geometry(RULE, {"x": (m, k), "w": (k, n)})
    inputs = {name: dataclasses.replace(g, dtype=dtypes.get(name, g.dtype))
              for name, g in geo.inputs.items()}
    return dataclasses.replace(geo, inputs=inputs, compute=compute)


@pytest.mark.parametrize(("dtypes", "compute", "reason"), [
    ({"x": "bfloat16", "w": "bfloat16"}, "float64", CONDITIONS[0][1]),
    ({"x": "bfloat16", "w": "float32"}, "float32", CONDITIONS[1][1]),
    ({"x": "float32", "w": "bfloat16"}, "float32", CONDITIONS[2][1]),
    ({"x": "float16", "w": "bfloat16"}, "float32", CONDITIONS[2][1]),
])
def test_each_condition_refuses_a_product_that_fails_it(dtypes, compute, reason):
    geo = _geometry(64, 256, 64, dtypes, compute)
    (p,) = products(RULE, geo)
    assert refusal(p, geo, AMX_BF16) == reason
    assert host_tile_dot(RULE, geo) is None


def test_bfloat16_operands_as_stored_meet_every_condition():
    geo = _geometry(64, 256, 64, {"x": "bfloat16", "w": "bfloat16"})
    (p,) = products(RULE, geo)
    assert refusal(p, geo, AMX_BF16) is None
    assert (host_tile_dot(RULE, geo) is AMX_BF16) == HOST_HAS


def test_the_unfused_baseline_stays_on_the_float32_kernel():
    """Its A operand is x / r, which bfloat16 cannot hold exactly."""
    kernel = redfuser.compile("rmsnorm_gemm", variant="unfused", tune=False)
    x, w = (np.ones(s, BF16) for s in ((64, 256), (256, 64)))
    kernel(x=x, w=w, eps=1e-6)
    assert kernel.plan.mr and not kernel.plan.tile_dot


def test_a_tile_plan_survives_a_tuning_record_and_a_bad_name_is_refused():
    plan = CpuPlan("rolling", 16, mr=32, nr=32, kc=256, nc=64, mc=64, nt=1,
                   tile_dot=AMX_BF16.name)
    assert plan_from_params(plan_params(plan)) == dataclasses.replace(plan, reason="")
    with pytest.raises(ValueError, match="tile_dot must be one of"):
        plan_from_params({**plan_params(plan), "tile_dot": "amx-fp8"})
    with pytest.raises(ValueError, match="tile_dot must be a name"):
        plan_from_params({**plan_params(plan), "tile_dot": 1})


def _inputs(m: int, k: int, n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((m, k)).astype(BF16),
            "w": (rng.standard_normal((k, n)) / np.sqrt(k)).astype(BF16), "eps": 1e-6}


needs_host = pytest.mark.skipif(not HOST_HAS, reason="the host has no AMX-BF16 for this "
                                "process (the CI machine has)")


@needs_host
@pytest.mark.parametrize("shape", [(32, 256, 32), (33, 700, 70), (70, 300, 40),
                                   (64, 512, 48), (96, 1000, 130)])
def test_the_tiles_give_the_oracle_within_one_bfloat16_ulp(shape):
    inputs = _inputs(*shape)
    kernel = redfuser.compile("rmsnorm_gemm", tune=False)
    got = kernel(**inputs)
    assert kernel.plan.tile_dot == AMX_BF16.name
    want = oracle("rmsnorm_gemm", inputs)
    assert got["y"].dtype == BF16
    assert_one_ulp(got["y"], want["y"], BF16, f"y at {shape}")
    np.testing.assert_allclose(got["r"], want["r"], rtol=2e-6)  # float32: a statistic


@needs_host
def test_special_values_follow_the_oracle():
    """inf and NaN in a row, a zero row (r = sqrt(eps)) and a weight column of 1e30 (its
    sums stay below float32's overflow, which the float32 compute shares with the register
    kernel): the tiles add products in float32, so an inf meets a zero as NaN."""
    inputs = _inputs(64, 300, 40, seed=1)
    x, w = inputs["x"].copy(), inputs["w"].copy()
    x[3, 7], x[5, 0], x[9, :] = np.inf, np.nan, 0
    w[:, 11] = BF16(1e30)
    inputs.update(x=x, w=w)
    kernel = redfuser.compile("rmsnorm_gemm", tune=False)
    got = kernel(**inputs)
    assert kernel.plan.tile_dot == AMX_BF16.name
    want = oracle("rmsnorm_gemm", inputs)
    assert_one_ulp(got["y"], want["y"], BF16, "y with special values")


def test_a_plan_asking_for_tiles_on_float32_operands_is_refused_by_name():
    x = np.ones((64, 256), np.float32)
    w = np.ones((256, 64), np.float32)
    plan = CpuPlan("rolling", 16, mr=32, nr=32, kc=256, nc=64, mc=64, nt=1,
                   tile_dot=AMX_BF16.name)
    with pytest.raises(ValueError, match="may not run on amx-bf16 tiles: the shared matrix"):
        redfuser.compile("rmsnorm_gemm", plan=plan, tune=False)(x=x, w=w, eps=1e-6)


GAMMA = "r = sqrt(sum(x[i]**2) / N + eps)\ny = sum(x[i] * g[i] / r * w[i, :])"
THREE = "r = sqrt(sum(x[i]**2) / N + eps)\ny = sum(x[i] * g[i] * h[i] / r * w[i, :])"


def _gamma_inputs(m: int, k: int, n: int, seed: int = 2) -> dict:
    """Positive terms: a sum that cancels is ill-conditioned, its float32 error (any
    kernel's) no longer below the output's unit."""
    rng = np.random.default_rng(seed)
    return {"x": rng.uniform(0.1, 2.0, (m, k)).astype(BF16),
            "w": (rng.uniform(0.5, 1.5, (k, n)) / k).astype(BF16), "eps": 1e-6,
            "g": rng.uniform(0.5, 1.5, k).astype(BF16)}


def test_a_product_of_three_inputs_is_refused_with_its_reason():
    rule = redfuser.derive(THREE)
    geo = shape_geometry(rule, {"x": (64, 256), "w": (256, 64), "g": (256,), "h": (256,)})
    inputs = {k: dataclasses.replace(g, dtype="bfloat16") for k, g in geo.inputs.items()
              if k != "eps"}
    geo = dataclasses.replace(geo, inputs={**geo.inputs, **inputs})
    (p,) = products(rule, geo)
    assert refusal(p, geo, AMX_BF16) == CONDITIONS[3][1]


@needs_host
@pytest.mark.parametrize("shape", [(33, 700, 70), (256, 1024, 256)])
def test_a_weight_per_element_runs_as_two_exact_bfloat16_terms(shape):
    """a = x * g has 16 significant bits: hi (its bfloat16 rounding) + lo (the rest) hold it
    exactly, so two tile passes give the float32 kernel's result."""
    inputs = _gamma_inputs(*shape)
    kernel = redfuser.compile(GAMMA, tune=False)
    got = kernel(**inputs)
    assert kernel.plan.tile_dot == AMX_BF16.name
    assert_one_ulp(got["y"], oracle(GAMMA, inputs)["y"], BF16, f"y at {shape}")


@needs_host
def test_split_terms_keep_infinities_nans_and_products_past_bfloat16s_range():
    """x * g = inf, NaN, or 1.4140625**2 * 2**127 (finite in float32, inf rounded to
    bfloat16: the whole product goes into hi, whose rest would be NaN), and a product below
    float32's normal range."""
    inputs = _gamma_inputs(40, 300, 40, seed=3)
    x, g = inputs["x"].copy(), inputs["g"].copy()
    x[1, 5], x[2, 6], x[4, 9], g[9] = np.inf, np.nan, BF16(1.4140625 * 2.0**63), \
        BF16(1.4140625 * 2.0**64)
    assert np.isinf(BF16(np.float32(x[4, 9]) * np.float32(g[9])))
    x[7, 20], g[20] = BF16(1e-20), BF16(1e-20)  # a product below float32's normal range
    inputs.update(x=x, g=g)
    kernel = redfuser.compile(GAMMA, tune=False)
    got = kernel(**inputs)
    assert kernel.plan.tile_dot == AMX_BF16.name
    want = oracle(GAMMA, inputs)
    float32_kernel = redfuser.compile(GAMMA, tune=False, variant="unfused")(**inputs)
    assert_one_ulp(got["y"], want["y"], BF16, "y with special products")
    assert_one_ulp(float32_kernel["y"], want["y"], BF16, "the float32 kernel, for comparison")
