"""Benchmark: ``python -m redfuser.tools.bench`` or ``redfuser bench`` (a script, not a test).

For each workload: the fused kernel (allocating its outputs, and with ``out=``
preallocated ones), the unfused kernel (same scheduling, one pass per reduction), numpy,
torch eager and torch.compile when torch is installed, a plain copy of the input bytes
(allocating, ``copy_`` into a preallocated array, which memcpy does with non-temporal
stores, and ``x*1`` into it, with the ordinary stores every kernel here uses), and a
read-only pass over them (``read``, a sum) — all float32, medians of
repeated runs in one process, with the thread count printed.  Ratios are measured in the
same run because these machines are shared and noisy.  Each row also states its distance
to this machine's limits (``limits``): GB/s moved (inputs + outputs, the ``out=`` call)
against the measured copy bandwidth for memory-bound workloads, GFLOP/s against a
measured GEMM for matmul-bound ones.  The last line checks that TVM's thread pool did not
slow the torch and copy columns: a copy before any TVM kernel against the same copy right
after each call of one (``neighbour check``; ``python -m redfuser.tools.neighbour``).

``--tuned`` adds the tuned fused kernel (``redfuser.tune``: the cost model ranks the
schedule space, the best few candidates and the hand-written plan are measured, the
fastest is stored in the tuning database) next to the untuned one, with its plan and
time to tune; then MetaSchedule (TVM's tuner, a fixed trial budget) against this
search on the unfused softmax and LayerNorm statistics: time to tune and kernel time.
"""

from __future__ import annotations

import argparse
import os
import timeit
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import redfuser

from ..lowering.cpu.vector import host_isa
from ..tune import describe, machine, tune
from ..tvm.ir import IRBuilder, T, arg_buffer, tirx
from ..tvm.runtime import build as tvm_build
from ..tvm.runtime import from_numpy
from ..tvm.target import cpu_target, default_threads
from . import precision_bench, quant_bench, train_bench
from .metaschedule_compare import print_comparison
from .neighbour import COPY_SIDE, SPIN_ENV, copy_call, samples_ms
from .timing import median_ms, seconds, settle


@dataclass(frozen=True)
class Workload:
    name: str
    spec: str  # library name
    make: Callable[[np.random.Generator, float], dict]  # (rng, scale) -> inputs
    numpy: Callable[[dict], object]
    torch: Callable[[dict], object] | None
    copy_of: str  # the input whose bytes a plain copy moves (the copy columns)
    flops: Callable[[dict], float] | None = None  # matmul-bound: its flops; else memory-bound


def _sdpa(t, causal: bool = False):
    import torch.nn.functional as F  # only when torch is there (an optional dependency)

    # our K/V are (H, 1, N, D), shared by the queries of a head; torch wants (H, N, D);
    # is_causal masks key j > query l (top-left aligned): our pos = l
    return lambda a: F.scaled_dot_product_attention(t(a["q"]), t(a["k"])[:, 0], t(a["v"])[:, 0],
                                                    scale=a["scale"], is_causal=causal)


def _np_softmax(a):
    m = a["x"].max(-1, keepdims=True)
    e = np.exp(a["x"] - m)
    return e / e.sum(-1, keepdims=True)


def _np_attention(a):
    s = np.einsum("hqd,hkd->hqk", a["q"], a["k"][:, 0]) * a["scale"]
    if "pos" in a:  # causal: key j is masked for the query at position pos < j
        s = np.where(np.arange(s.shape[-1]) <= a["pos"][..., None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,hkd->hqd", p / p.sum(-1, keepdims=True), a["v"][:, 0])


def _np_moe(a):
    p = _np_softmax(a)
    idx = np.argpartition(-p, 8, axis=-1)[:, :8]
    return np.take_along_axis(p, idx, -1), idx


def _np_rms_gemm(a):
    r = np.sqrt((a["x"] ** 2).mean(-1, keepdims=True) + a["eps"])
    return (a["x"] / r) @ a["w"]


def workloads(torch_tensor) -> list[Workload]:
    t = torch_tensor
    tt = (lambda f: f) if t else (lambda f: None)

    def rows(r, n):
        return lambda g, s: {"x": g.normal(size=(int(r * s) or 1, n)).astype(np.float32)}

    def attn(h, lq, lk, d):
        return lambda g, s: {
            "q": g.normal(size=(h, max(1, int(lq * s)), d)).astype(np.float32),
            "k": g.normal(size=(h, 1, lk, d)).astype(np.float32),
            "v": g.normal(size=(h, 1, lk, d)).astype(np.float32), "scale": d ** -0.5}

    def causal(h, lq, lk, d):
        def make(g, s):
            a = attn(h, lq, lk, d)(g, s)
            return {**a, "pos": np.arange(a["q"].shape[1], dtype=np.float32).reshape(1, -1)}
        return make

    def rms(g, s):
        n = 4096
        return {"x": g.normal(size=(max(1, int(256 * s)), n)).astype(np.float32),
                "w": (g.normal(size=(n, 4096)) / 64).astype(np.float32), "eps": 1e-6}

    import_torch = __import__("torch") if t else None
    return [
        Workload("softmax 4096x4096", "softmax", rows(4096, 4096), _np_softmax,
                 tt(lambda a: import_torch.softmax(t(a["x"]), -1)), "x"),
        Workload("attention 8x1024x1024 D64", "attention", attn(8, 1024, 1024, 64),
                 _np_attention, tt(_sdpa(t) if t else None), "k", _attention_flops),
        Workload("causal attention 8x1024x1024 D64", "causal_attention",
                 causal(8, 1024, 1024, 64), _np_attention,
                 tt(_sdpa(t, causal=True) if t else None), "k", _causal_flops),
        Workload("decode attention 8x1x32768 D128", "attention", attn(8, 1, 32768, 128),
                 _np_attention, tt(_sdpa(t) if t else None), "k"),
        Workload("layernorm stats 4096x4096", "variance", rows(4096, 4096),
                 lambda a: (a["x"].mean(-1), a["x"].var(-1)),
                 tt(lambda a: import_torch.var_mean(t(a["x"]), -1, correction=0)), "x"),
        Workload("moe routing 4096x256 top8", "moe_routing", rows(4096, 256), _np_moe,
                 tt(lambda a: import_torch.topk(import_torch.softmax(t(a["x"]), -1), 8)), "x"),
        Workload("rmsnorm+gemm 256x4096->4096", "rmsnorm_gemm", rms, _np_rms_gemm,
                 tt(lambda a: import_torch.nn.functional.rms_norm(
                     t(a["x"]), (4096,), eps=a["eps"]) @ t(a["w"])), "w",
                 lambda a: 2.0 * a["x"].shape[0] * a["w"].shape[0] * a["w"].shape[1]),
    ]


def _attention_flops(a: dict) -> float:
    """Q.K and P.V: two multiply-adds per (query, key, feature)."""
    h, lq, d = a["q"].shape
    return 4.0 * h * lq * a["k"].shape[-2] * d


def _causal_flops(a: dict) -> float:
    """The unmasked half (keys up to each query's position) of ``_attention_flops``."""
    h, lq, d = a["q"].shape
    kept = float(np.minimum(a["pos"].ravel() + 1, a["k"].shape[-2]).sum())
    return 4.0 * h * kept * d


def run(scale: float = 1.0, repeat: int = 5, with_compile: bool = True,
        only: str | None = None, tuned: bool = False) -> list[dict]:
    try:  # torch is optional (the test extras): without it the torch columns stay empty
        import torch

        torch.set_num_threads(default_threads())
    except ImportError:
        torch = None
    copy = copy_call(torch)
    copy()  # warm-up
    before = float(np.median(samples_ms(copy, 2 * repeat)))  # before TVM's pool starts
    if tuned:  # calibrate the cost model before torch has run (its idle threads spin)
        machine()
    rng = np.random.default_rng(0)
    rows, lim = [], limits(torch)
    print(f"limits: copy {lim['gbs']:.1f} GB/s, FMA peak {lim['fma']:.1f} GFLOP/s, torch's "
          f"2048^3 GEMM {lim['gflops']:.1f} GFLOP/s "
          "(memory-bound rows: GB/s of the out= call, inputs + outputs)", flush=True)
    cols = [c for c in COLUMNS if c != "tuned" or tuned]
    print(f"{'workload':<34}" + "".join(f"{c:>{WIDTH[c]}}" for c in cols), flush=True)
    # torch functions take torch tensors made once, outside the timed region (zero-copy views)
    for w in workloads((lambda a: a) if torch is not None else None):
        if only and only not in w.name:
            continue
        inputs = w.make(rng, scale)
        fused, unfused = (redfuser.compile(w.spec, variant=v, tune=False)
                          for v in (None, "unfused"))
        row = {"workload": w.name, **_time_all(w, inputs, fused, unfused, torch, repeat,
                                                with_compile)}
        row["plan"] = str(fused.plan)
        if tuned:
            _add_tuned(row, w, inputs, fused, repeat)
        rows.append(row)
        print(_line(row, lim), flush=True)
        if tuned:
            same = row["tuned plan"] == describe(fused.plan)
            print(f"{'':<4}tuned: {row['tuned plan']} ({row['tune s']:.1f} s to tune); "
                  f"untuned: {'the same plan' if same else describe(fused.plan)}", flush=True)
    if not only or only in "quant+gemm":  # its own columns: torch's int8 Linear, our f32 GEMM
        print(quant_bench.line(quant_bench.row(scale, repeat, torch)), flush=True)
    if not only or only in "tiny call":
        print(call_line(torch), flush=True)
    print(neighbour_line(copy, before, repeat), flush=True)
    return rows


def neighbour_line(copy: Callable[[], object], before: float, repeat: int) -> str:
    """The copy baseline as the benchmark measured it (``before``: ms before any TVM kernel)
    against the same copies in a row right after a parallel TVM kernel (a softmax of 64
    rows): a spinning TVM pool (``redfuser.tvm``: TVM_THREAD_POOL_SPIN_COUNT) would slow the
    second, and with it every torch and copy column measured after a kernel."""
    x = np.random.default_rng(2).normal(size=(64, 4096)).astype(np.float32)
    softmax = redfuser.compile("softmax", tune=False, outputs=["y"])
    softmax(x=x)
    after = float(np.median(samples_ms(copy, 2 * repeat)))
    return (f"neighbour check: copy {COPY_SIDE}x{COPY_SIDE} {before:.2f} ms before any TVM "
            f"kernel, {after:.2f} ms in a row right after one (after/before "
            f"{after / before:.2f}; {SPIN_ENV}={os.environ[SPIN_ENV]})")


CALLS = 20000  # calls per timeit repeat of the tiny call


def call_line(torch) -> str:
    """What a call costs beyond its kernel: a 1 x 256 softmax (0.7 us of kernel) with every
    output and with ``outputs=["y"]``, against ``torch.softmax``; microseconds, the best of 7
    repeats of CALLS calls."""
    x = np.random.default_rng(1).normal(size=(1, 256)).astype(np.float32)
    every = redfuser.compile("softmax", tune=False)
    y_only = redfuser.compile("softmax", tune=False, outputs=["y"])

    def us(fn) -> float:
        fn()
        return min(timeit.repeat(fn, number=CALLS, repeat=7)) / CALLS * 1e6

    a, y = us(lambda: every(x=x)), us(lambda: y_only(x=x))
    line = f"tiny call 1x256 softmax: y, m, d {a:.2f} us, outputs=['y'] {y:.2f} us"
    if torch is None:
        return line
    xt = torch.from_numpy(x)
    t, y_t = us(lambda: torch.softmax(xt, -1)), us(lambda: y_only(x=xt))
    return (f"{line}, torch tensor in {y_t:.2f} us, torch.softmax {t:.2f} us; "
            f"(y, m, d)/torch {a / t:.2f}x, y/torch {y / t:.2f}x")


def _add_tuned(row: dict, w: Workload, inputs: dict, fused, repeat: int) -> None:
    """Search the fused kernel's schedule for these inputs, then time the tuned and the
    untuned kernel alternately (the same noise for both; this replaces row["fused"])."""
    kernel = redfuser.compile(w.spec, tune=True)
    geo = kernel.geometry(**inputs)
    result = tune(kernel.rule, geo, top=3, repeat=3, rounds=2)
    kernel = redfuser.compile(w.spec, tune=True)  # reads the entry the search just stored
    row["fused"], row["tuned"] = _alternating([lambda: fused(**inputs),
                                               lambda: kernel(**inputs)], repeat)
    row["tuned plan"], row["tune s"] = describe(result.best), result.seconds


def _alternating(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Median ms of each function, timed in turns (a noise burst hits all of them)."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up
    for _ in range(repeat):
        for fn, out in zip(fns, times, strict=True):
            settle()
            out.append(seconds(fn))
    return [float(np.median(t)) * 1e3 for t in times]


def _time_all(w: Workload, inputs: dict, fused, unfused, torch, repeat: int,
              with_compile: bool) -> dict:
    src, into = inputs[w.copy_of], np.empty_like(inputs[w.copy_of])
    out = {k: np.empty_like(v) for k, v in fused(**inputs).items()}  # preallocated outputs
    row = {"fused": median_ms(lambda: fused(**inputs), repeat),
           "out=": median_ms(lambda: fused(**inputs, out=out), repeat),
           "unfused": median_ms(lambda: unfused(**inputs), repeat),
           "numpy": median_ms(lambda: w.numpy(inputs), repeat),
           "copy": median_ms(src.copy, repeat),
           "copy_": median_ms(lambda: np.copyto(into, src), repeat),
           # the same bytes through ordinary (cached) stores: memcpy streams past the cache
           # (non-temporal stores, no read-for-ownership), which TVM's LLVM codegen cannot emit
           "x*1": median_ms(lambda: np.multiply(src, 1, out=into), repeat),
           "read": median_ms(lambda: src.sum(), repeat),  # a read-only pass over the input
           "bytes": sum(v.nbytes for v in inputs.values() if isinstance(v, np.ndarray)) +
           sum(v.nbytes for v in out.values()),
           "flops": w.flops(inputs) if w.flops else None}
    if torch is not None and w.torch is not None:
        tin = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
               for k, v in inputs.items()}
        with torch.no_grad():
            row["torch"] = median_ms(lambda: w.torch(tin), repeat)
            if with_compile:
                compiled = torch.compile(w.torch)
                row["torch.compile"] = median_ms(lambda: compiled(tin), repeat)
    return row


COLUMNS = ("fused", "out=", "tuned", "unfused", "numpy", "torch", "torch.compile", "copy",
           "copy_", "x*1", "read")
WIDTH = {c: max(9, len(c) + 1) for c in COLUMNS}


def _line(row: dict, limits: dict) -> str:
    cols = [c for c in COLUMNS if c != "tuned" or "tuned" in row]
    cells = [f"{row[c]:{WIDTH[c]}.2f}" if c in row else f"{'-':>{WIDTH[c]}}" for c in cols]
    f = row["fused"]
    ratios = [f"unfused/fused {row['unfused'] / f:5.2f}"]
    ratios += [f"{k}/fused {row[k] / f:5.2f}" for k in ("torch", "torch.compile") if k in row]
    ratios.append(f"out=/copy_ {row['out='] / row['copy_']:5.2f}")
    ratios.append(f"out=/x*1 {row['out='] / row['x*1']:5.2f}")
    ratios.append(f"out=/read {row['out='] / row['read']:5.2f}")
    if row["flops"]:
        rate = row["flops"] / f / 1e6
        ratios.append(f"{rate:7.1f} GFLOP/s ({rate / limits['fma']:4.0%} of FMA peak)")
    else:
        rate = row["bytes"] / row["out="] / 1e6
        ratios.append(f"{rate:6.1f} GB/s ({rate / limits['gbs']:4.0%} of copy)")
    if "tuned" in row:
        ratios.append(f"fused/tuned {f / row['tuned']:5.2f}")
    return f"{row['workload']:<34}" + "".join(cells) + "   " + "  ".join(ratios)


STEPS = 1 << 22  # FMA peak: multiply-adds per chain


def fma_peak() -> float:
    """GFLOP/s of independent full-register multiply-add chains per thread, as many as the
    host's GEMM micro-kernel keeps sums (``vector.host_isa``: they fit the registers and
    cover the FMA latency of two pipes): the machine's FMA peak as a kernel sees it."""
    isa, threads = host_isa(), default_threads()
    chains, lanes = isa.gemm_sums, isa.lanes
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("peak")
            out = arg_buffer("out", (threads, chains, lanes))
            with T.parallel(0, threads) as t:
                acc = T.alloc_buffer((chains, lanes), "float32", scope="local")
                with T.unroll(0, chains) as c:
                    with T.vectorized(0, lanes) as lane:
                        T.buffer_store(acc, tirx.Cast("float32", c + lane), [c, lane])
                with T.serial(0, STEPS) as _:
                    with T.unroll(0, chains) as c:
                        with T.vectorized(0, lanes) as lane:
                            T.buffer_store(acc, acc[c, lane] * tirx.const(0.999, "float32") +
                                           tirx.const(1e-3, "float32"), [c, lane])
                with T.unroll(0, chains) as c:
                    with T.vectorized(0, lanes) as lane:
                        T.buffer_store(out, acc[c, lane], [t, c, lane])
    fn = tvm_build(ib.get(), cpu_target())["peak"]
    arg = from_numpy(np.zeros((threads, chains, lanes), np.float32))
    fn(arg)
    best = min(seconds(lambda: fn(arg)) for _ in range(3))
    return 2.0 * threads * chains * lanes * STEPS / best / 1e9


def limits(torch) -> dict:
    """This machine's measured ceilings: copy bandwidth (GB/s read + written, 256 MB) and
    matrix-multiply throughput (GFLOP/s of a 2048^3 float32 GEMM, torch's where available:
    the practical FMA peak)."""
    src = np.ones(64 * 2 ** 20, np.float32)
    into = np.empty_like(src)
    gbs = 2 * src.nbytes / median_ms(lambda: np.copyto(into, src), 5) / 1e6
    a = np.ones((2048, 2048), np.float32)
    mm = (lambda: torch.from_numpy(a) @ torch.from_numpy(a)) if torch else (lambda: a @ a)
    return {"gbs": gbs, "gflops": 2 * 2048 ** 3 / median_ms(mm, 5) / 1e6, "fma": fma_peak()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redfuser.tools.bench", description=__doc__)
    p.add_argument("--scale", type=float, default=1.0, help="scale the row counts (quick runs)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--only", help="run the workloads whose name contains this")
    p.add_argument("--tuned", action="store_true", help="add the tuned fused kernel (schedule "
                   "search, stored in the tuning database) and the MetaSchedule comparison")
    p.add_argument("--ms-trials", type=int, default=32, help="MetaSchedule's trial budget")
    p.add_argument("--train", action="store_true", help="also the training rows: forward + "
                   "backward against torch eager and torch.compile, time and peak memory "
                   "(redfuser.tools.train_bench, each case in a process of its own)")
    p.add_argument("--low", action="store_true", help="also the bfloat16 and float16 rows "
                   "(redfuser.tools.precision_bench): against torch in the same dtype, our "
                   "float32 kernel and a low-precision copy")
    p.add_argument("--no-metaschedule", action="store_true",
                   help="with --tuned: skip the MetaSchedule comparison")
    args = p.parse_args(argv)
    print(f"threads: {default_threads()} (TVM_NUM_THREADS; torch set to the same); times in ms, "
          f"medians of {args.repeat}")
    run(args.scale, args.repeat, not args.no_compile, args.only, args.tuned)
    if args.tuned and not args.no_metaschedule:
        print_comparison(args.scale, args.ms_trials)
    if args.low:
        precision_bench.run(args.scale, args.repeat, args.only)
    if args.train:
        train_bench.run(args.scale, args.repeat, not args.no_compile,
                        [args.only] if args.only else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
