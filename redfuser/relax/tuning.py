"""Tuning a whole model: every cascade ``FuseCascadedReductions`` would fuse, each once.

``cascades(mod)`` lifts and groups every dataflow block as the pass does (``plan_block``,
``derive_spec``) and keeps each provable group's rule and kernel shapes, one per tuning
database key (``db.spec_key`` and the geometry: a cascade that several functions share
tunes once; the lifter numbers a block's values, so two identical layers in one block
have two keys and tune twice).  ``tune_model`` prepares
one search per cascade (``tune.search.prepare``), times them all under one progress bar,
here or on a device pool (``where``: ``tune.pool.DevicePool.measurer``), and stores each
winner.  The pass reads the database when it builds a group's kernel (``rewrite.kernel_for``),
so later builds of the model (``relax.build``, or the pass in any pipeline) use them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..lowering import Geometry
from ..tune import TuningDB, spec_key
from ..tune.measure import Measurer
from ..tune.search import TuneResult, prepare, progress_bar, run, store_or_warn
from ..tvm.graph import IRModule, relax
from .driver import function_name, plan_block
from .rewrite import derive_spec, group_geometry


@dataclass(frozen=True)
class Cascade:
    """One distinct cascade of a model: where it was found, its spec, rule and shapes."""

    function: str
    values: tuple[str, ...]
    spec: str
    rule: object
    geo: Geometry


def cascades(mod: IRModule) -> list[Cascade]:
    """Every cascade of ``mod`` the pass would fuse, once per (spec, shapes).

    Examples
    --------
    >>> from redfuser.tvm.graph import relax
    >>> bb = relax.BlockBuilder()
    >>> for name in ("prefill", "decode"):  # one cascade at one shape, in two functions
    ...     x = relax.Var("x", relax.TensorType((4, 32), "float32"))
    ...     with bb.function(name, [x]):
    ...         with bb.dataflow():
    ...             y = bb.emit_output(relax.op.nn.softmax(x))
    ...         gv = bb.emit_func_output(y)
    >>> [(c.geo.r, c.geo.n) for c in cascades(bb.get())]  # tuned once
    [(4, 32)]
    """
    found: dict[tuple, Cascade] = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            if not isinstance(block, relax.DataflowBlock):
                continue
            try:
                _, groups = plan_block(func, block)
            except Exception:  # noqa: BLE001, S112 - the pass leaves such a block alone too
                continue
            for group in groups:
                rule, _ = derive_spec(group.spec)
                if rule is None:
                    continue
                geo = group_geometry(group, rule)
                key = (spec_key(rule), geo.key())
                found.setdefault(key, Cascade(function_name(gv), group.values, group.spec,
                                              rule, geo))
    return list(found.values())


@dataclass
class ModelTuning:
    """What ``tune_model`` did per cascade: its result, or why nothing could be timed."""

    cascade: Cascade
    result: TuneResult | None
    error: str = ""


def tune_model(mod: IRModule, where: Callable[[object], Measurer] | None = None,
               db: TuningDB | None | bool = None, progress: bool = True,
               **options) -> list[ModelTuning]:
    """Tune every cascade of ``mod`` (``cascades``) under one progress bar and store each
    winner (``db=False``: do not store).  ``where(rule)`` says where a rule's candidates
    are timed (default: here); ``options`` go to ``tune.search.prepare`` (top, repeat,
    rounds, figures, ...).

    Examples
    --------
    >>> import tempfile
    >>> from redfuser.tvm.graph import relax
    >>> from redfuser.tune.machine import nominal_cpu
    >>> bb = relax.BlockBuilder()
    >>> x = relax.Var("x", relax.TensorType((4, 64), "float32"))
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.log_softmax(x))
    ...     gv = bb.emit_func_output(y)
    >>> db = TuningDB(tempfile.mkdtemp() + "/tuning.json")
    >>> done = tune_model(bb.get(), db=db, progress=False, top=1, repeat=1, rounds=1,
    ...                   figures=nominal_cpu())
    >>> [(d.cascade.geo.n, d.result.key in db.entries()) for d in done]
    [(64, True)]
    """
    found = cascades(mod)
    searches = [prepare(c.rule, c.geo, "cpu", where=where(c.rule) if where else None,
                        **options) for c in found]
    bar = progress_bar(sum(s.runs for s in searches), progress)
    out = []
    try:
        for cascade, search in zip(found, searches, strict=True):
            try:
                out.append(ModelTuning(cascade, run(search, bar)))
            except RuntimeError as e:  # nothing of this cascade could be timed
                out.append(ModelTuning(cascade, None, str(e)))
    finally:
        bar.close()
    if db is not False:
        for done in out:
            if done.result is not None:
                store_or_warn(db or TuningDB(), done.result)
    return out
