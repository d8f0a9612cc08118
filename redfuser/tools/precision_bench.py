"""The bfloat16 and float16 rows of ``redfuser bench --low``: each workload with its
inputs in the low dtype (float32 compute inside, ``algebra.dtypes``), against torch in the
same dtype, our own float32 kernel on the same shape (float32 inputs), and, where the
bytes set the time, a preallocated copy of the low-precision input (``copy_``: the bytes a
memory-bound kernel must at least move, as 16-bit integers: numpy copies ml_dtypes'
bfloat16 element by element).  One process, medians of repeated calls, ratios from the
same run.  Our kernels write into preallocated outputs (``out=``), both dtypes, as the
copy writes into one.
"""

from __future__ import annotations

import argparse

import numpy as np

import redfuser
from algebra.dtypes import STORAGE
from algebra.layout import bits_view

from .timing import median_ms

LOW = ("bfloat16", "float16")


def _rows(r: int, n: int):
    def make(g, s, dt):
        return {"x": g.normal(size=(max(1, int(r * s)), n)).astype(dt)}
    return make


def _norm(r: int, n: int):
    def make(g, s, dt):
        return {"x": g.normal(size=(max(1, int(r * s)), n)).astype(dt),
                "g": g.uniform(0.5, 1.5, n).astype(dt), "eps": 1e-6}
    return make


def _attention(h: int, lq: int, lk: int, d: int):
    def make(g, s, dt):
        lk_s = max(1, int(lk * s))
        return {"q": g.normal(size=(h, lq, d)).astype(dt),
                "k": g.normal(size=(h, 1, lk_s, d)).astype(dt),
                "v": g.normal(size=(h, 1, lk_s, d)).astype(dt), "scale": d ** -0.5}
    return make


def _rms_gemm(r: int, k: int, n: int):
    def make(g, s, dt):
        return {"x": g.normal(size=(max(1, int(r * s)), k)).astype(dt),
                "w": (g.normal(size=(k, n)) / np.sqrt(k)).astype(dt), "eps": 1e-6}
    return make


# name -> (library cascade, the input the copy moves, input maker (rng, scale, dtype)); no
# copy where the work, not the bytes, sets the time (a copy of q or of a 1 MB router input
# says nothing of attention's products or of a GEMM)
WORKLOADS = {
    "softmax 4096x4096": ("softmax", "x", _rows(4096, 4096)),
    "layernorm stats 4096x4096": ("variance", "x", _rows(4096, 4096)),
    "rmsnorm 4096x4096": ("rmsnorm", "x", _norm(4096, 4096)),
    "attention 8x1024x1024 D64": ("attention", None, _attention(8, 1024, 1024, 64)),
    "decode attention 8x1x32768 D128": ("attention", "k", _attention(8, 1, 32768, 128)),
    "moe routing 4096x256 top8": ("moe_routing", None, _rows(4096, 256)),
    "rmsnorm+gemm 256x4096->4096": ("rmsnorm_gemm", None, _rms_gemm(256, 4096, 4096)),
}


def _torch_fn(torch, spec: str):
    F = torch.nn.functional
    return {
        "softmax": lambda a: torch.softmax(a["x"], -1),
        "variance": lambda a: torch.var_mean(a["x"], -1, correction=0),
        "rmsnorm": lambda a: F.rms_norm(a["x"], a["x"].shape[-1:], a["g"], a["eps"]),
        "attention": lambda a: F.scaled_dot_product_attention(a["q"], a["k"][:, 0],
                                                              a["v"][:, 0], scale=a["scale"]),
        "moe_routing": lambda a: torch.topk(torch.softmax(a["x"], -1), 8, -1),
        "rmsnorm_gemm": lambda a: F.rms_norm(a["x"], a["x"].shape[-1:], None, a["eps"]) @ a["w"],
    }[spec]


def _to_torch(torch, value):
    """An input as a torch tensor over its memory (bfloat16 through its bits, which torch's
    ``from_numpy`` takes: ``algebra.layout.bits_view``)."""
    if not isinstance(value, np.ndarray):
        return value
    return torch.from_numpy(bits_view(value)).view(getattr(torch, value.dtype.name))


def row(name: str, dtype: str, scale: float, repeat: int, torch) -> dict:
    spec, moved, make = WORKLOADS[name]
    g = np.random.default_rng(0)
    low = make(g, scale, STORAGE[dtype].numpy)
    wide = {k: v.astype(np.float32) if isinstance(v, np.ndarray) else v for k, v in low.items()}
    ours = redfuser.compile(spec)
    out = {k: np.empty_like(v) for k, v in ours(**low).items()}
    out32 = {k: np.empty_like(v) for k, v in ours(**wide).items()}
    result = {"workload": name, "dtype": dtype,
              "ours": median_ms(lambda: ours(out=out, **low), repeat),
              "ours f32": median_ms(lambda: ours(out=out32, **wide), repeat)}
    if moved is not None:
        src = low[moved].view(np.int16)  # numpy copies ml_dtypes' bfloat16 one at a time
        into = np.empty_like(src)
        result["copy_"] = median_ms(lambda: np.copyto(into, src), repeat)
    if torch is not None:
        fn, tin = _torch_fn(torch, spec), {k: _to_torch(torch, v) for k, v in low.items()}
        with torch.no_grad():
            result["torch"] = median_ms(lambda: fn(tin), repeat)
    return result


def line(r: dict) -> str:
    cells = "".join(f"{r[c]:>11.2f}" if c in r else f"{'-':>11}"
                    for c in ("ours", "ours f32", "torch", "copy_"))
    ratios = [f"ours/copy_ {r['ours'] / r['copy_']:5.2f}" if "copy_" in r else
              f"ours/copy_ {'-':>5}", f"f32/ours {r['ours f32'] / r['ours']:5.2f}"]
    if "torch" in r:
        ratios.append(f"torch/ours {r['torch'] / r['ours']:5.2f}")
    return f"{r['workload']:<34}{r['dtype']:<10}{cells}   " + "  ".join(ratios)


def run(scale: float, repeat: int, only: str | None = None) -> None:
    try:  # torch is optional (a comparison only): without it, the rows lack its column
        import torch
    except ImportError:
        torch = None
    print(f"{'low precision (float32 inside)':<34}{'dtype':<10}"
          + "".join(f"{c:>11}" for c in ("ours", "ours f32", "torch", "copy_")), flush=True)
    for name in WORKLOADS:
        if only and only not in name:
            continue
        for dtype in LOW:
            print(line(row(name, dtype, scale, repeat, torch)), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redfuser.tools.precision_bench",
                                description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--only", help="the workloads whose name contains this")
    args = p.parse_args(argv)
    run(args.scale, args.repeat, args.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
