"""TVM's own tuner on the unfused baselines, for the benchmark's comparison (issue 6.5).

MetaSchedule (``tvm.s_tir.meta_schedule``, needs ``psutil`` and ``cloudpickle``) tunes
a TE PrimFunc of the unfused cascade (TOPI's softmax; LayerNorm's statistics as two
reductions) for a fixed trial budget; ``compare`` reports its time to tune and the best
kernel's time next to this package's search on redfuser's unfused variant.

Two things about MetaSchedule 0.27 on these machines, found while wiring it up:

- ``TuneContext`` imports ``tvm.s_tir.tensor_intrin`` (25-35 s on two cores) once per
  process; it is paid here before the clock starts and reported on its own.
- The default builder runs ``default_build`` in a fresh worker process per batch, which
  imports ``tensor_intrin`` again and hits the builder's 30 s timeout: every candidate
  "fails to build" and tuning returns nothing.  ``build_without_intrinsics`` is the same
  build without that import (no tensorization is possible for these workloads).
The cost model is "random" unless ``xgboost`` is installed (MetaSchedule's default).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import te, topi
from tvm.s_tir import meta_schedule as ms

from ..tvm.target import cpu_target, default_threads


@dataclass
class MetaScheduleResult:
    """Time to tune (seconds), best kernel time (ms), trials run; ``error`` if it failed."""

    workload: str
    tune_s: float = float("nan")
    kernel_ms: float = float("nan")
    trials: int = 0
    setup_s: float = 0.0
    error: str = ""


def build_without_intrinsics():
    """MetaSchedule's default build minus the tensor-intrinsic import (see the docstring).

    Made by a factory: cloudpickle sends a nested function to the builder's workers by
    value, so they import nothing of redfuser (importing this package there would load
    TVM's Python side, dlight included, for every batch)."""

    def f_build(mod, target, _params):  # runs in a worker: its imports travel with it
        from tvm.driver import build
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock  # (in the worker)

        return build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod),
                     target=target)

    return f_build


def te_softmax(rows: int, n: int):
    """TOPI's softmax (max, exp-sum, normalise: three reductions' worth of passes) and the
    shapes of its arguments.

    Examples
    --------
    >>> func, shapes = te_softmax(4, 8)
    >>> shapes
    [(4, 8), (4, 8)]
    """
    x = te.placeholder((rows, n), "float32", name="x")
    return te.create_prim_func([x, topi.nn.softmax(x)]), [(rows, n), (rows, n)]


def te_layernorm_stats(rows: int, n: int):
    """Mean and variance as two reductions (the second reads the first)."""
    x = te.placeholder((rows, n), "float32", name="x")
    k = te.reduce_axis((0, n), name="k")
    mean = te.compute((rows,), lambda i: te.sum(x[i, k] / n, axis=k), name="mean")
    j = te.reduce_axis((0, n), name="j")
    var = te.compute((rows,), lambda i: te.sum((x[i, j] - mean[i]) * (x[i, j] - mean[i]) / n,
                                               axis=j), name="var")
    return te.create_prim_func([x, mean, var]), [(rows, n), (rows,), (rows,)]


WORKLOADS = {"softmax": te_softmax, "layernorm stats": te_layernorm_stats}


def tune_te(name: str, rows: int, n: int, trials: int = 32) -> MetaScheduleResult:
    """Tune ``WORKLOADS[name]`` with MetaSchedule; never raises (the error is returned)."""
    out = MetaScheduleResult(name)
    try:
        _tune(out, *WORKLOADS[name](rows, n), trials)
    except Exception as e:  # noqa: BLE001 - the benchmark reports why and goes on
        out.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"
    return out


def _tune(out: MetaScheduleResult, func, shapes: list, trials: int) -> None:
    start = time.perf_counter()
    # here, not at the top: its ~35 s are reported as setup, outside the tuning clock
    import tvm.s_tir.tensor_intrin  # noqa: F401

    out.setup_s = time.perf_counter() - start
    target = tvm.target.Target({**cpu_target(), "num-cores": default_threads()})
    mod = tvm.IRModule({"main": func})
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as work_dir, _quiet(work_dir), _tmpdir(work_dir):
        db = ms.tune_tir(mod, target, work_dir, max_trials_global=trials,
                         num_trials_per_iter=min(trials, 16), cost_model=_cost_model(),
                         builder=ms.builder.LocalBuilder(f_build=build_without_intrinsics(),
                                                         max_workers=1, timeout_sec=120),
                         runner=ms.runner.LocalRunner(timeout_sec=60),
                         num_tuning_cores=default_threads())
        sch = ms.tir_integration.compile_tir(db, mod, target)
        out.trials = len(db.get_all_tuning_records())
    out.tune_s = time.perf_counter() - start
    if sch is None:
        raise RuntimeError(f"no valid schedule in {trials} trials")
    out.kernel_ms = _time(tvm.compile(sch.mod, target=target), shapes)


@contextlib.contextmanager
def _tmpdir(work_dir: str):
    """The builder's workers export each candidate to a fresh ``mkdtemp()`` they never
    remove: point their TMPDIR into the work directory, which is removed."""
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = work_dir
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = saved


@contextlib.contextmanager
def _quiet(work_dir: str):
    """MetaSchedule logs every iteration to the terminal (from C++): send it to a file."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.path.join(work_dir, "console.log"), "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _cost_model() -> str:
    try:  # optional: MetaSchedule's default cost model when installed
        import xgboost  # noqa: F401
    except ImportError:
        return "random"
    return "xgb"


def _time(executable, shapes: list) -> float:
    dev, g = tvm.cpu(0), np.random.default_rng(0)
    args = [tvm.runtime.tensor(g.standard_normal(shape, np.float32), dev) for shape in shapes]
    timer = executable.mod.time_evaluator("main", dev, number=1, repeat=5)
    return float(timer(*args).median) * 1e3
