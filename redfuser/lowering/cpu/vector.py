"""The host CPU's vector unit and caches: the facts every CPU plan is sized by.

One row of ``VECTOR_ISAS`` per vector instruction set, best first: the CPU's one table of
instruction sets.  The host's row is the first whose LLVM feature its CPU has
(``host_isa``).  A row owns its lane count, its register count, the GEMM micro-kernel that
fits those registers and its integer dot products, best first (``int8_isa``; each needs its
own feature too, e.g. VNNI on AVX-512: ``isa_for`` picks one); ``host_caches`` reads
the L1 and L2 data cache sizes Linux reports.  Nothing else in the CPU lowering names a
lane count, a register count or a cache size.

Sizing a micro-kernel: ``rows x vectors`` sums, ``vectors`` panel loads and one broadcast
live in the registers at once, and there must be enough independent sums to cover the
multiply-add latency (two pipes x four cycles on recent x86 cores: 8 in flight).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import numpy as np

from algebra.dtypes import COMPUTE

from ...tvm.target import cpu_has, host_target
from ..fastmath import fast_exp
from .int8_isa import AMX_INT8, AVX2_BYTES, AVX2_INT16, AVX512_VNNI, QMAX, DotIsa

FMA_IN_FLIGHT = 8  # multiply-adds in flight per core: 2 pipes x 4 cycles of latency


@dataclass(frozen=True)
class VectorIsa:
    """One vector instruction set (see the module docstring)."""

    name: str
    feature: str  # the LLVM CPU feature that has it
    lanes: int  # float32 lanes of a register
    registers: int  # vector registers the compiler can allocate
    gemm_rows: int  # micro-kernel rows (one broadcast each per step)
    gemm_vectors: int  # micro-kernel columns in registers: nr = vectors x lanes
    why: str
    int8: tuple[DotIsa, ...] = ()  # its exact int8 dot products, best first
    # LLVM lowers a vector ldexp to one instruction (AVX-512's vscalefps; elsewhere a libm
    # call per lane): the fast exp scales by it (``fastmath.fast_exp``)
    ldexp: bool = False

    @property
    def gemm_sums(self) -> int:
        return self.gemm_rows * self.gemm_vectors

    def lanes_of(self, dtype: str) -> int:
        """Lanes of a register holding ``dtype`` (``lanes`` counts float32's: a float64
        vector holds half as many).

        Examples
        --------
        >>> VECTOR_ISAS[0].lanes_of("float64"), VECTOR_ISAS[0].lanes_of("float32")
        (8, 16)
        """
        return self.lanes * COMPUTE.numpy.itemsize // np.dtype(dtype).itemsize

    def fits(self, rows: int, columns: int) -> bool:
        """Do a ``rows x columns`` micro-kernel's sums, panel vectors and broadcast fit the
        registers (``columns`` a whole number of vectors)?"""
        vectors, rest = divmod(columns, self.lanes)
        return not rest and rows * vectors + vectors + 1 <= self.registers


VECTOR_ISAS: tuple[VectorIsa, ...] = (
    VectorIsa("avx512", "avx512f", 16, 32, 6, 4,
              "6 x 4 = 24 sums + 4 panel vectors + 1 broadcast of 32 zmm (measured on Zen 5, "
              "RMSNorm + GEMM 256 x 4096 -> 4096)", (AMX_INT8, AVX512_VNNI), ldexp=True),
    VectorIsa("avx2", "avx2", 8, 16, 4, 3,
              "4 x 3 = 12 sums + 3 panel vectors + 1 broadcast of 16 ymm (measured on Zen 3, "
              "RMSNorm + GEMM 256 x 4096 -> 4096: 4 x 24 at 43 ms, 6 x 16 at 58 ms)",
              (AVX2_BYTES, AVX2_INT16)),
    VectorIsa("neon", "neon", 4, 32, 6, 4,
              "6 x 4 = 24 sums + 4 + 1 of 32 q registers (the register budget; not measured)"),
    VectorIsa("sse2", "sse2", 4, 16, 4, 3,
              "4 x 3 = 12 sums + 3 + 1 of 16 xmm (the register budget; not measured)"),
)

INT8_ISAS = tuple(dot for isa in VECTOR_ISAS for dot in isa.int8)  # the int8 column, best first


@dataclass(frozen=True)
class Narrowing:
    """An instruction that rounds ``lanes`` float32 lanes to a storage dtype at once (where
    the CPU has ``feature``), in place of the portable rounding (``texpr.stored``)."""

    dtype: str  # the storage dtype's name (``algebra.dtypes``)
    feature: str
    intrinsic: str  # the LLVM intrinsic: <lanes x float> -> <lanes x storage>
    lanes: int
    why: str


NARROWINGS: tuple[Narrowing, ...] = (
    Narrowing("bfloat16", "avx512bf16", "llvm.x86.avx512bf16.cvtneps2bf16.512", 16,
              "one vcvtneps2bf16 rounds 16 lanes to nearest even (NaN kept quiet) where the "
              "portable rounding takes nine integer operations (bfloat16 RMSNorm 4096 x 4096: "
              "1.29 against 1.78 ms, Emerald Rapids); it flushes float32 subnormals to zero, "
              "and bfloat16's subnormals are float32's: below what float32 compute promises"),
)


def host_exp(x):
    """The fast exp for this CPU's vector unit (``VectorIsa.ldexp``).

    Examples
    --------
    >>> from redfuser.tvm.ir import tirx
    >>> str(host_exp(tirx.Var("x", "float32")).ty.dtype)
    'float32'
    """
    return fast_exp(x, ldexp=host_isa().ldexp)


@cache
def host_narrowing(dtype: str, lanes: int) -> str | None:
    """The intrinsic of ``NARROWINGS`` that rounds ``lanes`` float32 lanes to ``dtype`` on
    this CPU, None where it has none (float16 needs none: LLVM's own cast is F16C).

    Examples
    --------
    >>> host_narrowing("float32", 16) is None
    True
    """
    target = host_target()
    return next((n.intrinsic for n in NARROWINGS if n.dtype == dtype and n.lanes == lanes and
                 cpu_has(target, n.feature)), None)


@dataclass(frozen=True)
class Caches:
    """Per-core data cache sizes and the cache line, in bytes."""

    l1: int
    l2: int
    line: int = 64


DEFAULT_CACHES = Caches(l1=32 << 10, l2=1 << 20)  # where Linux does not say (other systems)
CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


@lru_cache(maxsize=1)
def host_isa() -> VectorIsa:
    """The best row of ``VECTOR_ISAS`` this CPU has (the last one, SSE2, on any x86-64).

    Examples
    --------
    >>> isa = host_isa()
    >>> isa.fits(isa.gemm_rows, isa.gemm_vectors * isa.lanes)
    True
    """
    target = host_target()
    return next((isa for isa in VECTOR_ISAS if cpu_has(target, isa.feature)), VECTOR_ISAS[-1])


def isa_for(target: dict, lowest: int = -QMAX) -> DotIsa:
    """The best integer dot product ``target`` has for activations down to ``lowest`` (the
    quantized range by default; -128 for any int8), a clear error when it has none.

    Examples
    --------
    >>> isa_for({"kind": "llvm", "mcpu": "icelake-server"}).name
    'avx512-vnni'
    >>> isa_for({"kind": "llvm", "mcpu": "znver3"}).name
    'avx2'
    >>> isa_for({"kind": "llvm", "mcpu": "znver3"}, lowest=-128).name
    'avx2-int16'
    """
    for isa in INT8_ISAS:
        if cpu_has(target, isa.feature) and isa.lowest <= lowest:
            return isa
    raise ValueError(f"the int8 GEMM needs one of {[i.feature for i in INT8_ISAS]}; "
                     f"target {target} has none")




@lru_cache(maxsize=1)
def host_caches() -> Caches:
    """The L1 data and L2 sizes and the line of CPU 0 as Linux reports them
    (``DEFAULT_CACHES`` where it does not).

    Examples
    --------
    >>> caches = host_caches()
    >>> caches.l2 > caches.l1 > 0
    True
    """
    found, line = {}, DEFAULT_CACHES.line
    for index in sorted(CACHE_DIR.glob("index*")):
        try:
            if (index / "type").read_text().strip() != "Instruction":
                found[int((index / "level").read_text())] = _bytes((index / "size").read_text())
                line = int((index / "coherency_line_size").read_text())
        except (OSError, ValueError):
            continue  # an entry Linux does not fill in: the default stands
    return Caches(l1=found.get(1) or DEFAULT_CACHES.l1, l2=found.get(2) or DEFAULT_CACHES.l2,
                  line=line)


def _bytes(text: str) -> int:
    """'32K' -> 32768 (sysfs writes sizes with a K or M suffix)."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("KM")) * scale
