"""When a rule's matrix products may run on the CPU's tile dot products (AMX-BF16): the
instructions as a table, and the conditions, with their reasons, as rows.

A tile dot product multiplies operands stored in a narrow dtype and sums in float32.  It
computes what the float32 register micro-kernel (``gemm.py``) computes only where every
product is exact in float32 and the operands reach it as they are stored: a product of two
bfloat16 values has at most 2 x 8 significant bits, so it is exact in float32's 24, and
the tile adds the products in float32, rounding to nearest even.  ``a(row, i)`` must
therefore be a bfloat16 input itself (RMSNorm + GEMM's ``x``: its ``1 / r`` is applied at
finalize), or a product of them (``x * g`` with a bfloat16 weight per element: 16 bits,
exact in float32, held exactly by two bfloat16 terms, one tile pass each): the unfused
baseline's ``x / r``, rounded to bfloat16 for the tile, would lose bits that the float32
kernel keeps, so it stays on the register kernel.  The analysis is
here; the nest is ``bf16_tiles``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy as sp

from algebra.rule import FusionRule

from ...tvm.target import cpu_has, host_grants_amx, host_target
from ..geometry import Geometry
from ..products import Product, products
from ..signature import F32

BF16 = "bfloat16"
MAX_TERMS = 2  # tile passes per product (two: 2 x 6.3 ms at 256 x 4096 -> 4096 < 22)


@dataclass(frozen=True)
class TileDot:
    """One tile dot-product instruction: ``C (float32) += A @ B`` on tile registers, both
    operands stored as ``operand``."""

    name: str
    feature: str  # the LLVM feature (``host_target``'s mattr, where the process is granted)
    intrinsic: str
    operand: str  # the storage dtype of A and B
    why: str


TILE_DOTS: tuple[TileDot, ...] = (
    TileDot("amx-bf16", "amx-bf16", "llvm.x86.tdpbf16ps", BF16,
            "16 x 32 by 32 x 16 bfloat16 products per instruction into 16 x 16 float32 sums "
            "(RMSNorm + GEMM 256 x 4096 -> 4096 in bfloat16, Emerald Rapids, one run: the "
            "products 6.3-6.6 ms on tiles, 22 ms on float32 FMAs)"),
)


def _stored_as(name: str, geo: Geometry, dtype: str) -> bool:
    return name in geo.inputs and geo.inputs[name].dtype == dtype


def operand_factors(p: Product, geo: Geometry, dtype: str) -> list[sp.Symbol] | None:
    """a(row, i) as a product of inputs stored as ``dtype``, each one value per element
    (``x``, or ``x * g`` with a weight per element); None where it is anything else."""
    factors = sp.Mul.make_args(p.row_factor)
    if not all(f.is_Symbol and _stored_as(f.name, geo, dtype) and
               geo.inputs[f.name].length == geo.n and geo.inputs[f.name].width == 1
               for f in factors):
        return None
    return list(factors)


def terms(p: Product, geo: Geometry, dot: TileDot) -> int:
    """How many operand-dtype values hold a(row, i) exactly: one per factor.  A product of
    k bfloat16 values has at most 8 k significant bits, exact in float32 for k <= 3; its
    top 8 bits rounded to bfloat16, then the rest, give k bfloat16 terms whose sum is it
    (``tile_gemm``: one tile pass per term)."""
    return len(operand_factors(p, geo, dot.operand) or ())


# (condition a product must meet, why a product failing it stays on the float32 kernel)
CONDITIONS: tuple[tuple[Callable[[Product, Geometry, TileDot], bool], str], ...] = (
    (lambda p, geo, dot: geo.compute == F32, "the kernel does not compute in float32"),
    (lambda p, geo, dot: _stored_as(p.weight, geo, dot.operand),
     "the shared matrix is not stored as the tile's operand dtype"),
    (lambda p, geo, dot: operand_factors(p, geo, dot.operand) is not None,
     "a(row, i) is not a product of inputs stored as the tile's operand dtype: rounding it "
     "to that dtype would lose bits the float32 kernel keeps"),
    (lambda p, geo, dot: terms(p, geo, dot) <= MAX_TERMS,
     f"a(row, i) is a product of more than {MAX_TERMS} inputs: one tile pass per factor "
     "would cost more than the float32 kernel"),
)


def refusal(p: Product, geo: Geometry, dot: TileDot) -> str | None:
    """Why product ``p`` may not run on ``dot`` at ``geo``; None where it may.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("rmsnorm_gemm")
    >>> geo = shape_geometry(rule, {"x": (64, 128), "w": (128, 64)})
    >>> (p,) = products(rule, geo)
    >>> refusal(p, geo, TILE_DOTS[0])  # float32 inputs
    "the shared matrix is not stored as the tile's operand dtype"
    """
    return next((why for ok, why in CONDITIONS if not ok(p, geo, dot)), None)


def host_tile_dot(rule: FusionRule, geo: Geometry) -> TileDot | None:
    """The first of ``TILE_DOTS`` this host has (and lets the process use) on which every
    matrix product of ``rule`` at ``geo`` may run; None where there is none."""
    found = products(rule, geo)
    if not found or not host_grants_amx():
        return None
    return next((dot for dot in TILE_DOTS if cpu_has(host_target(), dot.feature) and
                 all(refusal(p, geo, dot) is None for p in found)), None)


def tile_dot_named(name: str) -> TileDot:
    """The row of ``TILE_DOTS`` a plan names (``CpuPlan.tile_dot``)."""
    return next(dot for dot in TILE_DOTS if dot.name == name)
