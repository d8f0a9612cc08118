"""Is redfuser a good neighbour to torch?  ``python -m redfuser.tools.neighbour`` (a script).

TVM's idle pool workers busy-wait ``TVM_THREAD_POOL_SPIN_COUNT`` iterations for the next
task after every parallel kernel (TVM's default: 300000).  In a process that also runs torch
they take the cores torch's own threads need.  For each spin count this starts a fresh
process (the pool reads the variable once, when it starts) that measures, in this order:

- ``copy_ before``: torch ``copy_`` of a 4096 x 4096 float32 tensor before any TVM kernel;
- ``copy_ after``: the same copies in a row right after one redfuser softmax 4096 x 4096
  call (a torch part of a model following one of our ops);
- ``pool CPU ms idle``: CPU time the process uses in the 0.2 s after a kernel call while
  its own thread sleeps (the spinning itself; less sensitive to a busy machine);
- our softmax at 4096 x 4096, 64 x 4096 and 1 x 256 (each call back to back, where a spinning
  pool picks the next task up fastest).

Medians in milliseconds (the 1 x 256 call in microseconds); rounds alternate the spin
counts so that a noise burst on a shared machine hits all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import timeit

import numpy as np

SPIN_ENV = "TVM_THREAD_POOL_SPIN_COUNT"
TVM_DEFAULT_SPIN = "300000"  # kDefaultSpinCount in TVM's src/runtime/thread_pool.cc
SPINS = ("unset", TVM_DEFAULT_SPIN, "0")  # unset: redfuser's default (redfuser.tvm)
COPY_SIDE = 4096
SHAPES = {"softmax 4096x4096 ms": (4096, 4096), "softmax 64x4096 ms": (64, 4096)}
TINY_CALLS = 2000  # calls per timeit repeat of the 1 x 256 softmax
IDLE_S = 0.2  # the idle time after a kernel over which the pool's CPU use is measured


def samples_ms(fn, repeat: int) -> list[float]:
    """Milliseconds of each of ``repeat`` calls of ``fn`` in a row."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def copy_call(torch):
    """A copy of COPY_SIDE^2 float32 into a preallocated tensor: torch's ``copy_`` (its
    threads are what a spinning pool slows), numpy's ``copyto`` where torch is missing."""
    if torch is None:
        src = np.ones((COPY_SIDE, COPY_SIDE), np.float32)
        into = np.empty_like(src)
        return lambda: np.copyto(into, src)
    src = torch.randn(COPY_SIDE, COPY_SIDE)
    into = torch.empty_like(src)
    return lambda: into.copy_(src)


def idle_cpu_ms(kernel, repeat: int) -> list[float]:
    """CPU milliseconds the process burns in the IDLE_S after each kernel call while its
    own thread sleeps: the pool's spinning, which a busy machine slows less than it slows
    wall-clock times."""
    kernel()
    out = []
    for _ in range(repeat):
        kernel()
        start = time.process_time()
        time.sleep(IDLE_S)
        out.append((time.process_time() - start) * 1e3)
    return out


def measure(repeat: int = 30) -> dict[str, list[float]]:
    """One process's samples (run in a fresh process: the TVM pool must not exist yet)."""
    import torch  # here, in the measuring process: the parent never loads torch or TVM

    import redfuser  # likewise: the pool must start in this process, not the parent

    torch.set_num_threads(os.cpu_count() or 1)
    copy = copy_call(torch)
    copy()  # warm-up: torch's threads, page faults
    row = {"copy_ before ms": samples_ms(copy, repeat)}
    softmax = redfuser.compile("softmax", tune=False, outputs=["y"])
    rng = np.random.default_rng(0)
    big = rng.standard_normal(SHAPES["softmax 4096x4096 ms"], np.float32)
    softmax(x=big)  # the first TVM kernel: the pool starts here
    row["copy_ after ms"] = samples_ms(copy, repeat)
    row["pool CPU ms idle"] = idle_cpu_ms(lambda: softmax(x=big), max(1, repeat // 4))
    for name, shape in SHAPES.items():
        x = rng.standard_normal(shape, np.float32)
        softmax(x=x)  # warm-up
        row[name] = samples_ms(lambda x=x: softmax(x=x), repeat)
    tiny = rng.standard_normal((1, 256), np.float32)
    softmax(x=tiny)
    row["softmax 1x256 us"] = [t / TINY_CALLS * 1e6 for t in timeit.repeat(
        lambda: softmax(x=tiny), number=TINY_CALLS, repeat=5)]
    return row


def run_child(spin: str, repeat: int) -> dict[str, list[float]]:
    """``measure`` in a fresh interpreter with the spin count ``spin`` ('unset': none given)."""
    env = {k: v for k, v in os.environ.items() if k != SPIN_ENV}
    if spin != "unset":
        env[SPIN_ENV] = spin
    done = subprocess.run([sys.executable, "-m", __spec__.name, "--child", "--repeat",
                           str(repeat)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the measuring process with {SPIN_ENV}={spin} failed "
                           f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redfuser.tools.neighbour", description=__doc__)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repeat", type=int, default=30, help="calls per median")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per spin count")
    p.add_argument("--spins", nargs="+", default=list(SPINS), help="spin counts to compare")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.repeat)))
        return 0
    samples: dict[str, dict[str, list[float]]] = {s: {} for s in args.spins}
    for _ in range(args.rounds):  # rounds alternate the spin counts: noise hits all alike
        for spin in args.spins:
            for key, values in run_child(spin, args.repeat).items():
                samples[spin].setdefault(key, []).extend(values)
    for stat, fn in (("median", np.median), ("best", np.min)):
        keys = list(samples[args.spins[0]])
        print(f"{stat + ' of every sample':<36}" + "".join(f"{k:>22}" for k in keys))
        for spin, row in samples.items():
            print(f"{SPIN_ENV + '=' + spin:<36}" + "".join(f"{fn(row[k]):>22.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
