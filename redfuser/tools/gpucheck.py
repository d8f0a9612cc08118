"""``make gpu-check``: the CUDA kernels on a real GPU, against the float64 oracle, timed.

Without a CUDA device it says so and exits 0 (CI has no GPU); with one, every library
cascade in every variant is run and compared (float32 tolerance as in the tests), the FP8
(e4m3) per-token quantization + GEMM against numpy's quantize-then-GEMM (``fp8_reference``),
every library cascade in bfloat16 and float16 against the oracle rounded to the dtype, and
every library op's forward and derived backward kernels through ``redfuser.torch`` against
central differences of the oracle (``oracle_checks``, which the tests run on the CPU),
then the benchmark workloads are timed against torch on the GPU when torch has CUDA.
"""

from __future__ import annotations

import sys

import ml_dtypes  # numpy's e4m3 (TVM depends on it): the FP8 reference rounds through it
import numpy as np

import redfuser
from algebra.library import example_inputs

from ..lowering.cuda.fp8 import FP8_MAX, fp8_quant_gemm
from ..tvm.runtime import build, from_numpy, time_ms
from ..tvm.target import cuda_target, device
from .bench import workloads
from .oracle_checks import check_dtypes, check_training, first_line
from .quant_bench import ROWS, K, N

VARIANTS = ("rolling", "split", "unfused")
STAGED_VARIANTS = ("resident", "unfused")  # a staged rule's kernels (no one-pass variants)
# |fused - oracle| / max |oracle| at the bench shapes: float32 sums of up to 32768 terms
# (decode attention) err by a few hundred ulp of the largest term at worst
BENCH_TOLERANCE = 1e-4
CHECK_ROWS = 1 / 16  # the share of a bench workload's rows compared with the oracle


def check_correctness(n: int = 3000) -> int:
    failures = 0
    for name in redfuser.LIBRARY:
        inputs = example_inputs(name, n=n, rows=(8,), d=64)
        ref = redfuser.reference(name, inputs)
        staged = isinstance(redfuser.derive(name), redfuser.StagedRule)
        for variant in STAGED_VARIANTS if staged else VARIANTS:
            try:
                out = redfuser.compile(name, target="cuda", variant=variant)(**inputs)
            except Exception as e:  # noqa: BLE001 - reported, and the check goes on
                failures += 1
                print(f"FAIL {name:<18} {variant:<8} {first_line(e)}", flush=True)
                continue
            worst = max(float(np.nanmax(np.abs(out[k] - ref[k]) / (1e-5 + np.abs(ref[k]))))
                        for k in ref)
            ok = all(np.allclose(out[k], ref[k], rtol=2e-5, atol=1e-5, equal_nan=True)
                     for k in ref)
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name:<18} {variant:<8} max rel err {worst:.1e}",
                  flush=True)
    return failures


def fp8_reference(x: np.ndarray, wq: np.ndarray, ws: np.ndarray) -> tuple:
    """numpy's per-token e4m3 quantize-then-GEMM, as ``lowering.cuda.fp8`` computes it:
    (q, a, y, bound).  ``a`` the row's absolute max; ``q`` = ``x * 448 / a`` in float32,
    clipped to +-448 and rounded to nearest even into e4m3 (ml_dtypes: the kernel's
    saturating conversion), so equal bit for bit; ``y`` the products summed in float64,
    scaled by ``a / 448 * ws``; ``bound`` the worst rounding of the kernel's float32 sums
    (K u sum |q w|, u = 2^-24, scaled alike).

    Examples
    --------
    >>> x = np.array([[1.0, -4.0, 0.5]], np.float32)
    >>> wq = np.ones((3, 2), np.float32).astype(ml_dtypes.float8_e4m3fn)
    >>> q, a, y, _ = fp8_reference(x, wq, np.array([1.0, 2.0], np.float32))
    >>> q.astype(np.float32).tolist(), a.tolist(), y.round(4).tolist()
    ([[112.0, -448.0, 56.0]], [4.0], [[-2.5, -5.0]])
    """
    a = np.max(np.abs(x), axis=1)
    scaled = np.clip(x * np.float32(FP8_MAX) / a[:, None], -FP8_MAX, FP8_MAX)
    q = scaled.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    q64, w64 = q.astype(np.float64), wq.astype(np.float64)
    scale = a.astype(np.float64)[:, None] / FP8_MAX * ws.astype(np.float64)[None, :]
    bound = x.shape[1] * 2.0 ** -24 * (np.abs(q64) @ np.abs(w64)) * np.abs(scale)
    return q, a, (q64 @ w64) * scale, bound


def check_fp8(m: int = ROWS, k: int = K, n: int = N) -> int:
    """The FP8 CUDA kernel at the bench's quant + GEMM shape: quantized values bit-identical
    to ``fp8_reference``'s, the row maxima equal, ``y`` within the float32 summation bound;
    timed.  Returns the number of failures (0 or 1)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(m, k)).astype(np.float32)
    wq = (rng.normal(size=(k, n)) * 16).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    ws = (rng.uniform(0.5, 2.0, n) / 16).astype(np.float32)
    dev, target = device(cuda_target()), cuda_target()
    outs = [np.zeros((m, n), np.float32), np.zeros((m, k), ml_dtypes.float8_e4m3fn),
            np.zeros(m, np.float32)]  # y, q, amax
    args = [from_numpy(v, dev) for v in (x, wq, ws, *outs)]
    name = "fp8_quant_gemm"
    executable = build(fp8_quant_gemm(m, k, n, name), target)
    ms = time_ms(executable, name, dev, args)
    y, q, a = (t.numpy() for t in args[3:])
    q_ref, a_ref, y_ref, bound = fp8_reference(x, wq, ws)
    same_q = np.array_equal(q.view(np.uint8), q_ref.view(np.uint8))
    ok = same_q and np.array_equal(a, a_ref) and bool(np.all(np.abs(y - y_ref) <= bound))
    worst = float(np.max(np.abs(y - y_ref) / np.maximum(bound, 1e-30)))
    print(f"{'ok  ' if ok else 'FAIL'} fp8 quant+gemm {m}x{k}->{n}: {ms:.3f} ms, quantized "
          f"values {'bit-identical' if same_q else 'DIFFER'}, |y - ref| at most {worst:.2f} "
          "of the float32 summation bound", flush=True)
    return 0 if ok else 1


def timings() -> int:
    """The bench workloads on the GPU: fused and unfused timed (and torch with CUDA); the
    fused kernel's outputs compared with the float64 oracle at the bench's N and D with
    1/16 of its rows (the oracle of RMSNorm + GEMM holds rows x N x D float64s; the error
    over the largest |value|: float32 sums of up to 32768 terms); returns the failures."""
    try:  # torch is optional: its GPU columns need a CUDA build of it
        import torch

        has_torch = torch.cuda.is_available()
    except ImportError:
        has_torch = False
    rng, failures = np.random.default_rng(0), 0
    for w in workloads((lambda a: a) if has_torch else None):
        inputs = w.make(rng, 1.0)
        try:
            kernels = [redfuser.compile(w.spec, target="cuda", variant=v)
                       for v in (None, "unfused")]
            fused, unfused = (k.time(**inputs) for k in kernels)
            few = w.make(rng, CHECK_ROWS)
            out, ref = kernels[0](**few), redfuser.reference(w.spec, few)
        except Exception as e:  # noqa: BLE001 - reported, and the check goes on
            failures += 1
            print(f"FAIL {w.name:<34} {first_line(e)}", flush=True)
            continue
        err = max(float(np.nanmax(np.abs(out[k] - ref[k])) / max(np.nanmax(np.abs(ref[k])),
                                                                 1e-30)) for k in ref)
        failures += not err <= BENCH_TOLERANCE
        line = (f"{'ok  ' if err <= BENCH_TOLERANCE else 'FAIL'} {w.name:<34} fused "
                f"{fused:8.3f} ms  unfused {unfused:8.3f} ms  err {err:.1e}")
        if has_torch and w.torch is not None:
            line += f"  torch {_torch_ms(w, inputs):8.3f} ms"
        print(line, flush=True)
    return failures


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
    try:
        failures += check_fp8()
    except Exception as e:  # noqa: BLE001 - reported, and the check goes on
        failures += 1
        print(f"FAIL fp8 quant+gemm {first_line(e)}", flush=True)
    failures += check_dtypes("cuda")
    failures += check_training("cuda")
    failures += timings()
    print(f"gpu-check: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
