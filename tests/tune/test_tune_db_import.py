"""Every path that lets a tuning record into the database checks its plan the way a
compile reads it (repro r2_db_import_invalid_plan.sh).

A malformed plan (negative lanes, an unknown variant, a number written as a string, an
unknown parameter) that was stored later than the database's valid record used to replace
it on ``redfuser db import``/``merge``: the tuned plan was lost and every compile then
ignored the record.  Such a record is now skipped, with the reason, and the valid one stays.
"""

from __future__ import annotations

import json

import pytest

from redfuser.cli import main
from redfuser.lowering import shape_geometry
from redfuser.tune import TuningDB, entry_key
from redfuser.tune.db import FORMAT, VERSION
from tests.support import rule_for

PLAN = {"variant": "rolling", "lanes": 16, "tile": 8}
VALID = {"plan": PLAN, "measured_ms": 0.0134, "stored": "2026-12-05T07:02:29+00:00"}
MALFORMED = [({"lanes": -5}, "lanes must be a positive integer, not -5"),
             ({"variant": "bogus"}, "variant must be one of"),
             ({"lanes": "32"}, "lanes must be a positive integer, not '32'"),
             ({"warp": 3}, "unknown plan parameter(s) ['warp']")]


@pytest.fixture
def key() -> str:
    rule = rule_for("softmax")
    return entry_key(rule, shape_geometry(rule, {"x": (8, 64)}), "cpu", "machine A")


def _file(path, key: str, record: dict):
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION,
                                "entries": {key: record}}))
    return path


@pytest.mark.parametrize("change,why", MALFORMED)
@pytest.mark.parametrize("action", ["import", "merge"])
def test_a_newer_malformed_plan_never_replaces_a_valid_one(tmp_path, capsys, key, action,
                                                          change, why):
    db = TuningDB(_file(tmp_path / "tuning.json", key, VALID))
    newer = {**VALID, "stored": "2999-01-01T00:00:00+00:00", "plan": {**PLAN, **change}}
    incoming = _file(tmp_path / "incoming.json", key, newer)
    assert main(["db", action, str(incoming), "--db", str(db.path)]) == 0
    out = capsys.readouterr().out
    assert "0 new, 0 replaced by newer" in out and "1 skipped" in out
    assert "not a plan" in out and why in out
    assert db.get(key) == VALID


@pytest.mark.parametrize("change,why", MALFORMED)
def test_put_and_merge_refuse_a_malformed_plan(tmp_path, key, change, why):
    db = TuningDB(tmp_path / "tuning.json")
    bad = {**VALID, "plan": {**PLAN, **change}}
    with pytest.raises(ValueError, match="not a plan"):
        db.put(key, bad)
    summary = db.merge({key: bad})
    assert (summary.new, summary.skipped) == (0, 1) and why in summary.first_skip
    assert db.entries() == {}
