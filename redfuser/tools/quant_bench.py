"""The quant + GEMM row of ``redfuser bench``: per-token int8 quantization + GEMM
(``redfuser.quant.quant_gemm``) against torch's dynamic int8 ``Linear``
(``torch.ao.quantization.quantize_dynamic``, which quantizes the activations per tensor to 7
bits on x86, so it is no exact twin), numpy quantize-then-GEMM (bit-identical to ours, checked
here) and our float32 RMSNorm+GEMM kernel on the same shape, in one run.  ``fused`` packs
the weights in every call; ``packed`` reuses ``QuantGemm.pack``'s, as torch's Linear reuses
the weights it packed when it was quantized.
"""

from __future__ import annotations

import warnings

import numpy as np

import redfuser

from ..quant import QuantGemm
from ..tvm.target import cpu_target
from .timing import median_ms

ROWS, K, N = 256, 4096, 4096
WEIGHT_SCALE = 1 / 64  # ws: per-column float scales of the int8 weights
QMAX = np.float32(127)


def median_each(fns: list, repeat: int) -> list[float]:
    """Median ms of each function over ``repeat`` calls in a row after a warm-up call (as the
    bench's other rows).  Not in turns: each call would follow another contender's, whose
    idle threads still spin (numpy's BLAS, torch's OpenMP) and which evicted the caches; in
    one run our kernel took 12.0 ms alone, 25.7 ms in turns with numpy, 16.4 with torch;
    ``timing.median_ms`` also lets the threads of the one before fall idle first."""
    return [median_ms(fn, repeat) for fn in fns]


def numpy_quant_gemm(x: np.ndarray, wq: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """Quantize-then-GEMM in numpy float32; the GEMM in float64 on the integers (exact)."""
    a = np.abs(x).max(axis=-1, keepdims=True)
    q = np.clip(np.round(x * QMAX / a), -127, 127)
    return (q.astype(np.float64) @ wq.astype(np.float64)).astype(np.float32) * a / QMAX * ws


def inputs(rng: np.random.Generator, scale: float) -> dict:
    rows = max(1, int(ROWS * scale))
    return {"x": rng.normal(size=(rows, K)).astype(np.float32),
            "wq": rng.integers(-127, 128, (K, N)).astype(np.int8),
            "ws": np.full(N, WEIGHT_SCALE, np.float32)}


def row(scale: float = 1.0, repeat: int = 5, torch=None) -> dict:
    """Milliseconds of each contender, and whether ours equals numpy bit for bit."""
    a = inputs(np.random.default_rng(0), scale)
    ours = QuantGemm()
    rms = redfuser.compile("rmsnorm_gemm", tune=False)
    w = (a["wq"] * np.float32(WEIGHT_SCALE)).astype(np.float32)
    packed = ours.pack(a["wq"])
    fns = {"fused": lambda: ours(**a), "packed": lambda: ours(a["x"], packed, a["ws"]),
           "numpy": lambda: numpy_quant_gemm(**a),
           "f32 rmsnorm+gemm": lambda: rms(x=a["x"], w=w, eps=1e-6)}
    if torch is not None:
        linear = torch.nn.Linear(K, N, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.T.copy()))
        with warnings.catch_warnings():  # torch deprecates its quantized tensor types
            warnings.simplefilter("ignore")
            qlinear = torch.ao.quantization.quantize_dynamic(
                torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8)
        tx = torch.from_numpy(a["x"])
        fns["torch int8"] = lambda: qlinear(tx)  # its weights packed once, when quantized
    times = median_each(list(fns.values()), repeat)
    out = dict(zip(fns, times, strict=True))
    ref = numpy_quant_gemm(**a)
    out["exact"] = bool(np.array_equal(ours(**a), ref)
                        and np.array_equal(ours(a["x"], packed, a["ws"]), ref))
    out["isa"], out["rows"] = ours.isa.name, a["x"].shape[0]
    return out


def line(r: dict) -> str:
    parts = [f"{k} {v:.1f} ms" for k, v in r.items() if isinstance(v, float)]
    ratios = [f"{name} / {ours} {r[name] / r[ours]:.2f}x"
              for name, ours in (("torch int8", "fused"), ("torch int8", "packed"),
                                 ("f32 rmsnorm+gemm", "fused")) if name in r]
    return (f"quant+gemm {r['rows']}x{K}->{N} ({r['isa']}, {cpu_target()['mcpu']}): "
            + ", ".join(parts) + "; " + ", ".join(ratios)
            + f"; bit-identical to numpy: {r['exact']}")
