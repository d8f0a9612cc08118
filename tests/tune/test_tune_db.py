"""The tuning database never loses or corrupts data (redfuser.tune.db, .store, .share).

Regression tests of the repros db_unreadable_replaced.sh, db_future_version.sh, db_race.py,
db_unicode_crash.sh, db_deep_json.sh, db_not_writable_crash.sh, db_row_block.py and "a FIFO
as the database blocks forever" (issue 12), several writing processes, hypothesis over
corrupted files and merge orders, and the ``redfuser db`` command.  Every test points the
cache at a temporary directory.  Permission checks run in a forked child that drops to
user ``nobody`` when the tests run as root (root reads any file regardless of its mode).
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import re
import shutil
import stat
import tempfile
import threading
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import redfuser
from redfuser.cli import main
from redfuser.tune import TuningDB, machine, machine_id
from redfuser.tune.db import FORMAT, VERSION, merge_entries
from redfuser.tune.machine import nominal_cpu
from redfuser.tune.store import DatabaseError
from tests.support import examples

machine_module = importlib.import_module("redfuser.tune.machine")  # the module, not machine()
NOBODY = 65534  # the unprivileged user a root test process drops to
RECORD = {"plan": {"variant": "rolling", "lanes": 16, "tile": 8}, "measured_ms": 1.0}
FORK = multiprocessing.get_context("fork")  # children inherit the imported modules


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REDFUSER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(machine_module, "measure_cpu", nominal_cpu)  # no 2 s measurement
    return tmp_path / "cache"


@pytest.fixture
def open_dir():
    """A directory every user can enter and write (pytest's own are private to root)."""
    path = tempfile.mkdtemp(prefix="redfuser-db-")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def database(path, entries: dict, version: int = VERSION) -> bytes:
    """Write a database file; its bytes (to check later that nothing touched them)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "version": version, "entries": entries}, f)
    with open(path, "rb") as f:
        return f.read()


def as_other_user(fn) -> object:
    """``fn()`` in a forked child that cannot read files of mode 000: the child drops to
    ``nobody`` when we are root; its result (JSON) comes back through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            if os.geteuid() == 0:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = {"value": fn(), "warnings": [str(w.message) for w in caught]}
            os.write(write, json.dumps(result).encode())
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails
            os.write(write, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        out = json.loads(f.read())
    os.waitpid(pid, 0)
    return out


def entries_of(path) -> dict:
    with open(path) as f:
        return json.load(f)["entries"]


# -- never overwrite what could not be read ---------------------------------------------------

def test_an_unreadable_database_is_never_replaced(open_dir):
    """Repro db_unreadable_replaced.sh: a good database this process cannot read
    (permissions) read as empty and was replaced by the next write (50 entries -> 1)."""
    path = os.path.join(open_dir, "tuning.json")
    before = database(path, {f"precious-{i}": RECORD for i in range(50)})
    os.chmod(path, 0)

    def write():
        db = TuningDB(path)
        seen = db.entries()
        try:
            db.put("mine", RECORD)
            return [len(seen), "written"]
        except DatabaseError as e:
            return [len(seen), str(e)]

    out = as_other_user(write)
    assert out["value"][0] == 0 and "refusing to write" in out["value"][1]
    assert "Permission denied" in out["value"][1]
    assert any("cannot be read" in w for w in out["warnings"])
    os.chmod(path, 0o644)
    with open(path, "rb") as f:
        assert f.read() == before


def test_a_newer_version_is_never_replaced(cache, capsys, monkeypatch):
    """Repro db_future_version.sh: `redfuser tune` silently replaced a version-2 database
    (50 entries lost).  Now reads warn, writes refuse, and the CLI stops before measuring."""
    path = cache / "tuning.json"
    before = database(path, {f"precious-{i}": {} for i in range(50)}, version=2)
    db = TuningDB()
    with pytest.warns(RuntimeWarning, match="version 2, written by a newer redfuser"):
        assert db.entries() == {}
    with pytest.raises(DatabaseError, match="refusing to write .*newer redfuser"):
        db.put("k", RECORD)
    assert main(["tune", "softmax", "--shape", "x=8x64", "--top", "1"]) == 1
    out = capsys.readouterr()
    assert "newer redfuser" in out.err and "stored in" not in out.out + out.err
    assert "schedule space" not in out.out  # refused before any work
    search = importlib.import_module("redfuser.tune.search")
    real = search.tune
    monkeypatch.setattr(search, "tune", lambda *a, **kw: real(
        *a, **{**kw, "top": 1, "repeat": 1, "rounds": 1, "progress": False}))
    x = np.random.default_rng(3).normal(size=(4, 64)).astype(np.float32)
    with pytest.warns(RuntimeWarning, match="tuned plan was not stored: refusing to write"):
        y = redfuser.compile("softmax", tune=True)(x=x)["y"]  # searched, used, not stored
    np.testing.assert_allclose(y, redfuser.reference("softmax", {"x": x})["y"], rtol=1e-5,
                               atol=1e-7)  # float32 kernel vs the float64 oracle
    assert path.read_bytes() == before


@pytest.mark.parametrize("content,why", [
    (b"\xff{}", "not UTF-8 text (byte 0xff at offset 0)"),  # repro db_unicode_crash.sh
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # repro db_deep_json.sh
    (b"[" * 40 + b"]" * 40, "deeper than 32 levels"),  # parses, but no record nests so deep
    (json.dumps({"format": FORMAT, "version": VERSION, "entries": {"k": RECORD}}).encode()[:-7],
     "not valid JSON"),  # truncated
    (b'{"format": "someone-else", "entries": {}}', "not a redfuser-tuning file"),
    (json.dumps({"format": FORMAT, "version": VERSION, "entries": [1]}).encode(),
     "no 'entries' table")])
def test_an_undecodable_database_never_breaks_a_compile(cache, content, why):
    """Repros db_unicode_crash.sh and db_deep_json.sh: one non-UTF-8 byte or deeply nested
    JSON raised out of every compile().  Now: one warning, a compile that works, writes
    refused, the file untouched."""
    path = cache / "tuning.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.warns(RuntimeWarning, match=re.escape(why)):
        out = redfuser.compile("softmax")(x=np.ones((2, 8), np.float32))
    np.testing.assert_allclose(out["y"], 1 / 8, rtol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per file and reason, not per compile
        redfuser.compile("softmax")(x=np.ones((2, 16), np.float32))
    with pytest.raises(DatabaseError, match="refusing to write"):
        TuningDB().put("k", RECORD)
    assert path.read_bytes() == content


def test_a_fifo_directory_or_device_as_the_database_is_refused_without_blocking(cache):
    """Issue 12 item 5: a FIFO as the database blocked every compile forever (open waits
    for a writer).  Now it is refused from its stat, like a directory or a device."""
    cache.mkdir(parents=True)
    fifo = cache / "tuning.json"
    os.mkfifo(fifo)
    done = []

    def use():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            redfuser.compile("softmax")(x=np.ones((2, 8), np.float32))
        done.append([str(w.message) for w in caught])

    worker = threading.Thread(target=use, daemon=True)  # a hang must not hang the suite
    worker.start()
    worker.join(timeout=60)
    assert done and any("FIFO" in w for w in done[0])
    for path, what in ((fifo, "FIFO"), (cache, "directory"), ("/dev/null", "character device")):
        db = TuningDB(path)
        assert what in db.problem()
        with pytest.raises(DatabaseError, match=what):
            db.put("k", RECORD)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


# -- concurrent writers -----------------------------------------------------------------------

def _put_many(path: str, worker: int, count: int) -> None:
    db = TuningDB(path)
    for j in range(count):
        db.put(f"w{worker}-{j}", RECORD)


def test_concurrent_writers_lose_nothing(tmp_path):
    """Repro db_race.py: 3 processes x 40 puts kept 60-80 of 120 entries."""
    path = str(tmp_path / "race" / "tuning.json")
    procs = [FORK.Process(target=_put_many, args=(path, w, 40)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    found = entries_of(path)
    assert sorted(found) == sorted(f"w{w}-{j}" for w in range(3) for j in range(40))
    assert sorted(os.listdir(tmp_path / "race")) == ["tuning.json", "tuning.json.lock"]


def _merge_each(path: str, records: list) -> None:
    db = TuningDB(path)
    for key, record in records:
        db.merge({key: record})


STAMPS = [f"2026-11-0{d}T10:00:00+00:00" for d in range(1, 6)]
RECORDS = st.builds(lambda stamp, ms, lanes: {"plan": {"variant": "rolling", "lanes": lanes},
                                              "measured_ms": ms, "stored": stamp},
                    st.sampled_from(STAMPS), st.sampled_from([0.5, 1.0, 2.0]),
                    st.sampled_from([1, 4, 16]))
WRITES = st.lists(st.tuples(st.sampled_from("abcd"), RECORDS), min_size=1, max_size=12)


def newest(writes: list) -> dict:
    """What must survive per key, by the documented order (written out here, not taken
    from the code): the later stamp, then the lower time, then the canonical text."""
    out = {}
    for key, rec in writes:
        order = (rec["stored"], -rec["measured_ms"], json.dumps(rec, sort_keys=True))
        held = out.get(key)
        if held is None or order > (held["stored"], -held["measured_ms"],
                                    json.dumps(held, sort_keys=True)):
            out[key] = rec
    return out


@settings(max_examples=examples(0.2))
@given(per_worker=st.lists(WRITES, min_size=3, max_size=3))
def test_concurrent_writers_agree_with_the_merge_order(per_worker):
    """Three processes merge conflicting records of a few keys concurrently: the file ends
    with the newest record of every key whatever the interleaving."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tuning.json")
        procs = [FORK.Process(target=_merge_each, args=(path, w)) for w in per_worker]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
        assert [p.exitcode for p in procs] == [0, 0, 0]
        assert entries_of(path) == newest([w for ws in per_worker for w in ws])


@settings(max_examples=examples(2))
@given(a=WRITES, b=WRITES)
def test_merging_is_order_free_and_idempotent(a, b):
    da, db_ = dict(newest(a)), dict(newest(b))
    ab, _ = merge_entries(merge_entries({}, da)[0], db_)
    ba, _ = merge_entries(merge_entries({}, db_)[0], da)
    assert ab == ba == newest(a + b)
    again, summary = merge_entries(ab, ab)
    assert again == ab and summary.kept == len(ab) and summary.new == summary.replaced == 0


# -- corrupted files (hypothesis) -------------------------------------------------------------

VALID = json.dumps({"format": FORMAT, "version": VERSION, "entries": {
    f"k{i}": {**RECORD, "measured_ms": i / 8} for i in range(4)}}, indent=1).encode()
CORRUPT = st.one_of(
    st.binary(max_size=300),  # random bytes
    st.integers(0, len(VALID)).map(lambda n: VALID[:n]),  # truncations
    st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)).map(  # one byte changed
        lambda p: VALID[:p[0]] + bytes([p[1]]) + VALID[p[0] + 1:]),  # wrong versions:
    st.one_of(st.integers(), st.none(), st.text(max_size=3), st.floats()).map(
        lambda v: json.dumps({"format": FORMAT, "version": v, "entries": {}}).encode()))


def expected_valid(content: bytes) -> bool:
    """Whether a file is a usable database, decided here from the documented format."""
    try:
        data = json.loads(content.decode("utf-8"))
    except (ValueError, RecursionError):
        return False
    return (isinstance(data, dict) and data.get("format") == FORMAT
            and data.get("version") == VERSION and type(data.get("version")) is int
            and isinstance(data.get("entries"), dict))


@settings(max_examples=examples(4))
@given(content=CORRUPT)
def test_a_corrupted_file_only_warns_and_is_never_modified(content):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tuning.json")
        with open(path, "wb") as f:
            f.write(content)
        db = TuningDB(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            entries = db.entries()
        assert isinstance(entries, dict)
        assert all(issubclass(w.category, RuntimeWarning) for w in caught)
        valid = expected_valid(content)
        assert (db.problem() is None) == valid
        if valid:
            db.put("new", RECORD)
            assert entries_of(path) == {**entries, "new": db.get("new")}
        else:
            with pytest.raises(DatabaseError, match="refusing to write"):
                db.put("new", RECORD)
            with open(path, "rb") as f:
                assert f.read() == content


# -- an unwritable cache ----------------------------------------------------------------------

def test_an_unwritable_cache_never_crashes_compile_or_tune(tmp_path, monkeypatch, capsys):
    """Repro db_not_writable_crash.sh: with no machine.json and a cache that cannot be
    written, compile(tune="model") and `redfuser tune` died with PermissionError.  Now the
    figures are measured once, used for the process, with one warning; the CLI says the
    result was not stored (exit 1), never "stored in"."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a cache directory inside a regular file cannot be created
    monkeypatch.setenv("REDFUSER_CACHE", str(blocker / "cache"))
    calls = []
    monkeypatch.setattr(machine_module, "measure_cpu", lambda k: calls.append(k) or
                        nominal_cpu(k))
    x = np.random.default_rng(0).normal(size=(32, 256)).astype(np.float32)
    with pytest.warns(RuntimeWarning, match="measured but not cached") as caught:
        out = redfuser.compile("softmax", tune="model")(x=x)
    assert len([w for w in caught if "not cached" in str(w.message)]) == 1
    np.testing.assert_allclose(out["y"], redfuser.reference("softmax", {"x": x})["y"],
                               rtol=1e-5, atol=1e-7)  # float32 softmax vs float64 oracle
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        redfuser.compile("softmax", tune="model")(x=x[:, :128])
    assert calls == [machine_id()]  # measured once for this process
    code = main(["tune", "softmax", "--shape", "x=8x64", "--top", "1", "--repeat", "1",
                 "--rounds", "1"])
    out = capsys.readouterr()
    assert code == 1 and "not stored: cannot write" in out.err
    assert "best:" in out.out and "stored in" not in out.out


def test_figures_are_used_when_the_cache_directory_is_not_ours(open_dir):
    """Repro db_not_writable_crash.sh with its permissions: a cache directory owned by
    another user (here root's, 0755, seen by nobody)."""
    cache = os.path.join(open_dir, "cache")
    os.mkdir(cache, 0o755)
    if os.geteuid() != 0:
        os.chmod(cache, 0o555)

    def figures():
        os.environ["REDFUSER_CACHE"] = cache
        return machine().name

    out = as_other_user(figures)
    assert out["value"] == machine_id(), out
    assert [w for w in out["warnings"] if "not cached" in w and "Permission denied" in w]
    assert os.listdir(cache) == []


def test_a_newer_machine_file_is_kept_and_the_figures_measured(cache, monkeypatch):
    """machine.json follows the database's rule: a newer redfuser's file is left as it is,
    the figures are measured once for this process, one warning."""
    path = cache / "machine.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": "redfuser-machine", "version": 2, "entries": {}}))
    before = path.read_bytes()
    calls = []
    monkeypatch.setattr(machine_module, "measure_cpu", lambda k: calls.append(k) or
                        nominal_cpu(k))
    with pytest.warns(RuntimeWarning, match="version 2, written by a newer redfuser"):
        assert machine().name == machine_id()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        machine()
    assert calls == [machine_id()] and path.read_bytes() == before
