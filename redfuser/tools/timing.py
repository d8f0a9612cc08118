"""Timing for the benchmark scripts: medians of repeated calls in one process, each
contender started on idle cores.

Another library's idle threads keep spinning for milliseconds after its last call (torch's
OpenMP and MKL threads; TVM's are told not to, ``redfuser.tvm``) and take the cores from whatever
runs next: our RMSNorm + GEMM 256 x 4096 -> 4096 took 37.1 ms right after torch's, 35.9 ms
1 ms after it, 33.0 ms 10 ms and 50 ms after it.  So every measurement starts after
``SETTLE_S`` of sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

SETTLE_S = 0.02  # long enough for the other libraries' threads to stop spinning (above)


def settle() -> None:
    """Let the threads of whatever ran before fall idle."""
    time.sleep(SETTLE_S)


def seconds(fn: Callable[[], object]) -> float:
    """Wall time of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median milliseconds of ``repeat`` calls in a row, after ``settle`` and a warm-up call
    (compile caches, JIT, page faults)."""
    settle()
    fn()
    return float(np.median([seconds(fn) for _ in range(repeat)])) * 1e3
