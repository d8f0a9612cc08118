"""The machine figures the cost model reads, measured once per machine and cached.

Every figure is measured with redfuser's own generated kernels, so it is what a kernel
sees (the L3 here is hundreds of MB: a numpy copy of a "large" buffer measures cache
bandwidth, and so would our kernels; measuring with them keeps the model honest):

- ``bandwidth``: bytes/s of a one-pass ``sum(x[i])`` (16 lanes, every thread) at three
  working-set sizes (in L2, in L3, beyond), interpolated in log size by ``bandwidth_at``.
- ``vec_op`` / ``vec_exp``: seconds per element and thread of one arithmetic operation /
  one (fast-math) transcendental call in 16 vector lanes, from ``sum(poly(x))`` and
  ``sum(exp(x))`` against ``sum(x)`` on data in cache.
- ``scalar_op`` / ``scalar_exp``: the same in one lane (independent elements overlap).
- ``wide_op``: seconds per element, feature slot and operation of a one-lane fold over
  feature vectors (``sum(x[i] * v[i, :])``: the slots' loads, multiply-adds and state
  loads and stores; attention's and a GEMM's inner loops).
- ``chain_op``: seconds per step of a dependent chain through a state (``sum(x[i])`` in
  one lane: each add waits for the previous one): what a fold's recurrence costs.
- ``launch``: seconds of a call that does almost nothing (thread-pool wake-up).

Cached in ``cache_dir() / "machine.json"`` keyed by ``local_id`` (CPU name, cores,
threads), through ``store`` (locked, atomic).  When the figures cannot be cached (the
directory is not writable; the file is unusable: corrupt, foreign, of a newer version,
and then left as it is) they are measured, used for the rest of the process, and one
warning says so: tuning and ``compile(tune="model")`` never fail for want of a cache.
CUDA figures are nominal (from the architecture) unless measured on the device.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import asdict, dataclass

import numpy as np

from algebra import derive

from ..lowering import backend, shape_geometry
from ..lowering.cpu.plan import FOLD_LANES, LANES, TILE_ELEMENTS, CpuPlan
from ..runtime import allocate_outputs, build, random_inputs, time_built
from ..tvm.target import default_threads
from .db import cache_dir
from .store import DatabaseError, load, update, user_level, warn_unusable
from .work import element_work

FORMAT, VERSION, FILENAME = "redfuser-machine", 1, "machine.json"
MB = 1 << 20
# (bytes of x, rows): in L2, in L3, beyond the L3 of most machines
BANDWIDTH_POINTS = ((1 * MB, 64), (16 * MB, 1024), (128 * MB, 8192))
POLY = "s = sum(x[i]*(x[i]*(x[i]*(x[i]*(x[i] + 1) + 2) + 3) + 4))"  # op-heavy, no calls
WIDE = "o = sum(x[i] * v[i, :])"  # a feature-axis fold: 5 slot operations (cost.py counts)
WIDE_SHAPE = (32, 256, 64)  # 2 MB of v: in the L2 caches


@dataclass(frozen=True)
class Machine:
    """Measured figures of one machine (see the module docstring for each)."""

    name: str
    threads: int
    bandwidth: tuple[tuple[float, float], ...]  # (working-set bytes, bytes/s), ascending
    vec_op: float
    vec_exp: float
    scalar_op: float
    scalar_exp: float
    chain_op: float
    wide_op: float
    launch: float

    def bandwidth_at(self, nbytes: float) -> float:
        """Bytes/s for a working set of ``nbytes`` (log-linear between measured points).

        Examples
        --------
        >>> m = Machine("m", 2, ((1e6, 8e10), (1e8, 2e10)), 1e-10, 1e-9, 1e-9, 1e-8, 1e-9,
        ...             1e-11, 1e-5)
        >>> m.bandwidth_at(1e3), m.bandwidth_at(1e7), m.bandwidth_at(1e9)
        (80000000000.0, 50000000000.0, 20000000000.0)
        """
        pts = self.bandwidth
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            if nbytes <= x1:
                w = math.log(nbytes / x0) / math.log(x1 / x0)
                return y0 + w * (y1 - y0)
        return pts[-1][1]

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> Machine:
        bw = tuple((float(a), float(b)) for a, b in data["bandwidth"])
        return Machine(**{**data, "bandwidth": bw})


IDENTITY_ENV = "REDFUSER_MACHINE"  # names the machine whose tuning records compile reads


def machine_id(target: str = "cpu") -> str:
    """The identity tuning records are read and stored under: ``$REDFUSER_MACHINE`` when
    set (e.g. the identity of a remote device that ``redfuser tune --rpc`` measured,
    set on that device), else this machine's (``local_id``).

    Examples
    --------
    >>> import os
    >>> saved = os.environ.pop(IDENTITY_ENV, None)
    >>> machine_id() == local_id()
    True
    >>> os.environ[IDENTITY_ENV] = "rpc:board/llvm/4 threads"
    >>> machine_id()
    'rpc:board/llvm/4 threads'
    >>> _ = os.environ.pop(IDENTITY_ENV) if saved is None else os.environ.update(
    ...     {IDENTITY_ENV: saved})
    """
    return os.environ.get(IDENTITY_ENV) or local_id(target)


def local_id(target: str = "cpu") -> str:
    """What a measurement here is valid for: CPU name, cores and runtime threads (or the
    GPU).

    Examples
    --------
    >>> local_id().count("/")
    2
    """
    return backend(target).machine_id()


def machine(target: str = "cpu", measure: bool = True) -> Machine:
    """This machine's figures: from the cache, else measured (about 2 s) and cached.

    ``measure=False`` returns nominal figures instead of measuring (quick estimates)."""
    gpu = backend(target).gpu
    if gpu is not None:  # its nominal figures: no GPU run has measured better ones yet
        return _nominal(local_id(target), *gpu.nominal)
    return _cpu_figures(local_id(target), measure)  # this machine's, whatever it reads


def _nominal(key: str, bw: float, op: float, ex: float, launch: float) -> Machine:
    return Machine(key, 1, ((1.0, bw),), op, ex, op, ex, op * 4, op, launch)


_UNSAVED: dict[tuple[str, str], Machine] = {}  # (cache file, machine): measured, not cached


def _cpu_figures(key: str, measure: bool) -> Machine:
    path = cache_dir() / FILENAME
    if (str(path), key) in _UNSAVED:
        return _UNSAVED[str(path), key]
    found = load(path, FORMAT, VERSION)
    if found.problem is not None:
        warn_unusable(path, found.problem)
    elif key in found.entries:
        try:
            return Machine.from_json(found.entries[key])
        except (KeyError, TypeError, ValueError):
            pass  # an older layout of the record: measure again
    if not measure:
        return nominal_cpu(key)
    figures = measure_cpu(key)
    if found.problem is not None:  # warned above; not ours to replace
        _UNSAVED[str(path), key] = figures
        return figures
    try:
        update(path, FORMAT, VERSION, lambda entries: {**entries, key: figures.to_json()})
    except DatabaseError as e:
        _UNSAVED[str(path), key] = figures
        warnings.warn(f"redfuser: the machine figures were measured but not cached ({e}); "
                      "this process uses them, the next one measures again", RuntimeWarning,
                      stacklevel=user_level())
    return figures


def nominal_cpu(name: str = "nominal") -> Machine:
    """Round figures of a 2-core AVX-512 server (for estimates without measuring)."""
    return Machine(name, 2, ((1 * MB, 6e10), (16 * MB, 3e10), (128 * MB, 2.5e10)),
                   vec_op=1e-11, vec_exp=7e-10, scalar_op=1.4e-10, scalar_exp=6e-9,
                   chain_op=1e-9, wide_op=4e-12, launch=2e-6)


def measure_cpu(name: str) -> Machine:
    """Time the calibration kernels (a few seconds) and derive the figures.  A figure that
    noise drove below a quarter of its nominal value is floored there (a difference of two
    noisy times can even come out negative)."""
    threads = default_threads()
    launch = _time("s = sum(x[i])", {"x": (threads, 64)}, LANES) / 1e3
    bandwidth = []
    for nbytes, rows in BANDWIDTH_POINTS:
        seconds = _time("s = sum(x[i])", {"x": (rows, nbytes // 4 // rows)}, LANES) / 1e3 - launch
        bandwidth.append((float(nbytes), nbytes / max(seconds, 1e-9)))
    out = _arithmetic(threads)
    r, n, d = WIDE_SHAPE
    wide = _time(WIDE, {"x": (r, n), "v": WIDE_SHAPE}, 1) / 1e3 - launch
    out["wide_op"] = wide * threads / (r * n * d * 5)
    floor = nominal_cpu().to_json()
    out = {k: max(v, floor[k] / 4) for k, v in out.items()}
    return Machine(name, threads, tuple(bandwidth), launch=launch, **out)


def _arithmetic(threads: int) -> dict[str, float]:
    """Seconds per op, per call and per chain step, in FOLD_LANES lanes (the CPU plan's) and
    in one (data in cache)."""
    shape = {"x": (64, 4096)}  # 1 MB: in cache, so arithmetic is what is timed
    per = threads / (64 * 4096) / 1e3  # ms of the whole call -> s per element and thread
    extra_ops = element_work(POLY).ops - element_work("s = sum(x[i])").ops
    out = {}
    for lanes, tag in ((FOLD_LANES, "vec"), (1, "scalar")):
        base = _time("s = sum(x[i])", shape, lanes)
        if lanes == 1:  # one add per element, each waiting for the previous one
            out["chain_op"] = base * per
        out[f"{tag}_op"] = (_time(POLY, shape, lanes) - base) * per / extra_ops
        out[f"{tag}_exp"] = (_time("s = sum(exp(x[i]))", shape, lanes) - base) * per
    return out


def _time(spec: str, shapes: dict, lanes: int) -> float:
    """Best of three medians (ms) of ``spec``'s rolling kernel with ``lanes`` lanes."""
    rule = derive(spec)
    geo = shape_geometry(rule, shapes)
    tile = min(TILE_ELEMENTS, geo.n) // lanes if lanes > 1 else 1  # the CPU plan's tiles
    plan = CpuPlan("rolling", lanes, 1, True, "calibration", tile=tile)
    built = build(rule, geo, plan)
    args = random_inputs(rule, geo) + list(allocate_outputs(rule, geo).values())
    time_built(built, args, repeat=1)  # warm-up: JIT and page faults
    return float(np.min([time_built(built, args, repeat=5) for _ in range(3)]))
