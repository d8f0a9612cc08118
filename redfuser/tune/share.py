"""Moving tuning results between machines: list a database, export it, merge others in.

``redfuser db show | export FILE | import FILE | merge FILE...`` (``cli.py``) runs these.
An export is a database file itself (``TuningDB.export``), so it can be copied into
place, imported or merged; importing merges records in with the same merge concurrent
writers use (``db.merge_entries``: the newer record of a key wins), so importing the
same files in any order, any number of times, gives the same database.
"""

from __future__ import annotations

import json
from pathlib import Path

from .db import (
    FORMAT,
    KEY_FIELDS,
    VERSION,
    MergeSummary,
    TuningDB,
    key_target,
    read_database,
    read_plan,
)
from .search import describe
from .store import DatabaseError, load


def show(db: TuningDB) -> str:
    """Every entry of ``db``: spec key, shapes, dtype, target and machine, plan, measured
    time and when it was stored.  ``DatabaseError`` when the file is unusable.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> db = TuningDB(pathlib.Path(tempfile.mkdtemp()) / "tuning.json")
    >>> show(db).endswith("tuning.json (nothing tuned yet)")
    True
    >>> _ = db.put("k", {"plan": {"variant": "rolling", "lanes": 16}, "measured_ms": 1.5})
    >>> print(show(db).splitlines()[2])
      key      k (not a redfuser entry key)
    """
    found = load(db.path, FORMAT, VERSION)
    if found.problem is not None:
        raise DatabaseError(f"{db.path} cannot be shown: it {found.problem}")
    if not found.exists:
        return f"no tuning database at {db.path} (nothing tuned yet)"
    count = len(found.entries)
    lines = [f"{db.path}: {count} {'entry' if count == 1 else 'entries'}"]
    for i, (key, record) in enumerate(sorted(found.entries.items()), 1):
        lines += [f"{i}."] + [f"  {name:<8} {text}" for name, text in
                              _key_lines(key) + _record_lines(record, key_target(key))]
    return "\n".join(lines)


def _key_lines(key: str) -> list[tuple[str, str]]:
    try:
        fields = dict(zip(KEY_FIELDS, json.loads(key), strict=True))
        rows, n, d, out_dtype, inputs = fields["geometry"]
        shapes = "  ".join(f"{name}={'x'.join(map(str, [*r, length] + ([w] if w > 1 else [])))}"
                           + ("" if dtype == fields["dtype"] else f" {dtype}")
                           for name, r, length, w, dtype in inputs)
        return [("spec", str(fields["spec"])),
                ("shape", f"{shapes}  (rows {'x'.join(map(str, rows))}, N {n}, D {d}), "
                          f"{fields['dtype']}" + ("" if out_dtype == fields["dtype"] else
                                                  f", outputs {out_dtype}")),
                ("target", f"{fields['target']} on {fields['machine']}"
                           f"{', fast-math' if fields['fast_math'] else ''}")]
    except (ValueError, TypeError):  # not JSON, or not entry_key's layout
        return [("key", f"{key[:200]} (not a redfuser entry key)")]


def _record_lines(record: object, target: str | None) -> list[tuple[str, str]]:
    if not isinstance(record, dict):
        return [("record", f"{json.dumps(record)[:200]} (not a tuning record)")]
    try:
        plan = describe(read_plan(record["plan"], target))
    except (KeyError, TypeError, ValueError) as e:
        plan = f"{json.dumps(record.get('plan'))[:200]} (not a plan: {e})"
    ms, model = record.get("measured_ms"), record.get("predicted_ms")
    timing = f"{ms:.4f} ms measured" if isinstance(ms, int | float) else "no measured time"
    if isinstance(model, int | float):
        timing += f" (model {model:.4f} ms)"
    if isinstance(record.get("candidates"), int):
        timing += f", {record.get('measured')} of {record['candidates']} candidates timed"
    return [("plan", plan), ("time", timing), ("stored", str(record.get("stored", "?")))]


def merge_files(db: TuningDB, files: list[Path | str]) -> list[tuple[Path, MergeSummary]]:
    """Merge every file's records into ``db``, in order; what each brought.  Every file
    is read and checked first: one that is missing or unusable is a ``DatabaseError``
    and nothing is written.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> mine, theirs = TuningDB(tmp / "mine.json"), TuningDB(tmp / "theirs.json")
    >>> _ = theirs.put("k", {"plan": {"variant": "rolling"}, "measured_ms": 0.5})
    >>> [(path.name, str(s)[:5]) for path, s in merge_files(mine, [theirs.path, theirs.path])]
    [('theirs.json', '1 new'), ('theirs.json', '0 new')]
    """
    read = [(Path(f), read_database(f)) for f in files]
    return [(path, db.merge(entries)) for path, entries in read]
