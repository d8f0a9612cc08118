"""``make gpu-check``: the CUDA kernels on a real GPU, against the float64 oracle, timed.

Without a CUDA device it says so and exits 0 (CI has no GPU); with one, every library
cascade in every variant is run and compared (float32 tolerance as in the tests), then
the benchmark workloads are timed against torch on the GPU when torch has CUDA.
"""

from __future__ import annotations

import sys

import numpy as np

import redfuser
from algebra.library import example_inputs

from ..tvm_adapter import cuda_target, device
from .bench import workloads

VARIANTS = ("rolling", "split", "unfused")
STAGED_VARIANTS = ("resident", "unfused")  # a staged rule's kernels (no one-pass variants)


def check_correctness(n: int = 3000) -> int:
    failures = 0
    for name in redfuser.LIBRARY:
        inputs = example_inputs(name, n=n, rows=(8,), d=64)
        ref = redfuser.reference(name, inputs)
        staged = isinstance(redfuser.derive(name), redfuser.StagedRule)
        for variant in STAGED_VARIANTS if staged else VARIANTS:
            out = redfuser.compile(name, target="cuda", variant=variant)(**inputs)
            worst = max(float(np.nanmax(np.abs(out[k] - ref[k]) / (1e-5 + np.abs(ref[k]))))
                        for k in ref)
            ok = all(np.allclose(out[k], ref[k], rtol=2e-5, atol=1e-5, equal_nan=True)
                     for k in ref)
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name:<18} {variant:<8} max rel err {worst:.1e}")
    return failures


def timings():
    try:  # torch is optional: its GPU columns need a CUDA build of it
        import torch

        has_torch = torch.cuda.is_available()
    except ImportError:
        has_torch = False
    rng = np.random.default_rng(0)
    for w in workloads((lambda a: a) if has_torch else None):
        inputs = w.make(rng, 1.0)
        fused, unfused = (redfuser.compile(w.spec, target="cuda", variant=v).time(**inputs)
                          for v in (None, "unfused"))
        line = f"{w.name:<34} fused {fused:8.3f} ms  unfused {unfused:8.3f} ms"
        if has_torch and w.torch is not None:
            line += f"  torch {_torch_ms(w, inputs):8.3f} ms"
        print(line, flush=True)


def _torch_ms(w, inputs) -> float:
    import torch  # only reached when torch with CUDA is there (checked by the caller)

    dev = {k: torch.from_numpy(v).cuda() if isinstance(v, np.ndarray) else v
           for k, v in inputs.items()}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    w.torch(dev)
    start.record()
    for _ in range(10):
        w.torch(dev)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10


def main() -> int:
    if not device(cuda_target()).exist:
        print("gpu-check: no CUDA device on this machine; nothing to run "
              "(the CUDA compile tests run in `make test` when nvcc is on PATH)")
        return 0
    failures = check_correctness()
    timings()
    print(f"gpu-check: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
