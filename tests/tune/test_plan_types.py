"""Each target's plan is its own type (``Backend.plan_type``): its policies return it, a
field of another target is a TypeError, and tuning records are read and written through
it.  Databases written before the split hold every field of the single flat plan: a
foreign field at the value that target's old plans held loads (and is dropped), any other
value is refused with a message that names it."""

from __future__ import annotations

import dataclasses

import pytest

import redfuser
from redfuser.lowering import BACKENDS, CpuPlan, CudaPlan, backend, choose, shape_geometry
from redfuser.tune import TuningDB, entry_key, machine_id, plan_from_params, plan_params
from redfuser.tune.db import merge_entries, record_problem
from redfuser.tune.search import describe, record_plan, tuned_plan
from tests.support import rule_for

# what every record of the flat plan held for the fields a target's type now lacks
FLAT_DEFAULTS = {"threads": 1, "tile": 1, "row_block": 1, "mr": 0, "nr": 0, "kc": 0,
                 "nc": 0, "mc": 0, "nt": 0}
SHAPES = {"softmax": {"x": (64, 1024)}, "rmsnorm_gemm": {"x": (256, 512), "w": (512, 256)},
          "logsumexp": {"x": (2, 65536)}}


def _geo(name: str):
    rule = rule_for(name)
    return rule, shape_geometry(rule, SHAPES[name])


def _variants(name: str) -> tuple:
    """The variants every target builds for ``name`` (CUDA splits no matrix product)."""
    return (None, "unfused") if name == "rmsnorm_gemm" else (None, "split", "unfused")


def _old_record(plan: dict, ms: float = 0.5) -> dict:
    """A record as the flat plan stored it: every field, the target's own over the rest."""
    return {"plan": {"variant": "rolling", "lanes": 1, "splits": 1, **FLAT_DEFAULTS, **plan},
            "measured_ms": ms}


@pytest.mark.parametrize("target", sorted(BACKENDS))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_policy_returns_its_targets_plan_type(target, name):
    rule, geo = _geo(name)
    kind = backend(target).plan_type
    plans = [choose(rule, geo, v, target=target) for v in _variants(name)]
    if name != "rmsnorm_gemm":  # a GEMM is blocked for its shapes: no dynamic plan
        plans.append(choose(rule, geo, target=target, dynamic=True))
    assert all(type(p) is kind for p in plans), plans
    staged = redfuser.derive("mad").lowered()
    resident = choose(staged, shape_geometry(staged, {"x": (64, 4096)}), target=target)
    assert type(resident) is kind and resident.variant == "resident"


def test_the_types_differ_and_keep_their_own_fields():
    assert backend("cpu").plan_type is CpuPlan and backend("cuda").plan_type is CudaPlan
    with pytest.raises(TypeError, match="tile"):
        CudaPlan("rolling", tile=8)
    with pytest.raises(TypeError, match="threads"):
        CpuPlan("rolling", threads=256)
    with pytest.raises(TypeError, match="positional"):  # a target's field by position
        CudaPlan("rolling", 1, 1, True, "why", 256)
    rule, geo = _geo("rmsnorm_gemm")
    gemm = choose(rule, geo, target="cuda")
    assert gemm.mr and not hasattr(gemm, "nt") and "NT" not in str(gemm)


def test_a_resident_cpu_plan_folds_one_row_at_a_time():
    staged = redfuser.derive("mad").lowered()
    blocked = CpuPlan("unfused", 1, tile=32, row_block=8)
    assert blocked.row_by_row().row_block == 1 and blocked.row_by_row().tile == 32
    assert choose(staged, shape_geometry(staged, {"x": (64, 4096)})).row_block == 1


@pytest.mark.parametrize("target", sorted(BACKENDS))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_record_round_trips(target, name):
    rule, geo = _geo(name)
    for variant in _variants(name):
        plan = dataclasses.replace(choose(rule, geo, variant, target=target), reason="")
        params = plan_params(plan)
        assert set(params) <= {f.name for f in dataclasses.fields(type(plan))}
        assert plan_from_params(params, target=target) == plan
        assert record_problem({"plan": params, "measured_ms": 1.0}, target) is None


def test_new_records_hold_only_the_targets_fields():
    assert "threads" not in plan_params(CpuPlan("rolling", 16, tile=8))
    assert not {"tile", "row_block", "nt"} & set(plan_params(CudaPlan("rolling", threads=64)))


def test_an_old_cpu_record_with_default_foreign_fields_loads(tmp_path):
    rule, geo = _geo("softmax")
    db = TuningDB(tmp_path / "tuning.json")
    old = _old_record({"lanes": 16, "tile": 8})
    assert db.put(entry_key(rule, geo, "cpu", machine_id("cpu")), old)
    plan = tuned_plan(rule, geo, "cpu", db=db)
    assert type(plan) is CpuPlan and (plan.lanes, plan.tile) == (16, 8)
    assert record_plan(old, rule, geo, "cpu") == plan


def test_an_old_cuda_record_with_default_foreign_fields_loads():
    rule, geo = _geo("softmax")
    plan = record_plan(_old_record({"threads": 128}), rule, geo, "cuda")
    assert type(plan) is CudaPlan and plan.threads == 128
    gemm_rule, gemm_geo = _geo("rmsnorm_gemm")
    tiled = plan_params(choose(gemm_rule, gemm_geo, target="cuda"))
    old_gemm = _old_record({**tiled, "nt": 1})  # the flat plan's tiled GEMM held nt=1
    assert record_plan(old_gemm, gemm_rule, gemm_geo, "cuda").mr == tiled["mr"]


@pytest.mark.parametrize("target,field,value", [("cpu", "threads", 256), ("cuda", "tile", 8),
                                                ("cuda", "row_block", 4), ("cuda", "nt", 2)])
def test_an_old_record_with_a_set_foreign_field_is_refused(tmp_path, target, field, value):
    rule, geo = _geo("softmax")
    record = _old_record({field: value})
    problem = record_problem(record, target)
    assert problem is not None and f"{field}={value}" in problem, problem
    assert backend(target).plan_type.__name__ in problem
    with pytest.raises(ValueError, match=field):
        record_plan(record, rule, geo, target)
    key = entry_key(rule, geo, target, "machine A")
    with pytest.raises(ValueError, match=field):
        TuningDB(tmp_path / "tuning.json").put(key, record)
    merged, summary = merge_entries({}, {key: record})
    assert merged == {} and summary.skipped == 1 and field in summary.first_skip


def test_a_record_is_checked_against_its_keys_target():
    """The same table is a CUDA plan and not a CPU one: the key's target decides."""
    rule, geo = _geo("softmax")
    record = {"plan": {"variant": "rolling", "threads": 64}, "measured_ms": 0.5}
    merged, summary = merge_entries({}, {entry_key(rule, geo, "cuda", "m"): record,
                                         entry_key(rule, geo, "cpu", "m"): record})
    assert summary.new == 1 and summary.skipped == 1 and "threads" in summary.first_skip


def test_describe_asks_the_plans_type():
    assert describe(CudaPlan("split", splits=4, threads=256)) == "split splits=4 threads=256"
    assert describe(CpuPlan("rolling", 16, tile=8)) == "rolling lanes=16 tile=8"


def test_compile_refuses_another_targets_plan():
    with pytest.raises(TypeError, match="CpuPlan for target 'cpu', not a CudaPlan"):
        redfuser.compile("softmax", plan=CudaPlan("rolling", threads=64))
