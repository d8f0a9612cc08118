"""Score tiles: which dot product of a rule runs as a blocked GEMM, and its blocking.

A rule whose element holds ``dot(h, w[i, :])``, ``h`` a feature vector of each row and ``w``
a stream matrix every row shares (linear_cross_entropy's logits), computes R x N dot
products of length D: a matrix product ``S = H W^T``.  Row by row (``tiles.tile_dots``) each
product is an inner-product tile with a horizontal sum at its end, and each group of
elements re-reads the rows' h from L2 (88 GFLOP/s at 512 x 2048 -> 8000 on AVX-512, half of
the GEMM micro-kernel's).  Here ``S`` is computed a tile at a time by the micro-kernel of
``gemm.py`` and each row of the tile is folded into the row's running state
(``score_tiles.py``), so every value of the dot that the rule reads is one entry of S.

The tile is ``S^T``: the micro-kernel's rows are stream elements (``mr`` rows of w, read in
place and broadcast) and its columns are rows of h (``nr`` of them per panel, h packed in
panels once per row block), so W, the large operand, is never copied or transposed; each
row of the tile is transposed into a row buffer before it is folded, one move per 2 D
multiply-adds.

A sum whose element is a scalar factor holding the dot times a row of the shared stream
matrix (the backward of linear_cross_entropy: ``dh = sum(f(dot(h, w[i, :])) * w[i, :])``,
and ``dw`` with the roles swapped) is two GEMMs a tile at a time: S as above, then the
factor ``P = f(S)`` elementwise and ``P W`` on the same micro-kernel (``score_product``,
lowered by ``score_products.py``).  This module knows nothing of the plan (``plan.py``
imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from algebra.rule import FusionRule

from ..geometry import Geometry
from ..invariants import rule_dots, score_symbol, with_scores
from ..products import Product, products
from .vector import host_caches, host_isa

ISA, CACHES = host_isa(), host_caches()
F32_BYTES = 4
# Fractions of a cache a block may take, so that the blocks that meet in it fit together:
# the micro-kernel's mr rows of w (one K piece) a quarter of L1 beside the panel vectors it
# streams; the packed rows of one K piece half of L2, the score tile a quarter of it.
W_ROWS_OF_L1, PACKED_OF_L2, TILE_OF_L2 = 4, 2, 4


@dataclass(frozen=True)
class ScoreDot:
    """The dot product a score tile computes: ``dot(row, weight[i, :])``."""

    dot: sp.Expr
    row: str  # the feature vector of each row (h): packed in panels
    weight: str  # the stream matrix every row shares (w): read in place
    folded: FusionRule  # the rule with the dot as a symbol: what each row of S folds


def score_dot(rule: FusionRule, geo: Geometry) -> ScoreDot | None:
    """The rule's one dot product when it is a per-row vector against a shared stream matrix
    at a static ``geo`` with elements and features; None otherwise (attention with a key
    stream per head row, two dots, an operand that is an expression).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("linear_cross_entropy")
    >>> found = score_dot(rule, shape_geometry(rule, {"h": (8, 64), "w": (100, 64)}))
    >>> found.row, found.weight
    ('h', 'w')
    """
    dots = rule_dots(rule)
    if not geo.static or not geo.n or not geo.d or len(dots) != 1:
        return None
    args = dots[0].args
    if not all(a.is_Symbol and a.name in geo.inputs for a in args):
        return None
    streams = {s.name for s in rule.cascade.streams}
    weight = [a.name for a in args if a.name in streams]
    row = [a.name for a in args if a.name not in streams]
    if len(weight) != 1 or len(row) != 1:
        return None
    w, h = geo.inputs[weight[0]], geo.inputs[row[0]]
    if w.count != 1 or w.width != geo.d or h.width != geo.d:
        return None
    return ScoreDot(dots[0], row[0], weight[0], with_scores(rule, tuple(dots))[0])


def score_blocks(rule: FusionRule, geo: Geometry, threads: int) -> dict[str, int] | None:
    """The blocking of a score tile for ``rule`` at ``geo`` (None where it does not apply:
    no such dot, fewer rows than one panel of the micro-kernel, mostly padding, or a stream
    matrix that fits L1, cheap to re-read): the micro-kernel of the host's ISA, K pieces whose
    mr rows of w fit L1, row blocks whose packed piece fits L2 (at most one block per thread
    where the rows allow it), and tiles of S that fit L2 beside it.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("linear_cross_entropy")
    >>> shapes = {"h": (512, 2048), "w": (8000, 2048), "label": (512,)}
    >>> blocks = score_blocks(rule, shape_geometry(rule, shapes), 2)
    >>> blocks["mc"] % blocks["nr"], blocks["nc"] % ISA.lanes, blocks["nt"]
    (0, 0, 1)
    """
    mr, nr = ISA.gemm_rows, ISA.gemm_vectors * ISA.lanes
    found = score_dot(rule, geo)
    if found is None or geo.r < nr or geo.n * geo.d * F32_BYTES <= CACHES.l1:
        return None
    kc = min(CACHES.l1 // W_ROWS_OF_L1 // (mr * F32_BYTES), geo.d)
    most = max(CACHES.l2 // PACKED_OF_L2 // (kc * F32_BYTES) // nr, 1) * nr
    share = -(-geo.r // (threads * nr)) * nr  # a thread's rows in whole panels
    mc = min(most, share)
    nc = max(CACHES.l2 // TILE_OF_L2 // (mc * F32_BYTES) // ISA.lanes, 1) * ISA.lanes
    return {"mr": mr, "nr": nr, "kc": kc, "nc": min(nc, geo.n), "mc": mc, "nt": 1}


def score_reason(found: ScoreDot, geo: Geometry, blocks: dict[str, int], lanes: int) -> str:
    """Why a plan computes ``found`` as score tiles, in words (the plan's reason)."""
    h, w = found.row, found.weight
    return (f"{geo.r} rows share the stream matrix {w}: each element's dot({h}, {w}[i, :]) is "
            f"an entry of S = {h} {w}^T, computed {blocks['mc']} rows x {blocks['nc']} "
            f"elements at a time by the GEMM micro-kernel ({blocks['mr']} rows of {w} read in "
            f"place x {blocks['nr']} rows of {h} packed, D in pieces of {blocks['kc']}); "
            f"each row of S folds in {lanes} lanes, its state carried from tile to tile")


def score_product(rule: FusionRule, geo: Geometry) -> Product | None:
    """The rule's one component as a product ``sum_i f(row, i, s_i) * weight[i, :]`` whose
    factor holds the score dot ``s_i = dot(row, weight[i, :])`` (``score_dot``) of the same
    stream matrix: with the dot standing for an entry of S, a matrix product
    (``lowering.products``) of that matrix; the returned factor holds the dot again.  None
    anywhere else (another component beside it, another stream matrix, no score dot).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> spec = redfuser.derive("linear_cross_entropy").backward().spec
    >>> rule = redfuser.derive(spec)
    >>> shapes = {"h": (8, 64), "w": (100, 64), "label": (8,), "m": (8,), "lse_sum": (8,),
    ...           "dloss": (8,)}
    >>> found = score_product(rule, shape_geometry(rule, shapes))
    >>> from algebra.functions import Dot
    >>> found.state, found.weight, sorted(str(d) for d in found.row_factor.atoms(Dot))
    ('dh', 'w', ['dot(h, w)'])
    """
    found = score_dot(rule, geo)
    if found is None or len(rule.components) != 1:
        return None
    prods = products(found.folded, geo)
    if len(prods) != 1 or prods[0].weight != found.weight:
        return None
    factor = prods[0].row_factor.xreplace({score_symbol(0): found.dot})
    return Product(rule.components[0], prods[0].state, found.weight, factor)


def product_columns(nc: int, nr: int, width: int) -> int:
    """Columns of the weight packed per block by a score product, whose K is a tile of
    ``nc`` elements: nc x columns x 4 B is half of L2 (``PACKED_OF_L2``, as a GEMM's
    ``KC x NC``), whole panels of ``nr``, at most the padded ``width``.

    >>> product_columns(64, 64, 128)
    128
    """
    return min(max(CACHES.l2 // PACKED_OF_L2 // (nc * F32_BYTES) // nr, 1) * nr, width)


def product_reason(p: Product, found: ScoreDot, blocks: dict[str, int]) -> str:
    """Why a plan runs ``p`` as score products, in words (the plan's reason)."""
    h, w = found.row, found.weight
    return (f"a sum whose element is a factor of dot({h}, {w}[i, :]) times a row of the "
            f"shared stream matrix {w}: per {blocks['mc']} rows and tile of {blocks['nc']} "
            f"elements, S = {h} {w}^T and then {p.state} += f(S) {w} on the GEMM "
            f"micro-kernel ({blocks['mr']} x {blocks['nr']}, D in pieces of {blocks['kc']})")
