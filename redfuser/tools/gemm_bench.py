"""GEMM micro-kernel study: ``python -m redfuser.tools.gemm_bench`` (a script, not a test).

For a cascade holding a matrix product (RMSNorm + GEMM by default, 256 x 4096 -> 4096, the
benchmark's row), builds side by side: the policy's fused plan, its unfused baseline, the
row-block plan the product had before the GEMM micro-kernel (8 rows x 32-element tiles) and
any blockings given with ``--blocks MRxNRxKCxNC``; times them and torch (``rms_norm`` then
``@``) in interleaved rounds (a noise burst on a shared machine hits all alike) and prints
median and best times, GFLOP/s and their share of this machine's measured GEMM peak
(``bench.limits``: torch's 2048^3 matmul) and of the FMA peak (``fma_peak``: independent
vector multiply-adds on registers, every thread), and, from the generated assembly, the
micro-kernel's hot loop: instructions per FMA and what they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections import Counter

import numpy as np

os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")  # see bench.py: idle TVM threads spin

import redfuser  # noqa: E402

from ..lowering import CpuPlan, Plan  # noqa: E402
from ..tvm.target import default_threads  # noqa: E402
from .bench import fma_peak, limits  # noqa: E402
from .timing import seconds, settle  # noqa: E402

ROW_BLOCK_PLAN = CpuPlan("rolling", 1, tile=32, row_block=8, reason="rows in blocks of 8, "
                         "tiles of 32 (the product's plan before the GEMM micro-kernel)")
FMA = "vfmadd"  # x86 fused multiply-add mnemonics: vfmadd132ps/213ps/231ps


def hot_loop(asm: str) -> list[str]:
    """The instructions of the loop (a block jumping back to its own label) holding the most
    FMAs."""
    loops, label, body = {}, None, []
    for line in asm.splitlines():
        head = re.match(r"^(\.LBB\w+):", line)
        if head:
            label, body = head.group(1), []
            continue
        text = line.strip()
        if label is None or not line.startswith("\t") or text.startswith((".", "#")):
            continue
        body.append(text.split("#")[0].strip())
        if text.startswith("j") and text.split()[-1] == label:
            loops[label] = list(body)
    return max(loops.values(), key=lambda b: sum(FMA in i for i in b), default=[])


def describe_loop(kernel) -> str:
    """The hot loop of the kernel's most recent build: instructions per FMA, by kind."""
    body = hot_loop(kernel.assembly("asm"))
    fmas = sum(FMA in i for i in body)
    if not fmas:
        return "no FMA loop found"
    kinds = Counter(i.split()[0] for i in body)
    return (f"hot loop: {len(body)} instructions, {fmas} FMA: {len(body) / fmas:.2f} per FMA "
            f"({', '.join(f'{k} {v}' for k, v in kinds.most_common())})")


def plans(blocks: list[str]) -> dict[str, Plan | dict | str | None]:
    """name -> an explicit plan, blocks for the policy's plan, or a variant for the policy
    (None: fused)."""
    out: dict[str, Plan | dict | str | None] = {"fused": None, "unfused": "unfused",
                                                "row blocks (before)": ROW_BLOCK_PLAN}
    for text in blocks:
        mr, nr, kc, nc = (int(v) for v in text.lower().split("x"))
        out[f"gemm {text}"] = dict(mr=mr, nr=nr, kc=kc, nc=nc)
    return out


def build(spec: str, name: str, how, inputs: dict):
    if isinstance(how, dict):  # the policy's plan with other blocks
        base = redfuser.compile(spec, tune=False)
        base.prepare(**inputs)
        how = dataclasses.replace(base.plan, reason=f"--blocks {name}", **how)
    kernel = (redfuser.compile(spec, plan=how) if isinstance(how, Plan) else
              redfuser.compile(spec, variant=how, tune=False))
    kernel(**inputs)
    return kernel


def run(rows: int, n: int, d: int, rounds: int, blocks: list[str]) -> None:
    import torch  # the comparison needs it (the test extras install it)

    torch.set_num_threads(default_threads())
    rng = np.random.default_rng(0)
    inputs = {"x": rng.normal(size=(rows, n)).astype(np.float32),
              "w": (rng.normal(size=(n, d)) / np.sqrt(n)).astype(np.float32), "eps": 1e-6}
    peak, fma = limits(torch)["gflops"], fma_peak()
    fns = {}
    for name, how in plans(blocks).items():
        kernel = build("rmsnorm_gemm", name, how, inputs)
        print(f"{name}: {kernel.plan}\n    {describe_loop(kernel)}", flush=True)
        out = {k: np.empty_like(v) for k, v in kernel(**inputs).items()}
        fns[name] = lambda kernel=kernel, out=out: kernel(**inputs, out=out)
    tx, tw = torch.from_numpy(inputs["x"]), torch.from_numpy(inputs["w"])
    fns["torch"] = lambda: torch.nn.functional.rms_norm(tx, (n,), eps=1e-6) @ tw
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            settle()  # torch's threads spin after its call (timing.py)
            times[k].append(seconds(fn))
    flops, ref = 2.0 * rows * n * d, float(np.median(times["torch"]))
    print(f"\n{rows} x {n} -> {d}, {default_threads()} threads, {rounds} interleaved rounds; "
          f"torch 2048^3 matmul {peak:.1f} GFLOP/s, FMA peak {fma:.1f} GFLOP/s")
    for k, t in times.items():
        med, best = float(np.median(t)), float(np.min(t))
        rate = flops / med / 1e9
        print(f"{k:<20} median {med * 1e3:8.2f} ms  best {best * 1e3:8.2f} ms  {rate:6.1f} "
              f"GFLOP/s ({rate / fma:4.0%} of FMA peak, {rate / peak:4.0%} of torch's 2048^3)"
              f"  torch/this {ref / med:5.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redfuser.tools.gemm_bench", description=__doc__)
    p.add_argument("--shape", default="256x4096x4096", help="ROWSxNxD (x: ROWS x N, w: N x D)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--blocks", nargs="*", default=[], help="extra blockings MRxNRxKCxNC")
    args = p.parse_args(argv)
    rows, n, d = (int(v) for v in args.shape.lower().split("x"))
    run(rows, n, d, args.rounds, args.blocks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
