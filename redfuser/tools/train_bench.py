"""Training benchmark: forward + backward of redfuser ops against torch (a script, not a test).

``python -m redfuser.tools.train_bench [--scale S] [--repeat R] [--compile]``

For each workload, one training step (forward, then ``backward`` of a random upstream
gradient into every input that requires grad; a mean loss, ``MEAN_LOSS``: its
``loss.backward()``) with the redfuser op (its derived, proven backward:
``algebra.backward``) and with torch eager (attention: SDPA, whichever CPU
backend torch picks; ``--compile``: also ``torch.compile``), float32 on the CPU.  Each
(workload, implementation) runs in a process of its own, so that TVM's thread pool never
shares a process with torch's and each peak is the process's own: the median step time
of ``repeat`` steps after two warm-up steps, and the peak memory the steps add to what the
inputs hold (Linux's high-water mark of the resident set, reset after the warm-up:
``/proc/self/clear_refs``).  Ratios are printed
from this one run (the machines are shared and noisy).

Every process, redfuser's and torch's alike, runs with ``PROCESS_ENV`` (each row says
why; torch is no slower with them, so it is timed at its best); ``--defaults`` leaves the
environment as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

# workload -> (op, differentiated output, inputs: name -> (kind, shape at scale 1))
WORKLOADS = {
    "softmax 4096x4096": ("softmax", "y", {"x": ("normal", (4096, 4096))}),
    "layernorm 4096x4096": ("layernorm", "y", {"x": ("normal", (4096, 4096)),
                                               "eps": ("scalar", 1e-5),
                                               "g": ("weight", (4096,)),
                                               "b": ("weight", (4096,))}),
    "rmsnorm 4096x4096": ("rmsnorm", "y", {"x": ("normal", (4096, 4096)),
                                           "eps": ("scalar", 1e-5), "g": ("weight", (4096,))}),
    "cross_entropy 4096x32000": ("cross_entropy", "loss", {"x": ("normal", (4096, 32000)),
                                                           "t": ("onehot", (4096, 32000))}),
    "attention 8x1024x1024 D64": ("attention", "o", {"q": ("normal", (8, 1024, 64)),
                                                     "k": ("normal", (8, 1, 1024, 64)),
                                                     "scale": ("scalar", 0.125),
                                                     "v": ("normal", (8, 1, 1024, 64))}),
    "causal 8x1024x1024 D64": ("causal_attention", "o", {"pos": ("positions", (1, 1024)),
                                                         "q": ("normal", (8, 1024, 64)),
                                                         "k": ("normal", (8, 1, 1024, 64)),
                                                         "scale": ("scalar", 0.125),
                                                         "v": ("normal", (8, 1, 1024, 64))}),
    "linear_ce 4096x2048->32000": ("linear_cross_entropy", "loss",
                                   {"h": ("normal", (4096, 2048)),
                                    "w": ("head", (32000, 2048)),
                                    "label": ("labels", (4096, 32000))}),
    "linear_ce mean 4096x2048->32000": ("linear_cross_entropy", "loss",
                                        {"h": ("normal", (4096, 2048)),
                                         "w": ("head", (32000, 2048)),
                                         "label": ("labels", (4096, 32000))}),
}
# the workloads whose loss is the mean over the rows, stepped by ``loss.backward()`` as a
# training step is: redfuser's is ``redfuser.torch_loss.reduced`` (its forward computes the
# gradients: three products, not four), torch's the mean of its per-row losses
MEAN_LOSS = ("linear_ce mean 4096x2048->32000",)
IMPLS = ("redfuser", "torch", "torch.compile")
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
# (variable, value, why): measured on a 2-core Emerald Rapids Xeon, one run each
PROCESS_ENV = (
    # a step writes fresh outputs and gradients of 64 MB and more: with 4 KB pages the
    # first touch of each page costs about what the step's own work does (torch's
    # LayerNorm step 29 ms, 17 ms with 2 MB pages); applied only where the host offers them
    ("THP_MEM_ALLOC_ENABLE", "1", "torch's CPU allocator asks for 2 MB pages"),
    # libgomp's idle workers spin 300000 pauses (~10 ms on this CPU) after each of torch's
    # parallel ops, on the cores TVM's pool then runs on: attention's block map took 11-14
    # ms against 4; torch's SDPA step is the same either way (39-41 ms)
    ("GOMP_SPINCOUNT", "1000", "torch's idle OpenMP workers sleep soon after an op"),
)


def _inputs(torch, spec: dict, scale: float) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (kind, shape) in spec.items():
        if kind == "scalar":
            out[name] = shape
            continue
        shape = tuple(max(1, round(s * math.sqrt(scale))) for s in shape)
        if kind == "onehot":
            labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
            out[name] = torch.nn.functional.one_hot(labels, shape[-1]).float()
        elif kind == "labels":  # rows x classes: a class index per row, as a float
            out[name] = torch.randint(0, shape[-1], shape[:-1], generator=g).float()
        elif kind == "positions":  # query l at position l (causal)
            out[name] = torch.arange(shape[-1], dtype=torch.float32).reshape(shape)
        elif kind == "head":  # an LM head: logits of order 1
            out[name] = (torch.randn(shape, generator=g) / math.sqrt(shape[-1])) \
                .requires_grad_()
        elif kind == "weight":
            out[name] = (torch.rand(shape, generator=g) + 0.5).requires_grad_()
        else:
            out[name] = torch.randn(shape, generator=g).requires_grad_()
    return out


def _torch_fn(torch, op: str):
    F = torch.nn.functional
    return {
        "softmax": lambda x: torch.softmax(x, -1),
        "layernorm": lambda x, eps, g, b: F.layer_norm(x, (x.shape[-1],), g, b, eps),
        "rmsnorm": lambda x, eps, g: F.rms_norm(x, (x.shape[-1],), g, eps),
        "cross_entropy": lambda x, t: F.cross_entropy(x, t.argmax(-1), reduction="none"),
        "attention": lambda q, k, scale, v: F.scaled_dot_product_attention(
            q, k[:, 0], v[:, 0], scale=scale),
        "causal_attention": lambda pos, q, k, scale, v: F.scaled_dot_product_attention(
            q, k[:, 0], v[:, 0], is_causal=True, scale=scale),
        "linear_cross_entropy": lambda h, w, label: F.cross_entropy(h @ w.T, label.long(),
                                                                    reduction="none"),
    }[op]


def _step_fn(torch, impl: str, op: str, out_name: str, inputs: dict, mean: bool):
    scalars = tuple(k for k, v in inputs.items() if isinstance(v, float))
    if impl == "redfuser" and mean:
        from redfuser.torch_loss import reduced  # loads TVM: only in a redfuser case's process

        loss = reduced(op, out_name, "mean", scalars=scalars)
        forward = lambda: loss(*(inputs[k] for k in loss.inputs))  # noqa: E731
    elif impl == "redfuser":
        import redfuser.torch as rt  # as above

        cascade = rt.op(op, scalars=scalars)
        index = cascade.outputs.index(out_name)
        args = [inputs[k] for k in cascade.inputs]
        forward = lambda: cascade(*args)[index]  # noqa: E731
    else:
        per_row = _torch_fn(torch, op)
        fn = (lambda *a: per_row(*a).mean()) if mean else per_row  # noqa: E731
        fn = torch.compile(fn) if impl == "torch.compile" else fn
        forward = lambda: fn(*inputs.values())  # noqa: E731
    upstream = None if mean else torch.randn(forward().shape,
                                             generator=torch.Generator().manual_seed(1))

    def step():
        for v in inputs.values():
            if isinstance(v, torch.Tensor):
                v.grad = None
        forward().backward(upstream)
    return step


def _status(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def case(workload: str, impl: str, scale: float, repeat: int) -> dict:
    """One (workload, implementation) in this process: median step ms and peak extra MB."""
    import torch  # in the case's own process only (the parent never loads it)

    op, out_name, spec = WORKLOADS[workload]
    inputs = _inputs(torch, spec, scale)
    step = _step_fn(torch, impl, op, out_name, inputs, workload in MEAN_LOSS)
    for _ in range(2):
        step()
    for v in inputs.values():  # the gradients the warm-up left, as every step leaves them
        if isinstance(v, torch.Tensor):
            v.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark
    base = _status("VmRSS")
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return {"ms": times[len(times) // 2], "peak_mb": (_status("VmHWM") - base) / 2**20}


def process_env() -> dict[str, str]:
    """``PROCESS_ENV`` as variables, less huge pages where the kernel never hands them out
    (``/sys/kernel/mm/transparent_hugepage/enabled`` reads ``[never]``)."""
    try:
        with open(THP) as f:
            huge = "[never]" not in f.read()
    except OSError:
        huge = False
    return {k: v for k, v, _ in PROCESS_ENV if huge or k != "THP_MEM_ALLOC_ENABLE"}


def _in_subprocess(workload: str, impl: str, scale: float, repeat: int,
                   env: dict[str, str]) -> dict | str:
    cmd = [sys.executable, "-m", "redfuser.tools.train_bench", "--case", workload, impl,
           "--scale", str(scale), "--repeat", str(repeat)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | env)
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(scale: float, repeat: int, with_compile: bool, only: list[str] | None = None,
        defaults: bool = False) -> None:
    impls = IMPLS if with_compile else IMPLS[:2]
    env = {} if defaults else process_env()
    print(f"training step (forward + backward), float32, CPU, scale {scale}; median of "
          f"{repeat}; peak = memory the step adds to its inputs; environment"
          f"{':' if env else ' as it is'}", flush=True)
    for k, v, why in PROCESS_ENV:
        if k in env:
            print(f"  {k}={v}: {why}", flush=True)
    head = "".join(f"{i + ' ms':>18}{i + ' MB':>18}" for i in impls)
    print(f"{'workload':<26}{head}{'vs torch':>10}{'mem ratio':>11}", flush=True)
    for workload in WORKLOADS:
        if only and not any(o in workload for o in only):
            continue
        results = {i: _in_subprocess(workload, i, scale, repeat, env) for i in impls}
        cells = "".join(f"{r['ms']:>18.2f}{r['peak_mb']:>18.1f}" if isinstance(r, dict)
                        else f"{'error':>36}" for r in results.values())
        ours, theirs = results["redfuser"], results["torch"]
        ratio = mem = ""
        if isinstance(ours, dict) and isinstance(theirs, dict):
            ratio = f"{theirs['ms'] / ours['ms']:.2f}x"
            mem = f"{ours['peak_mb'] / max(theirs['peak_mb'], 1e-9):.2f}"
        print(f"{workload:<26}{cells}{ratio:>10}{mem:>11}", flush=True)
        for i, r in results.items():
            if not isinstance(r, dict):
                print(f"  {i}: {r}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0, help="element-count scale (1: full)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="also time torch.compile")
    p.add_argument("--only", nargs="*", default=None, help="workloads whose name contains one")
    p.add_argument("--defaults", action="store_true",
                   help="leave the environment as it is (no PROCESS_ENV)")
    p.add_argument("--case", nargs=2, metavar=("WORKLOAD", "IMPL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(case(*args.case, args.scale, args.repeat)))
        return 0
    run(args.scale, args.repeat, args.compile, args.only, args.defaults)
    return 0


if __name__ == "__main__":
    sys.exit(main())
