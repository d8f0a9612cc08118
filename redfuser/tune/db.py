"""The tuning database: measured best plans, one JSON file under the user's cache directory.

Where: ``$REDFUSER_CACHE`` if set, else ``$XDG_CACHE_HOME/redfuser``, else
``~/.cache/redfuser``; the file is ``tuning.json`` (a symbolic link to a file on a shared
file system shares it).  An entry is keyed by the canonical spec (the lifted cascade
printed by sympy, so spacing, lets and argument order do not matter), the geometry (rows,
N, D and every input's shape), the dtype, the target, the fast-math flag and the machine
(``machine.machine_id``).  Its record holds the plan's parameters, the measured and
predicted times, how many candidates were tried and when it was stored (UTC).

Reads and writes go through ``store``: a file that cannot be read, decoded or
understood (another format, a newer version) reads as empty with one warning and is never
replaced; writers take a lock around read-merge-write, so concurrent writers (processes,
or machines sharing the file) never lose an entry.  Two records of one key merge by
``better``: a measured time beats none, the lower time wins, then the later store, then
the record's canonical text.  That is a total order, so a merge gives the same file
whatever the order in which writers, imports and merges arrive.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..lowering import BACKENDS, Plan
from .space import plan_from_params
from .store import (
    DatabaseError,
    load,
    read_entries,
    update,
    write_json_new,
)

FORMAT = "redfuser-tuning"
VERSION = 1
FILENAME = "tuning.json"
KEY_FIELDS = ("spec", "geometry", "dtype", "target", "machine", "fast_math")  # entry_key's


def cache_dir() -> Path:
    """The directory redfuser caches into (not created here).

    Examples
    --------
    >>> import os
    >>> saved = os.environ.get("REDFUSER_CACHE")
    >>> os.environ["REDFUSER_CACHE"] = "/tmp/rf-doc"
    >>> str(cache_dir())
    '/tmp/rf-doc'
    >>> _ = os.environ.pop("REDFUSER_CACHE") if saved is None else os.environ.update(
    ...     REDFUSER_CACHE=saved)
    """
    if os.environ.get("REDFUSER_CACHE"):
        return Path(os.environ["REDFUSER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "redfuser"


@dataclass
class MergeSummary:
    """What a merge did with the incoming records, by key."""

    new: int = 0  # keys the database did not have
    replaced: int = 0  # incoming record better (``better``) than the one held
    kept: int = 0  # the held record at least as good (an identical one included)
    skipped: int = 0  # not a tuning record (``record_problem``)
    first_skip: str = ""  # why the first skipped one was skipped

    def __str__(self) -> str:
        text = (f"{self.new} new, {self.replaced} replaced by newer, {self.kept} kept "
                "(the database's own as new or newer)")
        return text + (f", {self.skipped} skipped ({self.first_skip})" if self.skipped else "")


def record_problem(record: object, target: str | None = None) -> str | None:
    """Why ``record`` is not a tuning record of ``target`` (None: it is one): it needs a
    finite, non-negative ``measured_ms`` and a ``plan`` table that a compile for that
    target can read (``space.plan_from_params``, the very check a compile makes, so every
    path that lets a record in (``put``, ``merge``, ``redfuser db import`` and ``merge``)
    keeps out what a compile would throw away).  ``target`` None (a key that names none,
    ``key_target``): a plan of any target.

    Examples
    --------
    >>> record_problem({"plan": {"variant": "rolling"}, "measured_ms": 0.5}) is None
    True
    >>> record_problem({"plan": {"variant": "rolling"}, "measured_ms": float("nan")})
    'measured_ms must be a finite non-negative number, not nan'
    >>> record_problem({"plan": {"variant": "rolling", "lanes": -5}, "measured_ms": 0.5})
    'not a plan: plan parameter lanes must be a positive integer, not -5'
    >>> print(record_problem({"plan": {"variant": "rolling", "threads": 256},
    ...                       "measured_ms": 0.5}, "cpu"))  # doctest: +NORMALIZE_WHITESPACE
    not a plan: plan parameter threads=256: a cpu plan (CpuPlan) has no threads; a record may
    hold it only as 1
    """
    if not isinstance(record, dict):
        return f"a record must be a JSON object, not {type(record).__name__}"
    if not isinstance(record.get("plan"), dict):
        return "a record needs a 'plan' table"
    ms = record.get("measured_ms")
    if not _is_time(ms):
        return f"measured_ms must be a finite non-negative number, not {ms!r}"
    try:
        read_plan(record["plan"], target)
    except ValueError as e:
        return f"not a plan: {e}"
    return None


def read_plan(params: dict, target: str | None) -> Plan:
    """The plan of a record's ``plan`` table for ``target`` (``space.plan_from_params``);
    None, a key that names no target (``key_target``): of the first target whose plan type
    reads it.  ``ValueError`` (the named target's reason, or the first one's) otherwise.

    Examples
    --------
    >>> type(read_plan({"variant": "rolling", "threads": 64}, None)).__name__
    'CudaPlan'
    """
    problems = []
    for t in [target] if target is not None else list(BACKENDS):
        try:
            return plan_from_params(params, target=t)
        except ValueError as e:
            problems.append(e)
    raise problems[0]


def key_target(key: str) -> str | None:
    """The target an ``entry_key`` names (None: ``key`` is not one).

    Examples
    --------
    >>> key_target('["spec", [], "float32", "cuda", "cuda/H100", true]')
    'cuda'
    >>> key_target("k") is None
    True
    """
    try:
        target = dict(zip(KEY_FIELDS, json.loads(key), strict=True))["target"]
    except (ValueError, TypeError):  # not JSON, or not entry_key's layout
        return None
    return target if isinstance(target, str) else None


def _is_time(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def _stamp(record: dict) -> float | None:
    """The record's ``stored`` time as seconds since the epoch (a stamp without a zone
    is read as UTC: older redfusers wrote local time without one)."""
    try:
        when = datetime.fromisoformat(record["stored"])
    except (KeyError, TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def rank(record: object) -> tuple:
    """The order ``better`` uses: a stamped record beats an unstamped one, then the later
    store, then a measured time beats none, then the lower time, then the canonical text
    (which makes it total: equal ranks mean equal records).

    Examples
    --------
    >>> fast = {"plan": {}, "measured_ms": 0.5, "stored": "2026-01-01T00:00:00+00:00"}
    >>> slow = {**fast, "measured_ms": 0.9}
    >>> rank(fast) > rank(slow) > rank({"plan": {}, "measured_ms": 0.1})  # unstamped last
    True
    """
    rec = record if isinstance(record, dict) else {}
    stamp, ms = _stamp(rec), rec.get("measured_ms")
    return (stamp is not None, stamp or 0.0, _is_time(ms), -ms if _is_time(ms) else 0.0,
            json.dumps(record, sort_keys=True, default=str))


def better(a: object, b: object) -> object:
    """The record that survives when ``a`` and ``b`` share a key: the newer one (then the
    faster one).

    Examples
    --------
    >>> old = {"plan": {}, "measured_ms": 0.5, "stored": "2026-01-01T00:00:00+00:00"}
    >>> new = {"plan": {}, "measured_ms": 0.9, "stored": "2026-02-01T00:00:00+00:00"}
    >>> better(old, new) is new and better(new, old) is new
    True
    """
    return a if rank(a) >= rank(b) else b


def merge_entries(held: dict, incoming: dict) -> tuple[dict, MergeSummary]:
    """``held`` with every tuning record of ``incoming`` folded in by ``better``; what
    happened per key.  Records of ``held`` that are not tuning records stay as they are.

    Examples
    --------
    >>> old = {"plan": {"variant": "rolling"}, "measured_ms": 0.5,
    ...        "stored": "2026-01-01T00:00:00+00:00"}
    >>> new = {**old, "stored": "2026-02-01T00:00:00+00:00"}
    >>> bogus = {**new, "plan": {"variant": "bogus"}}
    >>> merged, summary = merge_entries({"a": old}, {"a": new, "b": old, "c": 3, "d": bogus})
    >>> merged["a"] is new, sorted(merged), summary.skipped
    (True, ['a', 'b'], 2)
    """
    merged, summary = dict(held), MergeSummary()
    for key, record in incoming.items():
        problem = record_problem(record, key_target(key))
        if problem is not None:
            summary.skipped += 1
            summary.first_skip = summary.first_skip or f"{key[:40]}: {problem}"
        elif key not in merged:
            merged[key], summary.new = record, summary.new + 1
        elif rank(record) > rank(merged[key]):
            merged[key], summary.replaced = record, summary.replaced + 1
        else:
            summary.kept += 1
    return merged, summary


class TuningDB:
    """The tuning database file (``path`` default: ``cache_dir() / "tuning.json"``).

    Examples
    --------
    >>> import tempfile, pathlib
    >>> tmp = tempfile.TemporaryDirectory()
    >>> db = TuningDB(pathlib.Path(tmp.name) / "tuning.json")
    >>> db.get("k") is None
    True
    >>> db.put("k", {"plan": {"variant": "rolling", "lanes": 16}, "measured_ms": 1.5})
    True
    >>> db.get("k")["measured_ms"]
    1.5
    >>> tmp.cleanup()
    """

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else cache_dir() / FILENAME

    def entries(self) -> dict[str, dict]:
        """Every record by key (an unusable file reads as empty, with a warning)."""
        return read_entries(self.path, FORMAT, VERSION)

    def problem(self) -> str | None:
        """Why the file cannot be used, hence will not be written (None: it can)."""
        return load(self.path, FORMAT, VERSION).problem

    def get(self, key: str) -> dict | None:
        """The record of ``key`` (None when there is none, or it is not a record)."""
        record = self.entries().get(key)
        return record if isinstance(record, dict) else None

    def put(self, key: str, record: dict) -> bool:
        """Store one record, stamped with the time (UTC); True when it is now the key's
        record (False: the database already held a newer one).  Raises ``ValueError``
        for a record that is not one (``record_problem``), ``DatabaseError`` when the
        file is unusable or cannot be written."""
        problem = record_problem(record, key_target(key))
        if problem is not None:
            raise ValueError(f"not a tuning record: {problem}")
        stamped = {**record, "stored": datetime.now(timezone.utc).isoformat()}
        summary = self.merge({key: stamped})
        return summary.new + summary.replaced == 1

    def merge(self, incoming: dict) -> MergeSummary:
        """Fold ``incoming`` (key -> record) in under the lock (``merge_entries``)."""
        found = []

        def change(held: dict) -> dict:
            merged, summary = merge_entries(held, incoming)
            found.append(summary)
            return merged

        update(self.path, FORMAT, VERSION, change)
        return found[-1]

    def export(self, path: Path | str) -> int:
        """Write every record to a new file ``path`` (the same format: the file is a
        database itself); how many were written.  Refuses an unusable database and an
        existing ``path`` (``DatabaseError``)."""
        found = load(self.path, FORMAT, VERSION)
        if found.problem is not None:
            raise DatabaseError(f"cannot export {self.path}: it {found.problem}")
        write_json_new(Path(path), {"format": FORMAT, "version": VERSION,
                                    "entries": found.entries})
        return len(found.entries)


def read_database(path: Path | str) -> dict[str, dict]:
    """The entries of another database file (an export); ``DatabaseError`` naming the
    file and the reason when it is missing or unusable (an import must not fold in
    nothing silently).

    Examples
    --------
    >>> try:
    ...     read_database("/nonexistent/tuning.json")
    ... except DatabaseError as e:
    ...     print(e)
    /nonexistent/tuning.json does not exist
    """
    path = Path(path)
    found = load(path, FORMAT, VERSION)
    if not found.exists:
        raise DatabaseError(f"{path} does not exist")
    if found.problem is not None:
        raise DatabaseError(f"{path} cannot be imported: it {found.problem}")
    return found.entries


def spec_key(rule) -> str:
    """The canonical text of a rule's cascade: inputs, reductions, epilogues, outputs.

    Examples
    --------
    >>> import redfuser
    >>> a = redfuser.derive("m = max(x[i]);  d = sum(exp(x[i] - m))")
    >>> b = redfuser.derive("m = max(x[i])\\nt = x[i] - m\\nd = sum(exp(t))")
    >>> spec_key(a) == spec_key(b)
    True
    """
    c = rule.cascade
    parts = [f"streams {sorted(map(str, c.streams))}", f"params {sorted(map(str, c.params))}",
             f"vector {sorted(c.vector_inputs)}"]
    parts += [f"{r.name} = {r.op}({r.body}{', ' + str(r.k) if r.k else ''})"
              for r in c.reductions]
    parts += [f"{k} = {v}" for k, v in c.epilogues.items()]
    parts += [f"{k}[i] = {v}" for k, v in c.elementwise.items()]
    return "; ".join(parts + [f"outputs {list(c.outputs)}"])


def entry_key(rule, geo, target: str, machine: str, fast_math: bool = True) -> str:
    """The database key of one (rule, geometry, dtype, target, machine) as JSON text; the
    dtype is the geometry's compute dtype (a float64 kernel's record is never a float32
    one's)."""
    return json.dumps([spec_key(rule), _jsonable(geo.shape_key()), geo.compute, target,
                       machine, bool(fast_math)], separators=(",", ":"))


def _jsonable(value):
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value
