"""The tuning database: measured best plans, one JSON file under the user's cache directory.

Where: ``$REDFUSER_CACHE`` if set, else ``$XDG_CACHE_HOME/redfuser``, else
``~/.cache/redfuser``; the file is ``tuning.json``.  An entry is keyed by the canonical
spec (the lifted cascade printed by sympy, so spacing, lets and argument order do not
matter), the geometry (rows, N, D and every input's shape), the dtype, the target, the
fast-math flag and the machine (``machine.machine_id``).  Its record holds the plan's
parameters, the measured and predicted times and how many candidates were tried.

Writes are atomic (a temporary file in the same directory, then ``os.replace``): a
reader sees the old file or the new one, never half of one.  Two writers racing may
lose one entry, never the file.  A file that is not JSON, or of another format or
version, is ignored with a warning (and replaced by the next write); it never stops a
compile.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from pathlib import Path

FORMAT = "redfuser-tuning"
VERSION = 1
FILENAME = "tuning.json"


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


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from the user's tools
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json_checked(path: Path, fmt: str, version: int) -> dict:
    """The ``entries`` of a versioned JSON file; {} (with a warning) when it is missing
    (no warning), unreadable, not JSON, or of another format or version."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        return _ignored(path, f"cannot be read ({e})")
    try:
        data = json.loads(text)
    except ValueError as e:
        return _ignored(path, f"is not valid JSON ({e.msg} at line {e.lineno})")
    if not isinstance(data, dict) or data.get("format") != fmt:
        return _ignored(path, f"is not a {fmt} file")
    if data.get("version") != version:
        return _ignored(path, f"has version {data.get('version')!r}; this redfuser reads "
                              f"version {version}")
    entries = data.get("entries")
    if not isinstance(entries, dict):
        return _ignored(path, "has no 'entries' table")
    return entries


def _ignored(path: Path, why: str) -> dict:
    warnings.warn(f"redfuser: ignoring {path}: it {why}; it will be replaced by the next "
                  "write", RuntimeWarning, stacklevel=3)
    return {}


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
    >>> db.get("k")["measured_ms"]
    1.5
    >>> tmp.cleanup()
    """

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else cache_dir() / FILENAME

    def entries(self) -> dict[str, dict]:
        """Every record by key (a corrupt or foreign file reads as empty, with a warning)."""
        return read_json_checked(self.path, FORMAT, VERSION)

    def get(self, key: str) -> dict | None:
        record = self.entries().get(key)
        return record if isinstance(record, dict) else None

    def put(self, key: str, record: dict) -> None:
        """Add or replace one record (read, update, atomic replace)."""
        with warnings.catch_warnings():  # the read already warned about a bad file, if any
            warnings.simplefilter("ignore", RuntimeWarning)
            entries = self.entries()
        entries[key] = {**record, "stored": time.strftime("%Y-%m-%dT%H:%M:%S")}
        write_json_atomic(self.path, {"format": FORMAT, "version": VERSION,
                                      "entries": entries})


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


def entry_key(rule, geo, target: str, machine: str, fast_math: bool = True,
              dtype: str = "float32") -> str:
    """The database key of one (rule, geometry, dtype, target, machine) as JSON text."""
    return json.dumps([spec_key(rule), _jsonable(geo.key()), dtype, target, machine,
                       bool(fast_math)], separators=(",", ":"))


def _jsonable(value):
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value
