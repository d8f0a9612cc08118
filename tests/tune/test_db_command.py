"""Tuning records are checked against the space before anything is built, and the
``redfuser db`` command (show, export, import, merge) keeps what it cannot read untouched.
Every test points the cache at a temporary directory."""

from __future__ import annotations

import importlib
import itertools
import json

import numpy as np
import pytest

import redfuser
from redfuser.cli import main
from redfuser.lowering import VARIANTS, CpuPlan, choose, shape_geometry
from redfuser.tune import TuningDB, entry_key, machine_id, space
from redfuser.tune.machine import nominal_cpu
from redfuser.tune.search import record_plan
from redfuser.tune.space import same_plan
from tests.support import rule_for

machine_module = importlib.import_module("redfuser.tune.machine")  # the module, not machine()
RECORD = {"plan": {"variant": "rolling", "lanes": 16, "tile": 8}, "measured_ms": 1.0}
STAMPS = [f"2026-11-0{d}T10:00:00+00:00" for d in range(1, 6)]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REDFUSER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(machine_module, "measure_cpu", nominal_cpu)  # no 2 s measurement
    return tmp_path / "cache"


def entries_of(path) -> dict:
    with open(path) as f:
        return json.load(f)["entries"]


# -- records are checked against the space ----------------------------------------------------

def test_a_record_out_of_the_space_is_never_built(cache):
    """Repro db_row_block.py: a record with row_block 64 (or 1000) compiled for 24 s (or
    minutes) on the first call.  Any field out of the space is ignored with a warning."""
    rule = rule_for("softmax")
    geo = shape_geometry(rule, {"x": (32, 256)})
    for plan, why in [({"variant": "rolling", "lanes": 1, "row_block": 1000}, "row_block=1000"),
                      ({"variant": "rolling", "lanes": 5}, "lanes=5"),
                      ({"variant": "rolling", "lanes": 16, "tile": 3}, "tile=3"),
                      ({"variant": "rolling", "lanes": 16, "splits": 4}, "splits=4"),
                      ({"variant": "split", "lanes": 16, "splits": 1000}, "splits=1000")]:
        with pytest.raises(ValueError, match=why):
            record_plan({"plan": plan, "measured_ms": 0.05}, rule, geo)
    for record, why in [({"plan": {"variant": "rolling"}, "measured_ms": -1}, "measured_ms"),
                        ({"measured_ms": 1.0}, "'plan' table")]:
        with pytest.raises(ValueError, match=why):
            record_plan(record, rule, geo)
    key = entry_key(rule, geo, "cpu", machine_id())
    TuningDB().put(key, {"plan": {"variant": "rolling", "lanes": 1, "row_block": 1000},
                         "measured_ms": 0.05})
    kernel = redfuser.compile(rule)
    with pytest.warns(RuntimeWarning, match="ignoring a tuning record.*row_block=1000"):
        kernel(x=np.zeros((32, 256), np.float32))
    assert kernel.plan == choose(rule, geo)


# -- the db command ---------------------------------------------------------------------------

def _tuned(path, keys: dict) -> TuningDB:
    db = TuningDB(path)
    rule = rule_for("softmax")
    for cols, (ms, stamp) in keys.items():
        key = entry_key(rule, shape_geometry(rule, {"x": (8, cols)}), "cpu", "machine A")
        db.merge({key: {**RECORD, "measured_ms": ms, "stored": stamp}})
    return db


def test_db_show_export_import_merge(tmp_path, capsys):
    a = _tuned(tmp_path / "a.json", {64: (0.5, STAMPS[0]), 128: (0.7, STAMPS[3])})
    b = _tuned(tmp_path / "b.json", {128: (0.6, STAMPS[1]), 256: (0.9, STAMPS[1])})
    assert main(["db", "show", "--db", str(a.path)]) == 0
    shown = capsys.readouterr().out
    assert "2 entries" in shown and "x=8x64" in shown and "machine A" in shown
    assert "rolling lanes=16 tile=8" in shown and "0.5000 ms measured" in shown
    export = tmp_path / "exported.json"
    assert main(["db", "export", str(export), "--db", str(a.path)]) == 0
    assert entries_of(export) == a.entries()
    assert main(["db", "export", str(export), "--db", str(b.path)]) == 1  # never replaced
    assert "already exists" in capsys.readouterr().err and entries_of(export) == a.entries()
    assert main(["db", "import", str(export), "--db", str(b.path)]) == 0
    assert "1 new, 1 replaced by newer, 0 kept" in capsys.readouterr().out
    merged = b.entries()
    assert len(merged) == 3 and sorted(r["measured_ms"] for r in merged.values()) == [0.5,
                                                                                      0.7, 0.9]
    assert main(["db", "merge", str(a.path), str(export), "--db", str(b.path)]) == 0
    assert b.entries() == merged  # folding the same records again changes nothing


@pytest.mark.parametrize("content,why", [
    (None, "does not exist"), (b"\x00\xfe", "not UTF-8"), (b"{", "not valid JSON"),
    (b'{"format": "redfuser-tuning", "version": 7, "entries": {}}', "version 7")])
def test_db_import_of_a_bad_file_is_a_clear_error(tmp_path, capsys, content, why):
    db = _tuned(tmp_path / "db.json", {64: (0.5, STAMPS[0])})
    before = db.path.read_bytes()
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_bytes(content)
    assert main(["db", "merge", str(bad), "--db", str(db.path)]) == 1
    err = capsys.readouterr().err
    assert why in err and str(bad) in err and "Traceback" not in err
    assert db.path.read_bytes() == before
    assert main(["db", "show", "--db", str(bad)]) == (1 if content else 0)


@pytest.mark.parametrize("name,shapes", [("softmax", {"x": (32, 256)}),
                                         ("attention", {"q": (2, 64, 16), "k": (2, 1, 64, 16),
                                                        "v": (2, 1, 64, 16)}),
                                         ("moe_routing", {"x": (8, 256)})])
def test_the_space_check_agrees_with_the_candidates(name, shapes):
    """``Space.why_not`` decides membership without enumerating: it must accept exactly
    the enumerated candidates (checked over every plan of the parameters' value grid)."""
    rule = rule_for(name)
    geo = shape_geometry(rule, shapes)
    s = space(rule, geo)
    candidates = s.candidates()
    assert all(s.why_not(p) is None for p in candidates)
    values = {"variant": VARIANTS, "lanes": (1, 16, 64), "tile": (1, 3, 8), "splits": (1, 4, 64),
              "row_block": (1, 2, 1000)}
    for combo in itertools.product(*values.values()):
        plan = CpuPlan(**dict(zip(values, combo, strict=True)))
        inside = any(same_plan(plan, c) for c in candidates)
        assert (s.why_not(plan) is None) == inside, plan
