"""The loop nest of score products (``scores.score_product``): ``Y = f(H W^T) W`` as two
GEMMs a tile at a time, e.g. the backward of linear_cross_entropy,
``dh = sum_i dloss (exp(s_i - m) / lse_sum - [i == label]) w[i, :]`` with
``s_i = dot(h, w[i, :])``.

- rows in blocks of ``plan.mc``, one parallel task each, h packed in panels once per block
  (``score_tiles.ScoreTile``, the forward's routine: the factor sees the logits the
  forward computed m and lse_sum from);
- the stream in tiles of ``plan.nc`` elements; per tile, ``S^T`` on the micro-kernel as in
  the forward; each row's column moved to a row buffer and its factor ``P = f(S)``
  evaluated from it, vectorized, by the rule's own expression (``gemm.pack_a``: the
  per-row parts once, the dot a load from the buffer);
- then ``Y[rows, :] += P W[tile, :]`` by ``gemm.Blocks.product``: the tile is the K piece,
  W's rows of the tile packed into ``nr``-wide panels (``scores.product_columns`` per
  block), the sums of the block in its own buffer (the task owns its rows, so no other
  task reads them);
- after the last tile each row's results are computed from its sums (``gemm.row_results``).
  The last tile (N mod nc elements) is a second static copy of the nest.
"""

from __future__ import annotations

import dataclasses

from algebra.rule import FusionRule

from ...tvm.ir import T, tirx
from ..geometry import Geometry
from ..products import Product
from ..signature import F32, I64
from .gemm import Blocks, pack_a, row_results
from .plan import CpuPlan
from .score_tiles import ScoreTile, TileEmitter, row_blocks, tile_emitter
from .scores import ScoreDot, product_columns, score_dot, score_product


class _Offset:
    """A block's sums indexed by the kernel's row: ``[r, c]`` is sums[r - row0, c]."""

    def __init__(self, sums, row0):
        self.sums, self.row0 = sums, row0

    def __getitem__(self, index):
        r, c = index
        return self.sums[r - self.row0, c]


def rolling(rule: FusionRule, geo: Geometry, plan: CpuPlan, bufs: dict, results: dict,
            elementwise: dict, rowvals: dict, scores=None) -> None:
    """The score-product nest of ``rule`` (``scores.score_product`` at ``geo``) into the
    active IRBuilder frame; ``rowvals`` are per-row values of earlier unfused passes.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import build_primfunc, choose, shape_geometry
    >>> rule = redfuser.derive(redfuser.derive("linear_cross_entropy").backward().spec)
    >>> shapes = {"h": (128, 256), "w": (1000, 256), "label": (128,), "m": (128,),
    ...           "lse_sum": (128,), "dloss": (128,)}
    >>> geo = shape_geometry(rule, shapes)
    >>> plan = choose(rule, geo, threads=2)  # the CPU nest of this plan calls rolling
    >>> "dh += f(S) w" in plan.reason
    True
    >>> f"in T.unroll({plan.mr}):" in build_primfunc(rule, geo, plan).script()
    True
    """
    product, found = score_product(rule, geo), score_dot(rule, geo)
    em = tile_emitter(rule, geo, plan, bufs, {**rowvals, **results}, scores)
    full, last = divmod(geo.n, plan.nc)
    with row_blocks(geo, plan) as (row0, rows):
        task = _Task(em, found, product, row0, rows)
        task.pack()
        with T.serial(0, full) as c:
            task.tile(tirx.Cast(I64, c) * plan.nc, plan.nc, c == 0)
        if last:
            task.tile(tirx.const(full * plan.nc, I64), last, tirx.const(full == 0, "bool"))
        task.finish(results, elementwise)


class _Task(ScoreTile):
    """One block of rows: its score tile, the factor of it (the A operand of the second
    GEMM), the packed panels of W's rows and the block's sums."""

    def __init__(self, em: TileEmitter, found: ScoreDot, product: Product, row0, rows):
        super().__init__(em, found, row0, rows)
        plan, self.product = self.plan, product
        self.width = -(-self.geo.d // plan.nr) * plan.nr  # the sums' columns: whole panels
        # the second GEMM's blocking: K is the tile, its columns the (padded) features
        columns = product_columns(plan.nc, plan.nr, self.width)
        self.gemm = dataclasses.replace(plan, kc=plan.nc, nc=columns, nt=1)
        self.factor = T.alloc_buffer((plan.mc, plan.nc), F32)  # P = f(S) of one tile
        self.packed_w = T.alloc_buffer((columns // plan.nr, plan.nc, plan.nr), F32)
        self.sums = T.alloc_buffer((plan.mc, self.width), F32)

    def tile(self, c0, cols: int, first) -> None:
        """S^T for elements [c0, c0 + cols), P = f(S) row by row, then sums (+)= P W."""
        em, length = self.em, tirx.const(cols, I64)
        self.score(c0, cols)
        with T.serial(0, self.rows) as j:
            self.column(j, cols)
            em.tile = (self.row, c0)
            pack_a(em, self.product, self.factor, j, self.row0 + j, c0, length)
            em.tile = None
        blocks = Blocks(self.gemm, self.geo, 0, self.rows, c0, length, first)
        blocks.product(em.bufs[self.product.weight], self.factor, self.packed_w, self.sums, 0)

    def finish(self, results: dict, elementwise: dict) -> None:
        """Each row's results from its sums, then its per-element outputs."""
        sums = {self.product.state: _Offset(self.sums, self.row0)}
        with T.serial(0, self.rows) as j:
            r = T.bind(self.row0 + j)
            row_results(self.em, self.geo, (self.product,), sums, None, r, results)
            self.em.elementwise(r, elementwise)
