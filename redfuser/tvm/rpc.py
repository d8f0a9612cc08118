"""Measuring on other machines through TVM's tracker (``redfuser.tune.pool``).

0.27: tvm.rpc.connect_tracker(host, port) -> TrackerSession (.summary(), .request(key));
RPCSession.upload / load_module / cpu() / cuda(); a remote module's time_evaluator times on
the remote device.  TVM's tracker client retries a refused connect for 60 s and then waits
without limit for every answer, so the tracker client here bounds each socket operation.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import rpc
from tvm.rpc import base as rpc_base
from tvm.support import cc as tvm_cc

from .runtime import MIN_REPEAT_MS


class _Tracker(rpc.TrackerSession):
    """TVM's tracker client on a socket whose every operation times out after ``timeout``
    seconds, and a request that returns the device's address with its session."""

    def __init__(self, addr: tuple[str, int], timeout: float):
        self._timeout = timeout
        super().__init__(addr)

    def _connect(self) -> None:
        # TrackerSession._connect's handshake, on a socket that cannot wait forever
        self._sock = socket.create_connection(self._addr, timeout=self._timeout)
        self._sock.sendall(struct.pack("<i", rpc_base.RPC_TRACKER_MAGIC))
        magic = struct.unpack("<i", rpc_base.recvall(self._sock, 4))[0]
        if magic != rpc_base.RPC_TRACKER_MAGIC:
            raise RuntimeError(f"{self._addr[0]}:{self._addr[1]} answers, but is not a TVM "
                               "RPC tracker")

    def devices(self, key: str) -> tuple[int, int, list[str]]:
        """(free devices of ``key``, devices of ``key`` registered, every key the tracker
        knows) from the tracker's summary."""
        summary = self.summary()
        keys = [s.get("key", "").partition(":")[2] for s in summary["server_info"]]
        free = summary["queue_info"].get(key, {}).get("free", 0)
        return int(free), keys.count(key), sorted(set(keys) | set(summary["queue_info"]))

    def request_device(self, key: str, session_timeout: float = 0):
        """(session, "host:port") of a free device of ``key`` (what TrackerSession.request
        does, keeping the address the tracker answered); waits at most the timeout."""
        if self._sock is None:
            self._connect()
        try:
            rpc_base.sendjson(self._sock, [rpc_base.TrackerCode.REQUEST, key, "", 1])
            value = rpc_base.recvjson(self._sock)
        except OSError:
            self.close()  # an answer may still arrive: this stream is out of step now
            raise
        if value[0] != rpc_base.TrackerCode.SUCCESS:
            raise RuntimeError(f"the tracker refused a request for {key!r}: {value}")
        url, port, matchkey = value[1]
        return rpc.connect(url, port, matchkey, session_timeout), f"{url}:{port}"


def rpc_tracker(host: str, port: int, timeout: float) -> _Tracker:
    """A client of the RPC tracker at ``host:port`` (``OSError`` or ``RuntimeError`` when
    it cannot be reached within ``timeout`` seconds or is not a tracker)."""
    return _Tracker((host, port), timeout)


@dataclass(frozen=True)
class RemoteInfo:
    """What a device says about itself (None: its TVM runtime has no compiler to ask)."""

    cpu: str | None
    triple: str | None
    threads: int


def rpc_device_info(session) -> RemoteInfo:
    """The remote CPU's LLVM name and triple (servers running the whole of TVM have them)
    and the threads of its runtime (TVM_NUM_THREADS where the server was started)."""
    def ask(name: str):
        try:
            return str(session.get_function(name)())
        except (AttributeError, RuntimeError):  # a runtime-only server: no codegen there
            return None

    threads = int(session.get_function("runtime.NumThreads")())
    return RemoteInfo(ask("target.llvm_get_system_cpu"), ask("target.llvm_get_system_triple"),
                      threads)


def rpc_alive(session) -> bool:
    """Does the session still answer (a cheap round trip)?"""
    try:
        session.get_function("runtime.NumThreads")()
        return True
    except Exception:  # noqa: BLE001 - a dead connection raises TVM's own error classes
        return False


def export_library(executable, path: str, cross_cc: str | None = None) -> None:
    """Write a CPU executable as a library a remote can load: ``path`` ending ``.so`` is
    linked here (by ``cross_cc``, e.g. ``aarch64-linux-gnu-g++``, for another machine),
    ``.tar`` holds the object files, which the remote links when it loads them."""
    fcompile = tvm_cc.cross_compiler(cross_cc) if cross_cc else None
    executable.export_library(path, fcompile=fcompile)


def remote_device(session, target: dict):
    """Device 0 of ``session`` of the kind of device ``target`` builds for (TVM's own map)."""
    return session.device(tvm.target.Target(target).get_target_device_type(), 0)


def remote_load(session, path: str):
    """Upload the library at ``path`` and load it on the remote.  Load each file once per
    session and keep the module: loading one path a second time crashes the session."""
    session.upload(path)
    return session.load_module(os.path.basename(path))


def remote_tensors(arrays: list, dev) -> list:
    """Copies of numpy ``arrays`` on the remote device ``dev``."""
    return [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in arrays]


def remote_time_ms(module, name: str, dev, tensors: list, repeat: int) -> float:
    """Median milliseconds of one call of ``module[name]`` on remote ``tensors`` (after
    one warm-up call), timed on the device by TVM's evaluator."""
    module[name](*tensors)
    timer = module.time_evaluator(name, dev, number=1, repeat=repeat,
                                  min_repeat_ms=MIN_REPEAT_MS)
    return float(timer(*tensors).median) * 1e3
