"""The one plan door (redfuser/plans.py): every caller gets the same plan from the same
source, and the TensorIR rewrite now follows the tuning database as ``compile`` does."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import te, topi

from redfuser.lowering import choose, geometry, shape_geometry
from redfuser.plans import COST_MODEL, DATABASE, HAND_WRITTEN, plan_for
from redfuser.tensorir.emit import layout_of
from redfuser.tensorir.groups import lift
from redfuser.tensorir.rewrite import fuse, random_params, run_cpu
from redfuser.tune.db import TuningDB, entry_key
from redfuser.tune.machine import machine_id
from tests.support import rule_for

SPLIT = {"plan": {"variant": "split", "lanes": 16, "splits": 2}, "measured_ms": 0.01}


def geo_of(name: str, shapes: dict):
    return shape_geometry(rule_for(name), shapes)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REDFUSER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_database_record_decides_unless_pinned_ignored_or_dynamic(cache):
    rule, geo = rule_for("softmax"), geo_of("softmax", {"x": (4, 64)})
    TuningDB().put(entry_key(rule, geo, "cpu", machine_id()), SPLIT)
    choice = plan_for(rule, geo)
    assert choice.source == DATABASE and choice.tuned and choice.plan.splits == 2
    for options in ({"tune": False}, {"variant": "rolling"}, {"threads": 1},
                    {"dynamic": True}):
        choice = plan_for(rule, geo, **options)
        assert choice.source == HAND_WRITTEN and not choice.tuned
    assert plan_for(rule, geo, tune=False).plan == choose(rule, geo)


def test_without_a_record_the_hand_written_policy_decides(cache):
    rule, geo = rule_for("logsumexp"), geo_of("logsumexp", {"x": (2, 64)})
    choice = plan_for(rule, geo)
    assert (choice.source, choice.plan) == (HAND_WRITTEN, choose(rule, geo))
    assert COST_MODEL != HAND_WRITTEN  # the cost model's source: tests/tune/test_tune.py


def test_the_tensorir_rewrite_follows_the_tuning_database(cache):
    x = te.placeholder((4, 64), "float32", name="x")
    func = te.create_prim_func([x, topi.nn.softmax(x)])
    [group] = lift(func)
    geo = geometry(group.rule, layout_of(group))
    assert fuse(func, report=True)[1].groups[0].reason.startswith("rolling")
    TuningDB().put(entry_key(group.rule, geo, "cpu", machine_id()), SPLIT)
    fused, rep = fuse(func, report=True)
    assert rep.groups[0].fused and rep.groups[0].reason.startswith("split")
    assert "tuned" in rep.groups[0].reason
    arrays = random_params(func, 0)
    for a, b in zip(run_cpu(func, arrays), run_cpu(fused, arrays), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
