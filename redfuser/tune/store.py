"""Versioned JSON files that several processes and machines share: read without trusting
them, change them under a lock, replace them atomically, never overwrite what could not be
read.

The tuning database (``db.py``) and the machine figures (``machine.py``) are each one JSON
object ``{"format": F, "version": V, "entries": {key: record}}``.

**Reading** checks, in order (``load``): the path is a regular file (``os.stat`` first, so a
FIFO, a directory or a device is refused without being opened; the open is ``O_NONBLOCK``
and re-checked with ``fstat``, so a path swapped for a FIFO in between cannot block), it
can be read, it is at most ``MAX_BYTES``, it is UTF-8, it is JSON (deep nesting included:
``RecursionError`` is a reason like any other) nested at most ``MAX_DEPTH`` levels, and it
has our format, our version and an ``entries`` table.  A file that fails a check is
*unusable*: readers see it as empty, with one warning per file and reason
(``read_entries``), and every write to it is refused with a ``DatabaseError`` naming the
file and the reason.  It may be a newer redfuser's database, or a file someone else owns:
it is not ours to replace.

**Writing** (``update``) is read-merge-write under an exclusive ``fcntl.flock`` on a
lock file next to the data (``NAME.lock``), then a temporary file and ``os.replace``.
Why a lock and not an append-only journal: with the lock the data stays one JSON
document (an export is a copy, a reader needs no lock and no replay: the rename shows it
the old file or the new one, never half of one), nothing grows without bound or needs
compacting (which would itself need a lock), and a writer holds the lock for the
milliseconds of one rewrite.  On Linux ``flock`` on NFS is carried out as a byte-range
lock the server arbitrates, so writers on several machines sharing the file exclude each
other too.  The lock file is never deleted (deleting it would let two writers lock two
different files).  A wait for the lock is bounded (``LOCK_TIMEOUT_S``): a stuck writer is
a clear error, never a hang.  A symbolic link is followed: the file it points to is
locked and replaced (a database linked into a shared directory stays shared).
"""

from __future__ import annotations

import fcntl
import inspect
import json
import os
import stat
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

MAX_BYTES = 64 << 20  # about 100,000 tuning records: more is not a database we wrote
MAX_DEPTH = 32  # our records nest 4 levels; deeper JSON is not ours (and recursion-prone)
LOCK_TIMEOUT_S = 30.0  # a rewrite holds the lock for milliseconds; 30 s means a stuck writer
LOCK_POLL_S = 0.005  # between tries of a non-blocking flock (a blocking one cannot time out)
NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))  # (test of st_mode, what the path is)


class DatabaseError(Exception):
    """A write that was refused or failed; the message names the file and why."""


@dataclass(frozen=True)
class Loaded:
    """What ``load`` found: the entries, and why the file is unusable (None: it is valid,
    or missing; ``exists`` tells which)."""

    entries: dict = field(default_factory=dict)
    problem: str | None = None
    exists: bool = False


class _Unusable(Exception):
    """A check of ``load`` failed (the message completes "the file ...")."""


def load(path: Path, fmt: str, version: int) -> Loaded:
    """Read and check ``path`` (see the module docstring); never raises.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> load(tmp / "missing.json", "f", 1)
    Loaded(entries={}, problem=None, exists=False)
    >>> _ = (tmp / "bad.json").write_bytes(b"\\xff{}")
    >>> load(tmp / "bad.json", "f", 1).problem
    'is not UTF-8 text (byte 0xff at offset 0)'
    >>> load(tmp, "f", 1).problem
    'is a directory, not a regular file'
    """
    try:
        data = _parse(_read_text(path))
        return Loaded(_checked(data, fmt, version), None, True)
    except (FileNotFoundError, NotADirectoryError):  # no such file (a parent is not a dir)
        return Loaded()
    except _Unusable as e:
        return Loaded({}, str(e), True)
    except OSError as e:
        return Loaded({}, f"cannot be read ({e.strerror or e})", True)


def _read_text(path: Path) -> str:
    kind = _not_regular(os.stat(path).st_mode)
    if kind:
        raise _Unusable(f"is {kind}, not a regular file")
    # O_NONBLOCK: should the path have become a FIFO since the stat, the open cannot wait
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    with os.fdopen(fd, "rb") as f:
        kind = _not_regular(os.fstat(fd).st_mode)
        if kind:
            raise _Unusable(f"is {kind}, not a regular file")
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise _Unusable(f"is larger than {MAX_BYTES >> 20} MiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Unusable(f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                        f"{e.start})") from None


def _kind_of(path: Path) -> str | None:
    """What ``path`` is when it is there and not a regular file (else None)."""
    try:
        return _not_regular(os.stat(path).st_mode)
    except OSError:
        return None  # missing, or not even stat-able: the locked read says which


def _not_regular(mode: int) -> str | None:
    return next((what for test, what in NOT_REGULAR if test(mode)), None)


def _parse(text: str) -> object:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Unusable(f"is not valid JSON ({e.msg} at line {e.lineno} column "
                        f"{e.colno})") from None
    except RecursionError:
        raise _Unusable("is not readable JSON (nested too deeply for the decoder)") from None
    except ValueError as e:  # e.g. an integer literal beyond Python's digit limit
        raise _Unusable(f"is not readable JSON ({e})") from None
    if _depth(data) > MAX_DEPTH:
        raise _Unusable(f"nests JSON deeper than {MAX_DEPTH} levels")
    return data


def _depth(data: object) -> int:
    """The nesting depth of parsed JSON (iterative: no recursion limit to hit)."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        value, level = todo.pop()
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            break
        children = value.values() if isinstance(value, dict) else \
            value if isinstance(value, list) else ()
        todo += [(v, level + 1) for v in children]
    return deepest


def _checked(data: object, fmt: str, version: int) -> dict:
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise _Unusable(f"is not a {fmt} file")
    found = data.get("version")
    if type(found) is not int or found != version:  # 1.0 and true are not version 1
        newer = type(found) is int and found > version
        raise _Unusable(f"has version {found!r}" + (", written by a newer redfuser"
                                                    if newer else "") +
                        f"; this redfuser reads version {version}")
    entries = data.get("entries")
    if not isinstance(entries, dict):
        raise _Unusable("has no 'entries' table")
    return entries


PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep  # redfuser's own files


def user_level() -> int:
    """The ``stacklevel`` that makes a warning name the first line outside redfuser (the
    user's call, not ours), for a ``warnings.warn`` in the function calling this one.

    Examples
    --------
    >>> user_level()  # called from outside redfuser: the caller itself
    1
    """
    frame, level = inspect.currentframe().f_back, 1
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


_WARNED: set[tuple[str, str]] = set()  # (file, reason) already reported by this process


def read_entries(path: Path, fmt: str, version: int) -> dict:
    """The entries of ``path``; {} for a missing file, and for an unusable one with a
    ``RuntimeWarning`` naming the file and the reason (once per file and reason).

    Examples
    --------
    >>> import tempfile, pathlib, warnings
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.json"
    >>> _ = path.write_text('{"format": "f", "version": 9, "entries": {}}')
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     print(read_entries(path, "f", 1), read_entries(path, "f", 1))
    {} {}
    >>> [str(w.message).split(": it ")[1][:38] for w in caught]  # once
    ['has version 9, written by a newer redf']
    """
    found = load(path, fmt, version)
    if found.problem is not None:
        warn_unusable(path, found.problem)
    return found.entries


def warn_unusable(path: Path, problem: str) -> None:
    """Say once per process that ``path`` is ignored (and will not be written); see
    ``read_entries``."""
    if (str(path), problem) in _WARNED:
        return
    _WARNED.add((str(path), problem))
    warnings.warn(f"redfuser: ignoring {path}: it {problem}; it is left as it is (writes "
                  "to it are refused)", RuntimeWarning, stacklevel=user_level())


def _refusal(path: Path, problem: str) -> str:
    """The message of a write refused because ``path`` is unusable."""
    return (f"refusing to write {path}: it {problem}; it was left untouched (move it away "
            "or point REDFUSER_CACHE at another directory)")


def update(path: Path, fmt: str, version: int,
           change: Callable[[dict], dict]) -> dict:
    """Under the lock: read ``path``'s entries, apply ``change`` (entries -> new entries),
    write the result atomically (when it differs) and return it.

    Raises ``DatabaseError`` when the file is unusable or cannot be written.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.json"
    >>> update(path, "f", 1, lambda e: {**e, "a": 1})
    {'a': 1}
    >>> update(path, "f", 1, lambda e: {**e, "b": 2})
    {'a': 1, 'b': 2}
    """
    real = Path(os.path.realpath(path))
    kind = _kind_of(real)
    if kind:  # refused before a lock file is made next to a device, FIFO or directory
        raise DatabaseError(_refusal(path, f"is {kind}, not a regular file"))
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        with _locked(real):
            now = load(real, fmt, version)
            if now.problem is not None:
                raise DatabaseError(_refusal(path, now.problem))
            new = change(dict(now.entries))
            if new != now.entries or not now.exists:
                write_json_atomic(real, {"format": fmt, "version": version, "entries": new})
            return new
    except OSError as e:
        raise DatabaseError(f"cannot write {path}: {e.strerror or e}") from None


@contextmanager
def _locked(path: Path):
    """Hold an exclusive flock on ``path``'s lock file (read-only suffices for flock, so
    a lock file another user created still works)."""
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o666)
    try:
        kind = _not_regular(os.fstat(fd).st_mode)
        if kind:
            raise DatabaseError(f"cannot lock {path}: its lock file {lock} is {kind}")
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DatabaseError(f"{path} stayed locked by another writer ({lock}) for "
                                        f"{LOCK_TIMEOUT_S:.0f} s") from None
                time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace`` (the file's
    mode is kept; a new file gets 0644: mkstemp's 0600 would hide it from the user's tools).
    Callers that share the file hold the lock (``update``).

    Examples
    --------
    >>> import tempfile, pathlib, json
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.json"
    >>> write_json_atomic(path, {"a": 1})
    >>> json.loads(path.read_text())
    {'a': 1}
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def write_json_new(path: Path, data: dict) -> None:
    """Write ``data`` to a new file ``path``; ``DatabaseError`` if anything is there (an
    export never replaces a file).

    Examples
    --------
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.json"
    >>> write_json_new(path, {"a": 1})
    >>> try:
    ...     write_json_new(path, {"b": 2})
    ... except DatabaseError as e:
    ...     print(str(e).split(";")[0].endswith("t.json already exists"))
    True
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise DatabaseError(f"{path} already exists; it was left untouched (choose a new "
                            f"name, or fold into it: redfuser db import DB --db {path})") \
            from None
    except OSError as e:
        raise DatabaseError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        os.unlink(path)  # ours: created above, and only half written
        if isinstance(e, OSError):
            raise DatabaseError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (a crash right after it must not bring back the old file)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some file systems do not open directories: the rename still happened
    try:
        os.fsync(fd)
    except OSError:
        pass  # likewise (e.g. some network file systems refuse fsync on a directory)
    finally:
        os.close(fd)
