"""The loop nest of score tiles (``scores.py``): ``S = H W^T`` a tile at a time on the GEMM
micro-kernel, each row of a tile folded into its row's running state.

- rows in blocks of ``plan.mc``, one parallel task each; a task packs its rows of h once,
  per K piece of ``plan.kc`` features into ``plan.nr``-wide panels (rows past the block's end
  repeat its last row, so there is no row tail);
- the stream in tiles of ``plan.nc`` elements; per tile and K piece, each group of ``plan.mr``
  elements (rows of w, read in place) against each panel is one call of the micro-kernel
  (``gemm.Blocks.micro``), accumulating ``S^T[element, row]`` in the task's tile buffer;
- each row's column of the tile is then moved into a row buffer and folded with the rule's
  own lanes and tiles (``variants._fold``), every read of the dot a load from that buffer
  (the max, the exp and a label's select see one value), and merged into the row's state in
  a workspace.  The last tile (N mod nc elements) is a second static copy of the nest, so
  every fold has a known length;
- after the last tile each row is finalized (a row with a non-finite anchor folds its row
  again there, the dots computed one by one: ``Emitter.recompute``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import contextmanager

from algebra.rule import FusionRule

from ...tvm.ir import T, tirx
from ..emitter import Emitter
from ..geometry import Geometry
from ..nests import copy_state, workspace
from ..signature import F32, I64
from ..texpr import loaded
from .gemm import Blocks
from .plan import EMITTER_OPTIONS, LANES, CpuPlan, rows_loop, tile_for, vector_lanes
from .scores import ScoreDot, score_dot


class _Rows:
    """The micro-kernel's A operand read in place: ``[j, k]`` is w[c0 + j, k0 + k]."""

    def __init__(self, w, c0, k0):
        self.w, self.c0, self.k0 = w, c0, k0

    def __getitem__(self, index):
        j, k = index
        return loaded(self.w, [0, self.c0 + j, self.k0 + k])


class TileEmitter(Emitter):
    """An emitter that, while a row of a tile is folded (``tile``: (its row buffer, the tile's
    first element)), reads the dot product from that buffer instead of computing it."""

    def __init__(self, *args, **kwargs):
        self.tile = None
        super().__init__(*args, **kwargs)

    @property
    def dot_list(self) -> list:  # none to compute while a tile is folded (``tile_dots``)
        return [] if self.tile else self._dots

    @dot_list.setter
    def dot_list(self, dots: list):
        self._dots = dots

    def dots(self, r, i):
        return {} if self.tile else super().dots(r, i)

    def base_lookup(self, r, i=None, slot=0, extra=None):
        if self.tile is None or i is None:
            return super().base_lookup(r, i, slot, extra)
        row, c0 = self.tile
        return super().base_lookup(r, i, slot, {self._dots[0]: row[i - c0], **(extra or {})})


def rolling(rule: FusionRule, geo: Geometry, plan: CpuPlan, bufs: dict, results: dict,
            elementwise: dict, rowvals: dict, fold: Callable, scores=None) -> None:
    """The score-tile nest of ``rule`` (its dot a ``scores.score_dot`` at ``geo``) into the
    active IRBuilder frame; ``fold`` folds a piece of a row into lanes and merges them
    (``variants._fold``), ``rowvals`` are per-row values of earlier unfused passes.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import build_primfunc, choose, shape_geometry
    >>> rule = redfuser.derive("linear_cross_entropy")
    >>> geo = shape_geometry(rule, {"h": (128, 256), "w": (1000, 256), "label": (128,)})
    >>> plan = choose(rule, geo, threads=2)  # the CPU nest of this plan calls rolling
    >>> "S = h w^T" in plan.reason
    True
    >>> f"in T.unroll({plan.mr}):" in build_primfunc(rule, geo, plan).script()
    True
    """
    found, em = score_dot(rule, geo), tile_emitter(rule, geo, plan, bufs,
                                                  {**rowvals, **results}, scores)
    work = workspace(rule, geo, geo.r)  # each row's state between the tiles
    full, last = divmod(geo.n, plan.nc)
    with row_blocks(geo, plan) as (row0, rows):
        task = _Task(em, found, fold, work, row0, rows)
        task.start()
        with T.serial(0, full) as c:
            task.tile(tirx.Cast(I64, c) * plan.nc, plan.nc)
        if last:
            task.tile(tirx.const(full * plan.nc, I64), last)
        task.finish(results, elementwise)


def tile_emitter(rule: FusionRule, geo: Geometry, plan: CpuPlan, bufs: dict, rowvals: dict,
                 scores=None) -> TileEmitter:
    """The emitter of a score-tile nest, with the CPU variants' options, for a plan whose
    blocking the micro-kernel takes (``check_tiles``)."""
    check_tiles(plan)
    return TileEmitter(rule, geo, plan, bufs, rowvals, scores=scores, **EMITTER_OPTIONS)


@contextmanager
def row_blocks(geo: Geometry, plan: CpuPlan):
    """The blocks of ``plan.mc`` rows, one parallel task each: yields (first row, rows in
    the block), the last block the rows left."""
    with rows_loop(geo)(0, -(-geo.r // plan.mc)) as b:
        row0 = T.bind(tirx.Cast(I64, b) * plan.mc)
        yield row0, T.bind(tirx.min(tirx.const(geo.r, I64) - row0, plan.mc))


def check_tiles(plan: CpuPlan) -> None:
    """Refuse a blocking whose panels of h are not whole vectors or whose row block is not
    whole panels (rows would be skipped or packed twice)."""
    if plan.nr % LANES or plan.mc % plan.nr:
        raise ValueError(f"score tiles: nr = {plan.nr} must be a multiple of the {LANES} "
                         f"vector lanes and mc = {plan.mc} a multiple of nr")


def _fold_plan(found: ScoreDot, geo: Geometry, cols: int) -> tuple[int, int]:
    """(lanes, tile) folding a row of a tile of ``cols`` elements: the plan's own choice for
    a stream that long, the dot being a loaded value (``ScoreDot.folded``)."""
    lanes = vector_lanes(found.folded, dataclasses.replace(geo, n=cols))
    return lanes, tile_for(found.folded, lanes, cols)


class ScoreTile:
    """One block of rows: its rows of h packed in panels (``pack``), the tile of S^T of a
    range of stream elements (``score``), and a buffer for one row of it (``column``)."""

    def __init__(self, em: TileEmitter, found: ScoreDot, row0, rows):
        plan, geo = em.plan, em.geo
        self.em, self.found, self.plan, self.geo, self.row0, self.rows = \
            em, found, plan, geo, row0, rows
        self.pieces, self.panels = -(-geo.d // plan.kc), plan.mc // plan.nr
        self.used = T.bind(tirx.floordiv(rows + (plan.nr - 1), plan.nr))  # panels with rows
        self.packed = T.alloc_buffer((self.pieces * self.panels, plan.kc, plan.nr), F32)
        self.scores = T.alloc_buffer((plan.nc, plan.mc), F32)  # S^T of one tile
        self.row = T.alloc_buffer((plan.nc,), F32)  # one row of it

    def pack(self):
        """Pack the block's rows of h, per K piece, into nr-wide panels."""
        plan, em, h = self.plan, self.em, self.em.bufs[self.found.row]
        with T.serial(0, self.pieces) as piece:
            k0 = T.bind(tirx.Cast(I64, piece) * plan.kc)
            length = T.bind(tirx.min(tirx.const(self.geo.d, I64) - k0, plan.kc))
            with T.serial(0, self.used) as p:
                with T.serial(0, plan.nr) as lane:
                    r = self.row0 + tirx.min(p * plan.nr + lane, self.rows - 1)
                    at = T.bind(em.row_of(self.found.row, r))
                    _vector_loop(length, lambda k, at=at, lane=lane, p=p, piece=piece: (
                        T.buffer_store(self.packed, loaded(h, [at, 0, k0 + k]),
                                       [piece * self.panels + p, k, lane])))

    def score(self, c0, cols: int):
        """S^T for elements [c0, c0 + cols) of every row of the block."""
        plan, w = self.plan, self.em.bufs[self.found.weight]
        with T.serial(0, self.pieces) as piece:
            k0 = T.bind(tirx.Cast(I64, piece) * plan.kc)
            length = T.bind(tirx.min(tirx.const(self.geo.d, I64) - k0, plan.kc))
            blocks = Blocks(plan, self.geo, 0, cols, k0, length, piece == 0)
            with T.serial(0, -(-cols // plan.mr)) as mb:  # w's rows stay in L1 over the panels
                with T.serial(0, self.used) as p:
                    blocks.micro(_Rows(w, c0, k0), self.packed, self.scores,
                                 piece * self.panels + p, p * plan.nr, mb)

    def column(self, j, cols: int):
        """Row j's column of the tile into the row buffer (the fold reads it contiguously)."""
        _vector_loop(tirx.const(cols, I64), lambda c: T.buffer_store(
            self.row, self.scores[c, j], [c]))


class _Task(ScoreTile):
    """A score tile whose rows are folded: its fold registers, per tile length."""

    def __init__(self, em: TileEmitter, found: ScoreDot, fold: Callable, work: dict, row0,
                 rows):
        super().__init__(em, found, row0, rows)
        self.fold, self.work = fold, work
        lengths = {self.plan.nc, self.geo.n % self.plan.nc} - {0}
        self.folds = {cols: _fold_plan(found, self.geo, cols) for cols in lengths}
        self.states = {lanes: em.states(2 * lanes) for lanes, _ in self.folds.values()}

    def start(self):
        """Pack the block's rows of h, and put the identity in each row's state."""
        self.pack()
        st = next(iter(self.states.values()))
        st.init(0)
        with T.serial(0, self.rows) as j:
            copy_state(st, self.work, 0, self.row0 + j, to_work=True)

    def tile(self, c0, cols: int):
        """S^T for elements [c0, c0 + cols) of every row of the block, then each row folded."""
        self.score(c0, cols)
        with T.serial(0, self.rows) as j:
            self._fold_row(j, c0, cols)

    def _fold_row(self, j, c0, cols: int):
        """Row j's column of the tile into the row buffer, folded, merged into its state."""
        em, r = self.em, T.bind(self.row0 + j)
        self.column(j, cols)
        lanes, tile = self.folds[cols]
        st = self.states[lanes]
        for lane in range(lanes):
            st.init(lane)
        em.tile = (self.row, c0)
        self.fold(em, st, r, c0, tirx.const(cols, I64), lanes, tile)
        em.tile = None
        copy_state(st, self.work, 1, r, to_work=False)
        em.merge(st, 1, 0, r)
        copy_state(st, self.work, 1, r, to_work=True)

    def finish(self, results: dict, elementwise: dict):
        """Each row's results from its merged state, then its per-element outputs."""
        st = next(iter(self.states.values()))
        with T.serial(0, self.rows) as j:
            r = T.bind(self.row0 + j)
            copy_state(st, self.work, 0, r, to_work=False)
            self.em.finalize(st, r, results)
            self.em.elementwise(r, elementwise)


def _vector_loop(length, store: Callable):
    """``store(k)`` for k in [0, length): LANES-wide vector chunks, then the tail."""
    with T.serial(0, tirx.floordiv(length, LANES)) as c:
        with T.vectorized(0, LANES) as lane:
            store(c * LANES + lane)
    with T.serial(tirx.floordiv(length, LANES) * LANES, length) as k:
        store(k)
