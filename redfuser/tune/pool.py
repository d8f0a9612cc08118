"""Timing candidates on a pool of devices through TVM's RPC tracker.

A ``DevicePool`` connects to the tracker (bounded by ``connect_timeout``: a tracker that
cannot be reached is a ``PoolError`` at once), asks its summary how many devices of the
key are free and takes a session on each: one worker thread per device, each holding its
session for the pool's life.  ``measurer(rule)`` is what the search (``search.tune``)
times a round with: each candidate is built here for the remote target, written with
``export_library`` (a ``.so`` linked here; for a target of another architecture a
``.tar`` of objects that the remote links, or a ``.so`` linked by ``cross_cc``), handed to
an idle worker, uploaded, loaded and timed on the device by TVM's ``time_evaluator``.

The target defaults to what the devices say they are (their CPU's LLVM name and triple);
``target`` (a TVM target dict) overrides it, and must be given for devices whose TVM
runtime has no compiler to ask.  Results are stored under the pool's ``identity``
(``rpc:KEY/TARGET/N threads``), not this machine's; ``compile`` on the device reads them
where ``REDFUSER_MACHINE`` is set to it (``machine.machine_id``).

What a failed measurement costs (``FAULTS``): see ``_fault``.  The search finishes
whatever happens: a round always gets one outcome per candidate.
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..lowering import FUNC_NAME, Geometry, Plan
from ..lowering.backends import backend_of_kind, build_kinds
from ..runtime import allocate_outputs, build, export, random_inputs
from ..tvm.rpc import (
    remote_device,
    remote_load,
    remote_tensors,
    remote_time_ms,
    rpc_alive,
    rpc_device_info,
    rpc_tracker,
)
from ..tvm.target import host_triple
from .measure import Measurer, Outcome, first_line
from .space import plan_params

CONNECT_TIMEOUT_S = 10.0  # a tracker answers within milliseconds: 10 s means it is not there
# One measurement is an upload, a load and `repeat` runs of >= 1 ms (seconds for the largest
# kernels); a device that has not answered in a minute hangs.
MEASURE_TIMEOUT_S = 60.0
RETRIES = 1  # a candidate whose device failed is tried on one other device
JOIN_S = 5.0  # closing: how long a worker may take to finish its call and drop its session
# What a failed measurement means: (the device still answers?, what happens)
FAULTS = {True: "the candidate failed there (its own error): recorded with the reason",
          False: "the device is dropped from the pool and the candidate retried on another "
                 f"({RETRIES} retry), else recorded as failed with every reason"}


class PoolError(Exception):
    """The pool cannot measure: no tracker, no device of the key, no usable target."""


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ``PoolError`` naming what is wrong.

    Examples
    --------
    >>> parse_address("127.0.0.1:9190")
    ('127.0.0.1', 9190)
    >>> try:
    ...     parse_address("tracker")
    ... except PoolError as e:
    ...     print(e)
    the tracker address must be HOST:PORT (e.g. 127.0.0.1:9190), not 'tracker'
    """
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PoolError(f"the tracker address must be HOST:PORT (e.g. 127.0.0.1:9190), not "
                        f"{text!r}")
    return host, int(port)


def target_text(target: dict) -> str:
    """A TVM target dict as canonical text (what an identity names).

    Examples
    --------
    >>> target_text({"mcpu": "znver5", "kind": "llvm"})
    '{"kind":"llvm","mcpu":"znver5"}'
    """
    return json.dumps(target, sort_keys=True, separators=(",", ":"))


@dataclass
class _Job:
    index: int  # in the round
    plan: Plan
    path: str = ""  # the exported library
    failed: list[str] = field(default_factory=list)  # "device: why" of each device lost


class _Worker:
    """One device: a thread holding one session, timing the jobs put in its inbox.  It
    keeps every library it loaded (a path is loaded once per session) and the round's
    inputs on the device (copied once per round)."""

    def __init__(self, session, address: str, results: queue.Queue):
        self.session, self.address, self.results = session, address, results
        self.modules: dict[str, object] = {}  # library path -> loaded remote module
        self.arrays: list | None = None  # the round whose inputs ``tensors`` hold
        self.tensors: list = []
        self.inbox: queue.Queue = queue.Queue()
        self.deadline = 0.0
        self.lost = ""  # why the device was dropped ("": it is in the pool)
        self.thread = threading.Thread(target=self._serve, name=f"redfuser rpc {address}",
                                       daemon=True)  # daemon: a hung device must not block exit
        self.thread.start()

    def _serve(self) -> None:
        while (item := self.inbox.get()) is not None:
            job, target, arrays, repeat = item
            try:
                self.results.put((self, job, self._time(job.path, target, arrays, repeat), "",
                                  True))
            except Exception as e:  # noqa: BLE001 - whatever the remote raised, it answers
                self.results.put((self, job, None, first_line(e), rpc_alive(self.session)))
        self.modules, self.tensors = {}, []  # freed before the session that holds them
        self.session = None  # drops the connection: the server takes its next client

    def _time(self, path: str, target: dict, arrays: list, repeat: int) -> float:
        dev = remote_device(self.session, target)
        if path not in self.modules:
            self.modules[path] = remote_load(self.session, path)
        if self.arrays is not arrays:
            self.tensors, self.arrays = remote_tensors(arrays, dev), arrays
        return remote_time_ms(self.modules[path], FUNC_NAME, dev, self.tensors, repeat)


class DevicePool:
    """Sessions on every free device of ``key`` at the tracker ``tracker`` ("HOST:PORT").

    ``target``: the TVM target to build for (default: what the devices report);
    ``timeout``: seconds one measurement may take; ``cross_cc``: the linker for a target
    of another architecture (default: the devices link); ``on_result(device, plan, ms)``
    is called after each measurement.  Use it as a context manager (``close``).
    """

    def __init__(self, tracker: str, key: str, target: dict | None = None,
                 timeout: float = MEASURE_TIMEOUT_S, cross_cc: str | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT_S,
                 on_result: Callable[[str, Plan, float], None] | None = None):
        self.address, self.key, self.timeout = tracker, key, timeout
        self.cross_cc, self.on_result = cross_cc, on_result
        self.counts: Counter[str] = Counter()  # measurements per device
        self._results: queue.Queue = queue.Queue()
        self._tracker = _connect(tracker, connect_timeout)
        try:
            sessions = _sessions(self._tracker, key, tracker, connect_timeout)
            info = _describe(sessions[0], key)
            self.target = resolve_target(target, info.cpu, info.triple, key)
        except BaseException:
            self._tracker.close()
            raise
        self.threads = info.threads
        self.backend = backend_of_kind(self.target["kind"]).name
        self.workers = [_Worker(s, a, self._results) for s, a in sessions]
        self._dir = tempfile.TemporaryDirectory(prefix="redfuser-rpc-")
        self._built = 0

    @property
    def identity(self) -> str:
        """The machine the pool's measurements belong to (records are stored under it)."""
        return f"rpc:{self.key}/{target_text(self.target)}/{self.threads} threads"

    @property
    def devices(self) -> list[str]:
        """Every device the pool started with ("host:port")."""
        return [w.address for w in self.workers]

    @property
    def lost(self) -> dict[str, str]:
        """Devices dropped from the pool, with the reason."""
        return {w.address: w.lost for w in self.workers if w.lost}

    def measurer(self, rule) -> Measurer:
        """What ``search.tune`` times ``rule``'s candidates with (``where=``)."""
        libraries: dict[tuple, str] = {}  # this rule's builds: (geometry, plan) -> library

        def run(geo: Geometry, plans: list[Plan], repeat: int, done: Callable[[], None]):
            arrays = random_inputs(rule, geo) + list(allocate_outputs(rule, geo).values())

            def library(plan: Plan) -> str:
                key = (geo.key(), tuple(plan_params(plan).items()), plan.fast_math)
                if key not in libraries:
                    libraries[key] = self._export(build(rule, geo, plan, self.backend,
                                                        self.target))
                return libraries[key]

            return self._round(plans, library, arrays, repeat, done)

        return Measurer(run, self.identity, self.threads)

    def _export(self, built) -> str:
        cross = self.target.get("mtriple", host_triple()) != host_triple()
        suffix = ".tar" if cross and not self.cross_cc else ".so"
        self._built += 1  # a fresh name each: the remote's loader caches a library by path
        path = os.path.join(self._dir.name, f"candidate{self._built}{suffix}")
        export(built, path, self.cross_cc)
        return path

    def _round(self, plans, library, arrays, repeat, done) -> list[Outcome]:
        """Time every plan on the pool's devices in parallel; one outcome per plan."""
        out: list[Outcome | None] = [None] * len(plans)

        def finish(job: _Job, outcome: Outcome) -> None:
            out[job.index] = outcome
            done()

        pending = deque(_Job(k, p) for k, p in enumerate(plans))
        busy: dict[_Worker, _Job] = {}
        while pending or busy:
            self._dispatch(pending, busy, library, (arrays, repeat), finish)
            if not busy:  # every device is lost: what is left fails with the reasons
                while pending:
                    job = pending.popleft()
                    finish(job, Outcome(None, "; ".join(job.failed) or "no device left in "
                                        f"the pool ({self._lost_text()})"))
                break
            ahead = next((j for j in pending if not j.path), None)
            if ahead is not None and not _built(ahead, library, finish):
                pending.remove(ahead)  # built while the devices measure; failed: its own
            self._wait(busy, pending, finish)
        return out

    def _dispatch(self, pending: deque, busy: dict, library, args, finish) -> None:
        """Give each idle device the next job (built first; a build failure is the
        candidate's own)."""
        for worker in self.workers:
            while pending and not worker.lost and worker not in busy:
                job = pending.popleft()
                if not _built(job, library, finish):
                    continue
                worker.deadline = time.monotonic() + self.timeout
                worker.inbox.put((job, self.target, *args))
                busy[worker] = job

    def _wait(self, busy: dict, pending: deque, finish) -> None:
        """Take the next answer, or drop the devices past their deadline."""
        wait = max(0.0, min(w.deadline for w in busy) - time.monotonic())
        try:
            worker, job, ms, error, answers = self._results.get(timeout=wait)
        except queue.Empty:
            now = time.monotonic()
            for w in [w for w in busy if w.deadline <= now]:
                self._fault(w, busy.pop(w), f"no answer within {self.timeout:g} s", False,
                            pending, finish)
            return
        if worker.lost or busy.get(worker) is not job:
            return  # a late answer from a device already dropped: its job went elsewhere
        del busy[worker]
        if ms is None:
            self._fault(worker, job, error, answers, pending, finish)
            return
        self.counts[worker.address] += 1
        finish(job, Outcome(ms, "", worker.address))
        if self.on_result is not None:
            self.on_result(worker.address, job.plan, ms)

    def _fault(self, worker: _Worker, job: _Job, why: str, answers: bool, pending: deque,
               finish) -> None:
        """``FAULTS[answers]``: a device that still answers failed the candidate; one that
        does not is dropped and the candidate retried elsewhere, at most RETRIES times."""
        if answers:
            finish(job, Outcome(None, why, worker.address))
            return
        worker.lost = why
        worker.inbox.put(None)  # its thread ends (and drops its session) once the call returns
        job.failed.append(f"device {worker.address} lost ({why})")
        if len(job.failed) > RETRIES:
            finish(job, Outcome(None, "; ".join(job.failed)))
        else:
            pending.appendleft(job)

    def _lost_text(self) -> str:
        return "; ".join(f"{a}: {why}" for a, why in self.lost.items())

    def close(self) -> None:
        """End every session (a device that hangs is left to its daemon thread)."""
        working = [w for w in self.workers if not w.lost]
        for w in working:
            w.lost = "closed"
            w.inbox.put(None)
        for w in working:  # idle: each drops its session at once
            w.thread.join(JOIN_S)
        self._tracker.close()
        self._dir.cleanup()

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _built(job: _Job, library, finish) -> bool:
    """Build and export the job's candidate once; False (and the job finished as failed)
    when it does not build."""
    try:
        job.path = job.path or library(job.plan)
        return True
    except Exception as e:  # noqa: BLE001 - it does not build: the candidate's own failure
        finish(job, Outcome(None, f"build: {first_line(e)}"))
        return False


def _connect(address: str, timeout: float):
    host, port = parse_address(address)
    try:
        return rpc_tracker(host, port, timeout)
    except (OSError, RuntimeError) as e:
        why = "no answer" if isinstance(e, TimeoutError) else first_line(e)
        raise PoolError(f"cannot reach the RPC tracker at {address} within {timeout:g} s "
                        f"({why}); start one with: python -m tvm.exec.rpc_tracker --host "
                        f"{host} --port {port}") from None


def _sessions(tracker, key: str, address: str, timeout: float) -> list[tuple]:
    """A session on every free device of ``key`` (at least one: waiting ``timeout`` for a
    busy one); ``PoolError`` when the tracker has none."""
    free, registered, keys = tracker.devices(key)
    if registered == 0 and free == 0:
        raise PoolError(f"the tracker at {address} knows no device with key {key!r} (keys "
                        f"it knows: {', '.join(keys) or 'none'}); start one with: python -m "
                        f"tvm.exec.rpc_server --tracker {address} --key {key}")
    got = []
    for _ in range(max(free, 1)):
        try:
            got.append(tracker.request_device(key))
        except (OSError, RuntimeError) as e:
            if not got:
                raise PoolError(f"none of the {registered} device(s) with key {key!r} at "
                                f"{address} became free within {timeout:g} s "
                                f"({first_line(e)})") from None
            break
    return got


def _describe(session: tuple, key: str):
    try:
        return rpc_device_info(session[0])
    except Exception as e:  # noqa: BLE001 - TVM raises its own error classes
        raise PoolError(f"device {session[1]} (key {key!r}) does not answer: "
                        f"{first_line(e)}") from None


def resolve_target(target: dict | None, cpu: str | None, triple: str | None,
                   key: str) -> dict:
    """The TVM target to build for: ``target`` when given (checked), else the devices'
    own CPU (with their triple when it is not this machine's: cross-compiled).

    Examples
    --------
    >>> resolve_target(None, "cortex-a72", "aarch64-unknown-linux-gnu", "rpi")["mtriple"]
    'aarch64-unknown-linux-gnu'
    >>> resolve_target({"kind": "opencl"}, None, None, "phone")
    Traceback (most recent call last):
    ...
    redfuser.tune.pool.PoolError: target kind 'opencl' is not one redfuser builds for (llvm, cuda)
    """
    if target is not None:
        kind = target.get("kind") if isinstance(target, dict) else target
        if not isinstance(target, dict) or not kind or backend_of_kind(kind) is None:
            raise PoolError(f"target kind {kind!r} is not one redfuser builds for "
                            f"({', '.join(build_kinds())})")
        return dict(target)
    if cpu is None:
        raise PoolError(f"the devices with key {key!r} run a TVM runtime without a compiler, "
                        "so they cannot say what CPU they are: give the target (e.g. --target "
                        "'{\"kind\": \"llvm\", \"mcpu\": \"cortex-a72\", \"mtriple\": "
                        "\"aarch64-linux-gnu\"}')")
    found = {"kind": "llvm", "mcpu": cpu}
    if triple and triple != host_triple():
        found["mtriple"] = triple
    return found
