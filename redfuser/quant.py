"""Per-token int8 quantization + GEMM on the CPU, exact: ``redfuser.quant_gemm(x, wq, ws)``.

The cascade (``QUANT_GEMM_SPEC``; ``redfuser.derive(QUANT_GEMM_SPEC, passes="auto")`` cuts it
into two stages, the max and the quantized sum, and ``redfuser.reference`` is its float64
oracle)::

    a = max(abs(x[i]))
    y = sum(clip(round(x[i] * 127 / a), -127, 127) * wq[i, :]) * a / 127 * ws[:]

with ``x`` float32, bfloat16 or float16 (*rows, K), ``wq`` int8 (K, N), ``ws`` float32 (N,),
``y`` float32 (*rows, N).  Low-precision activations are converted to float32 as the
kernel loads them (exact: ``algebra.dtypes``), and the result is that of those float32
values.  The quantized values are numpy's float32 evaluation of the same expression,
their products with the weights are summed exactly in int32, and the scaling is the
spec's, left to right in float32: ``y`` is bit-identical to numpy quantize-then-GEMM.  The
kernel (``lowering.cpu.int8``) uses AMX tiles where the CPU has them and Linux grants them to
the process, AVX-512 VNNI where the CPU has it, AVX2 otherwise.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import numpy as np
import sympy as sp

from algebra import NotFusable, derive
from algebra.dtypes import STORAGE
from algebra.functions import bounds
from algebra.layout import bits_view

from .lowering.cpu.int8 import quant_gemm as quant_gemm_func
from .lowering.cpu.int8_isa import DotIsa, check_k
from .lowering.cpu.int8_pack import pack_weights as pack_weights_func
from .lowering.cpu.int8_pack import scratch_shapes, weight_shapes
from .lowering.cpu.vector import isa_for
from .tvm.runtime import build, empty_aligned, from_numpy, host_source, time_ms
from .tvm.target import cpu_has, device, host_grants_amx, host_target

QUANT_GEMM_SPEC = ("a = max(abs(x[i]))\n"
                   "y = sum(clip(round(x[i] * 127 / a), -127, 127) * wq[i, :]) * a / 127 * ws[:]")
FUNC_NAME, PACK_NAME = "quant_gemm", "pack_weights"
# argument -> (its dtypes, what its shape must be), checked before anything runs
EXPECTED = {"x": (tuple(s.numpy for s in STORAGE.values()), "(*rows, K)"),
            "wq": ((np.dtype(np.int8),), "(K, N)"), "ws": ((np.dtype(np.float32),), "(N,)")}


INT8 = (-128, 127)  # the weights' range: an int8 stream


@functools.lru_cache(maxsize=4)
def integer_product_range(spec: str = QUANT_GEMM_SPEC) -> tuple[int, int]:
    """Why int32 sums are exact: derived from the spec, not assumed.  The last stage of
    ``spec`` (``QUANT_GEMM_SPEC``) sums ``wq * clip(round(...), lo, hi)``; the engine must show the
    clip factor is an integer with constant bounds inside int8, and ``wq`` is int8 (the call
    checks its dtype).  Returns the factor's bounds; NotFusable when it cannot be shown.

    Examples
    --------
    >>> integer_product_range()
    (-127, 127)
    """
    stage = derive(spec, passes="auto").stages[-1]
    (comp,) = stage.rule.components
    # the kernel's integer case: rows whose max a is positive and finite (the others are NaN
    # rows, as in numpy), so a is a positive symbol there
    good_rows = {sym: sp.Symbol(sym.name, positive=True)
                 for sym in comp.basis[0].free_symbols if sym.name in stage.reads}
    basis = comp.basis[0].subs(good_rows)
    for factor in sp.Mul.make_args(basis):
        span = bounds(factor)
        if span is not None and factor.is_integer and INT8[0] <= span[0] <= span[1] <= INT8[1]:
            return int(span[0]), int(span[1])
    raise NotFusable(comp.columns[0].name, basis, f"has no factor proven an integer in "
                     f"{list(INT8)}: its products cannot be summed exactly in int32")


class QuantGemm:
    """The compiled kernel per shape, with its scratch buffers (allocated once per shape and
    calling thread: the kernel writes them, and runs without the GIL, so two threads calling
    at once must not share them); ``pack`` packs weights once for calls that reuse them.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((3, 40)).astype(np.float32)
    >>> wq = rng.integers(-127, 128, (40, 24)).astype(np.int8)
    >>> ws = np.full(24, 0.01, np.float32)
    >>> y = QuantGemm()(x, wq, ws)
    >>> a = np.abs(x).max(axis=1, keepdims=True)
    >>> q = np.clip(np.round(x * np.float32(127) / a), -127, 127)
    >>> ref = (q.astype(np.float64) @ wq).astype(np.float32) * a / np.float32(127) * ws
    >>> np.array_equal(y, ref)
    True
    >>> kernel = QuantGemm()  # weights that do not change: packed once
    >>> np.array_equal(kernel(x, kernel.pack(wq), ws), ref)
    True
    """

    def __init__(self, target: dict | None = None, isa: DotIsa | None = None):
        """``target``: the host CPU by default (with AMX where granted); ``isa``: one of
        ``lowering.cpu.vector.INT8_ISAS`` the target has (default: the best)."""
        self.target = target or host_target()
        self.isa: DotIsa = isa or isa_for(self.target)
        if not cpu_has(self.target, self.isa.feature):
            raise ValueError(f"target {self.target} has no {self.isa.feature} for {self.isa.name}")
        if self.isa.tiles and not host_grants_amx():  # the kernels run here: SIGILL
            raise RuntimeError(f"target {self.target} has AMX, and this process may not use "
                               "AMX tiles (Linux refused ARCH_REQ_XCOMP_PERM)")
        self.range = integer_product_range()  # the proof the int32 sums rest on
        self._built: dict[tuple, object] = {}  # (m, k, n, packed, x's dtype) -> executable
        self._scratch = threading.local()  # .buffers: (m, k, n, packed) -> scratch arrays
        self._packers: dict[tuple, object] = {}  # (k, n) -> pack_weights executable
        self._last = None

    def __call__(self, x, wq, ws) -> np.ndarray:
        """``y`` for ``x`` (*rows, K) and ``wq`` int8 (K, N) or ``self.pack(wq)``."""
        x, wq, ws = _checked(x, wq, ws, self.isa)
        rows, (k, n) = x.shape[:-1], wq.shape
        m = math.prod(rows)
        if m == 0 or n == 0 or k == 0:  # K = 0: a = max() = -inf, 0 * -inf is NaN
            return np.full(rows + (n,), np.nan if k == 0 else 0, np.float32)
        y = empty_aligned((m, n), np.float32)
        ex, args = self._args(x.reshape(m, k), wq, ws, y)
        ex[FUNC_NAME](*args)
        return y.reshape(rows + (n,))

    def pack(self, wq) -> PackedWeights:
        """``wq`` int8 (K, N) packed for this kernel's ISA once, for weights that do not
        change between calls (a snapshot: pack again after changing ``wq``)."""
        wq = _checked_weights(wq)
        (k, n), packed = wq.shape, ()
        if k and n:
            check_k(self.isa, k)
            if (k, n) not in self._packers:
                self._packers[k, n] = build(pack_weights_func(self.isa, k, n, PACK_NAME),
                                            self.target)
            packed = tuple(empty_aligned(shape, dtype)
                           for shape, dtype in weight_shapes(self.isa, k, n).values())
            self._packers[k, n][PACK_NAME](*(from_numpy(a) for a in (wq, *packed)))
        return PackedWeights(self.isa.name, (k, n), packed)

    def _args(self, x: np.ndarray, wq, ws: np.ndarray, y: np.ndarray) -> tuple:
        """The executable for these shapes and its arguments, packed weights or not."""
        (m, k), n, packed = x.shape, y.shape[1], isinstance(wq, PackedWeights)
        key, dtype = (m, k, n, packed), x.dtype.name
        if key + (dtype,) not in self._built:
            self._built[key + (dtype,)] = build(
                quant_gemm_func(self.isa, m, k, n, FUNC_NAME, packed, dtype), self.target)
        self._last = ex = self._built[key + (dtype,)]
        weights = wq.arrays if packed else (wq,)
        return ex, [from_numpy(a) for a in (bits_view(x), *weights, ws, y,
                                             *self._scratch_for(key))]

    def _scratch_for(self, key: tuple) -> list[np.ndarray]:
        """This thread's scratch buffers for shape ``key``, allocated on its first call:
        once per shape, not per call (fresh pages every call cost more than the packing;
        ``scratch_shapes``), and per thread (a lock would serialise the callers)."""
        buffers = getattr(self._scratch, "buffers", None)
        if buffers is None:
            buffers = self._scratch.buffers = {}
        if key not in buffers:
            buffers[key] = [empty_aligned(shape, dtype) for shape, dtype in
                            scratch_shapes(self.isa, *key).values()]
        return buffers[key]

    def time(self, x, wq, ws, repeat: int = 5) -> float:
        """Median milliseconds of one call on these inputs (after a warm-up call)."""
        x, wq, ws = _checked(x, wq, ws, self.isa)
        m, (k, n) = math.prod(x.shape[:-1]), wq.shape
        ex, args = self._args(x.reshape(m, k), wq, ws, empty_aligned((m, n), np.float32))
        return time_ms(ex, FUNC_NAME, device(self.target), args, repeat)

    def assembly(self) -> str:
        """The CPU code of the most recently used shape."""
        if self._last is None:
            raise RuntimeError("call the kernel once first")
        return host_source(self._last, "asm")


@dataclass(frozen=True)
class PackedWeights:
    """int8 weights (K, N) packed by ``QuantGemm.pack`` for one ISA: the kernel's panels
    (and column sums where the activations are offset), in place of ``wq``."""

    isa: str
    shape: tuple[int, int]
    arrays: tuple[np.ndarray, ...]

    ndim = 2


def _checked_array(name: str, value) -> np.ndarray:
    """``value`` as a C-contiguous array of the input's dtype, or a clear error naming it."""
    dtypes, shape = EXPECTED[name]
    a = np.asarray(value)
    if a.dtype not in dtypes:
        raise TypeError(f"input '{name}' has dtype {a.dtype}; expected "
                        f"{' or '.join(d.name for d in dtypes)} of shape {shape}")
    return np.ascontiguousarray(a)


def _checked_weights(wq) -> np.ndarray:
    wq = _checked_array("wq", wq)
    if wq.ndim != 2:
        raise ValueError(f"input 'wq' has shape {wq.shape}; expected (K, N)")
    return wq


def _checked(x, wq, ws, isa: DotIsa) -> tuple:
    """The inputs as C-contiguous arrays of their dtypes (``wq`` also packed for ``isa``),
    or a clear error naming one."""
    x, ws = _checked_array("x", x), _checked_array("ws", ws)
    if isinstance(wq, PackedWeights):
        if wq.isa != isa.name:
            raise ValueError(f"input 'wq' was packed for {wq.isa}; this kernel uses {isa.name}")
    else:
        wq = _checked_array("wq", wq)
    if x.ndim < 1 or wq.ndim != 2 or ws.ndim != 1:
        raise ValueError(f"inputs have shapes x {x.shape}, wq {wq.shape}, ws {ws.shape}; "
                         "expected x (*rows, K), wq (K, N), ws (N,)")
    if x.shape[-1] != wq.shape[0] or ws.shape[0] != wq.shape[1]:
        raise ValueError(f"inputs have shapes x {x.shape}, wq {wq.shape}, ws {ws.shape}; "
                         "expected x (*rows, K), wq (K, N), ws (N,) with matching K and N")
    return x, wq, ws


@functools.lru_cache(maxsize=1)
def _default() -> QuantGemm:
    return QuantGemm()


def quant_gemm(x, wq, ws) -> np.ndarray:
    """``y = quantize(x) @ wq * a / 127 * ws`` exactly (see the module docstring), on the
    host CPU; compiled once per shape.

    Examples
    --------
    >>> x = np.array([[1.0, -2.0, 0.5, 4.0]], np.float32)
    >>> quant_gemm(x, np.eye(4, dtype=np.int8), np.ones(4, np.float32))
    array([[ 1.007874, -2.015748,  0.503937,  4.      ]], dtype=float32)
    """
    return _default()(x, wq, ws)
