"""Tuning over a device pool through TVM's RPC tracker, and tuning whole models.

A tracker and two servers run on 127.0.0.1 as subprocesses on free ports (each in its own
process group, stopped in the fixture's finalizer, none left behind).  The servers are
started with torch hidden from them (a stub package first on PYTHONPATH): tvm_ffi imports
torch when it can, which costs 5-10 s per process on these machines and a server is two
processes; they only load and time kernels.  Tests that break a server run last.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import redfuser
from redfuser.cli import main
from redfuser.relax import build, run
from redfuser.relax.tuning import cascades
from redfuser.tune import TuningDB, machine_id, shape_geometry, tune
from redfuser.tune.machine import IDENTITY_ENV, nominal_cpu
from redfuser.tune.pool import DevicePool, PoolError
from redfuser.tune.search import record_plan
from redfuser.tune.space import same_plan
from redfuser.tvm.graph import relax, save_ir_module
from redfuser.tvm.rpc import rpc_tracker
from tests.support import assert_matches, rule_for

START_S = 120  # bound on the tracker's and servers' start (two TVM imports each, busy cores)
HUNG_S = 6.0  # a measurement here takes well under a second: 8 s without an answer is a hang
KEY = "cpu"
machine_module = importlib.import_module("redfuser.tune.machine")  # the module, not machine()


class LocalPool:
    """A tracker and RPC servers on 127.0.0.1, each process in its own group."""

    def __init__(self, stub_dir):
        stub = stub_dir / "torch"
        stub.mkdir()
        (stub / "__init__.py").write_text('raise ImportError("hidden from this RPC server")\n')
        self.env = {**os.environ, "PYTHONPATH": str(stub_dir)}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self._start("tvm.exec.rpc_tracker", "--port", str(self.port), "--port-end",
                    str(self.port + 1))
        self.servers: dict[str, subprocess.Popen] = {}  # "host:port" -> process

    def _start(self, module: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", *args,
                                 "--silent"], env=self.env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def add_server(self) -> str:
        port = free_port()
        self.servers[f"127.0.0.1:{port}"] = self._start(
            "tvm.exec.rpc_server", "--tracker", self.address, "--key", KEY, "--port",
            str(port), "--port-end", str(port + 1))
        return f"127.0.0.1:{port}"

    def wait_free(self, count: int, timeout: float = START_S) -> None:
        """Until the tracker lists ``count`` free servers of KEY (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                tracker = rpc_tracker("127.0.0.1", self.port, 2.0)
                try:
                    if tracker.devices(KEY)[0] >= count:
                        return
                finally:
                    tracker.close()
            except (OSError, RuntimeError):
                pass  # not listening yet
            time.sleep(0.2)
        raise TimeoutError(f"{count} free server(s) not up within {timeout} s")

    def signal(self, device: str, sig: int) -> None:
        os.killpg(self.servers[device].pid, sig)

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            proc.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    local = LocalPool(tmp_path_factory.mktemp("stub"))
    try:
        local.add_server()
        local.add_server()
        local.wait_free(2)
        yield local
    finally:
        local.close()
        assert all(group_gone(p.pid) for p in local.procs), "a server process was left"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REDFUSER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(IDENTITY_ENV, raising=False)
    monkeypatch.setattr(machine_module, "measure_cpu", nominal_cpu)  # no 10 s calibration


SOFTMAX = {"x": (8, 256)}


def test_tuning_over_the_pool_uses_both_servers_and_stores_the_remote_identity(pool, capsys,
                                                                              monkeypatch):
    pool.wait_free(2)
    code = main(["tune", "softmax", "--shape", "x=8x256", "--rpc", pool.address, "--key",
                 KEY, "--variant", "rolling", "--top", "2", "--repeat", "2", "--rounds", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    counts = dict(part.rsplit(" ", 1) for part in
                  out.split("measurements per device: ")[1].splitlines()[0].split(", "))
    assert set(counts) == set(pool.servers) and all(int(c) > 0 for c in counts.values())
    identity = out.split("identity: ")[1].splitlines()[0]
    assert identity.startswith(f"rpc:{KEY}/") and identity != machine_id()
    (key, record), = TuningDB().entries().items()
    assert json.loads(key)[4] == identity  # stored under the devices, not this machine
    rule, x = rule_for("softmax"), np.random.default_rng(0).normal(size=(8, 256))
    x = x.astype(np.float32)
    assert "tuned" not in redfuser.compile(rule).prepare(x=x).plan.reason  # not ours
    monkeypatch.setenv(IDENTITY_ENV, identity)  # undone after the test
    kernel = redfuser.compile(rule)
    assert_matches(kernel(x=x)["y"], redfuser.reference("softmax", {"x": x})["y"], 1e-5, 1e-7)
    assert kernel.plan == record_plan(record, rule, shape_geometry(rule, SOFTMAX))
    assert kernel.plan.reason.startswith("tuned")


def faulty_search(pool: LocalPool, sig: int):
    """Tune with a hook that sends ``sig`` to the server of the first result."""
    hit = []

    def hook(device, plan, ms):
        if not hit:
            hit.append(device)
            pool.signal(device, sig)

    pool.wait_free(2)
    rule = rule_for("softmax")
    geo = shape_geometry(rule, SOFTMAX)
    with DevicePool(pool.address, KEY, timeout=HUNG_S, on_result=hook) as devices:
        result = tune(rule, geo, top=3, repeat=1, rounds=1, variants=("rolling",),
                      where=devices.measurer(rule), figures=nominal_cpu(), progress=False)
        lost, counts = devices.lost, dict(devices.counts)
    return rule, geo, result, hit[0], lost, counts


def assert_finished(rule, geo, result, hit, lost, counts, why):
    assert list(lost) == [hit] and why in lost[hit]
    chosen = [t for t in result.trials if t.measured_ms is not None or t.error]
    assert all(t.measured_ms is not None for t in chosen), [t.error for t in chosen]
    assert counts[hit] == 1 and sum(counts.values()) == len(chosen)  # the rest elsewhere
    assert same_plan(record_plan(TuningDB().get(result.key), rule, geo), result.best)


def test_a_server_that_hangs_mid_search_loses_only_its_candidate(pool):
    found = faulty_search(pool, signal.SIGSTOP)
    try:
        assert_finished(*found, why=f"no answer within {HUNG_S:g} s")
    finally:
        pool.signal(found[3], signal.SIGCONT)  # its session ends: it serves the next test


def test_a_server_killed_mid_search_loses_only_its_candidate(pool):
    found = faulty_search(pool, signal.SIGKILL)
    assert_finished(*found, why="Error")


def test_an_unreachable_tracker_is_a_clear_error_at_once(pool, capsys):
    start = time.monotonic()
    with pytest.raises(PoolError, match=r"cannot reach the RPC tracker at 127\.0\.0\.1:\d+ "
                                        r"within 10 s \(ConnectionRefusedError"):
        DevicePool(f"127.0.0.1:{free_port()}", KEY)
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with pytest.raises(PoolError, match="within 1 s .no answer"):
            DevicePool(f"127.0.0.1:{silent.getsockname()[1]}", KEY, connect_timeout=1.0)
    assert time.monotonic() - start < 5
    with pytest.raises(PoolError, match="knows no device with key 'gpu'"):
        DevicePool(pool.address, "gpu", connect_timeout=5.0)
    assert main(["tune", "softmax", "--rpc", "nowhere", "--key", KEY]) == 1
    out = capsys.readouterr()
    assert "HOST:PORT" in out.err and "schedule space" not in out.out
    assert main(["tune", "softmax", "--rpc", pool.address]) == 2  # --key missing


def tiny_model():
    """A softmax and a layer norm, each its own kernel."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((16, 128), "float32"))
    gamma, beta = (relax.const(np.full(128, v, np.float32)) for v in (1.5, 0.25))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.nn.softmax(x))
            c = bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[-1]))
            y = bb.emit_output(relax.Tuple([a, c]))
        bb.emit_func_output(y)
    return bb.get()


def test_whole_model_tuning_stores_every_cascade_and_later_builds_use_it(tmp_path, capsys):
    mod = tiny_model()
    path = str(tmp_path / "tiny.json")
    save_ir_module(mod, path)
    assert len(cascades(mod)) == 2
    _, before = build(mod)
    assert not any("tuned" in g.reason for g in before.groups)  # nothing tuned yet
    assert main(["tune", "--model", path, "--variant", "rolling", "--top", "1", "--repeat",
                 "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 distinct cascade(s)" in out and "later builds of this model" in out
    assert len(TuningDB().entries()) == 2
    ex, report = build(mod)
    assert report.fused == 2 and all("tuned" in g.reason for g in report.groups)
    x = np.random.default_rng(2).normal(size=(16, 128))
    soft = np.exp(x - x.max(-1, keepdims=True))
    norm = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    got = run(ex, x.astype(np.float32))
    for out_, want in zip(got, [soft / soft.sum(-1, keepdims=True), 1.5 * norm + 0.25],
                          strict=True):
        assert_matches(out_, want, 1e-5, 1e-5)  # float32 kernels vs the float64 formula
