"""The measured search: rank the space with the cost model, measure the best few, keep
the fastest, remember it.

``tune(rule, geo)`` enumerates ``space.space`` (every candidate a ``Plan``), predicts
each with ``cost.predict``, builds and times the ``top`` predicted candidates, the best
predicted of each other variant (rolling, split, unfused: a wrong variant call by the
model gets caught) and the hand-written plan (``lowering.choose``; it stays unless a
candidate beats it by ``MARGIN``, so a tuned kernel is never slower than the untuned one
by more than the noise), ``rounds`` times each, a round at a time (a burst of noise on a
shared machine hits every candidate alike), and keeps each candidate's best median.
``prepare`` and ``run`` are its two halves (a whole model's cascades share one progress
bar: ``relax.tuning``).  The winner is stored in the tuning database (``db.TuningDB``)
under the rule's canonical spec, the geometry, dtype, target and the identity of the
machine that measured (a database that cannot be written costs a warning, never the
search's result); ``Kernel`` reads it on later compiles (``tuned_plan``), after checking
the record against the schedule space (a stale or tampered record is ignored with a
warning, never built).  A progress bar shows on a terminal; ``TuneResult.report()``
prints predicted vs measured per candidate.

Candidates are timed by a ``measure.Measurer``: by default this machine, one after the
other, through a ``measure(geo, plan, repeat) -> ms`` callable (``runtime.time_plan``, or
a ``Kernel``'s own, which caches the builds it then reuses); ``pool.DevicePool`` times
them on remote devices in parallel.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, fields, replace

from tqdm.auto import tqdm

from ..lowering import Geometry, Plan, choose
from .cost import predict
from .db import TuningDB, entry_key, record_problem
from .machine import Machine, machine, machine_id
from .measure import Measure, Measurer, local
from .space import plan_from_params, plan_params, same_plan, space
from .store import DatabaseError, user_level


@dataclass
class Trial:
    """One candidate: predicted and (when measured) measured milliseconds."""

    plan: Plan
    predicted_ms: float
    measured_ms: float | None = None
    error: str = ""
    device: str = ""  # where its best time was measured ("" for this machine)


@dataclass
class TuneResult:
    """What a search found (``cached``: read from the database, nothing measured)."""

    best: Plan
    trials: list[Trial] = field(default_factory=list)
    seconds: float = 0.0
    candidates: int = 0
    cached: bool = False
    key: str = ""
    record: dict = field(default_factory=dict)  # what ``store`` puts in the database

    @property
    def measured(self) -> list[Trial]:
        return [t for t in self.trials if t.measured_ms is not None]

    def report(self) -> str:
        """Predicted vs measured milliseconds of every measured candidate."""
        if self.cached:
            return f"from the tuning database: {describe(self.best)} ({self.best.reason})"
        remote = any(t.device for t in self.trials)
        lines = [f"{len(self.measured)} of {self.candidates} candidates measured in "
                 f"{self.seconds:.1f} s (ranked by the cost model; * = kept)",
                 f"  {'plan':<40} {'predicted':>10} {'measured':>10} {'meas/pred':>9}"
                 + ("  device" if remote else "")]
        for t in sorted(self.trials, key=lambda t: t.predicted_ms):
            if t.measured_ms is None and not t.error:
                continue
            mark = "*" if same_plan(t.plan, self.best) else " "
            meas = f"{t.measured_ms:8.3f}ms" if t.measured_ms is not None else "failed"
            ratio = f"{t.measured_ms / t.predicted_ms:9.2f}" if t.measured_ms else " " * 9
            where = f"  {t.device}" if remote and t.measured_ms is not None else ""
            lines.append(f"{mark} {describe(t.plan):<40} {t.predicted_ms:8.3f}ms {meas:>10} "
                         f"{ratio}{where}")
            if t.measured_ms is None:
                lines.append(f"      {t.error[:200]}")
        return "\n".join(lines)


def describe(plan: Plan) -> str:
    """A plan's searched parameters in one short line.

    Examples
    --------
    >>> from redfuser.lowering import CpuPlan, CudaPlan
    >>> describe(CpuPlan("split", 16, 4, tile=8))
    'split lanes=16 splits=4 tile=8'
    >>> describe(CudaPlan("rolling", threads=256))
    'rolling threads=256'
    """
    kind = type(plan)  # what it hides (``Plan.hidden``, ``Plan.terse``) is its type's
    defaults = {f.name: f.default for f in fields(kind)}
    shown = [f"{k}={v}" for k, v in plan_params(plan).items()
             if k != "variant" and k not in kind.hidden and not (
                 (k == "splits" and plan.variant != "split") or
                 (k in kind.terse and v == defaults[k]))]
    return " ".join([plan.variant, *shown])


def rank(rule, geo: Geometry, target: str = "cpu", fast_math: bool = True,
         variants: tuple[str, ...] | None = None, figures: Machine | None = None,
         threads: int | None = None) -> list[Trial]:
    """Every candidate of the space (at ``threads``; default: this machine's) with its
    predicted time, fastest first.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.tune.machine import nominal_cpu
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> best = rank(rule, shape_geometry(rule, {"x": (4096, 4096)}), figures=nominal_cpu())[0]
    >>> best.plan.variant, best.plan.lanes > 1
    ('rolling', True)
    """
    figures = figures or machine(target)
    plans = space(rule, geo, target, fast_math, variants, threads).candidates()
    trials = [Trial(p, predict(rule, geo, p, figures, target).ms) for p in plans]
    return sorted(trials, key=lambda t: t.predicted_ms)


@dataclass
class Search:
    """A prepared search (``prepare``): the ranked space, the candidates to time (the
    hand-written plan last) and where (``measure.Measurer``); ``run`` times them."""

    rule: object
    geo: Geometry
    target: str
    fast_math: bool
    trials: list[Trial]
    chosen: list[Trial]
    where: Measurer
    repeat: int
    rounds: int
    started: float = field(default_factory=time.perf_counter)

    @property
    def runs(self) -> int:
        """Measurements the search makes (what its progress bar counts)."""
        return len(self.chosen) * self.rounds


def prepare(rule, geo: Geometry, target: str = "cpu", top: int = 4, repeat: int = 5,
            rounds: int = 2, fast_math: bool = True, variants: tuple[str, ...] | None = None,
            figures: Machine | None = None, where: Measurer | None = None,
            measure: Measure | None = None) -> Search:
    """Rank the space of ``rule`` at ``geo`` and pick what to time: the ``top`` predicted
    candidates, the best predicted of every other variant and the hand-written plan, at
    the thread count of the machine that measures (``where``; default: this one, through
    ``measure``).  The model ranks with ``figures`` (default: this machine's) at that
    thread count.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.tune.machine import nominal_cpu
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> s = prepare(rule, shape_geometry(rule, {"x": (8, 256)}), top=2, rounds=3,
    ...             figures=nominal_cpu())
    >>> s.chosen[-1].plan.reason, s.runs == 3 * len(s.chosen)
    ('hand-written', True)
    """
    if top < 1 or repeat < 1 or rounds < 1:
        raise ValueError("top, repeat and rounds must be positive integers")
    if where is not None and measure is not None:
        raise ValueError("give measure (timed here) or where (a Measurer), not both")
    started = time.perf_counter()
    where = where or local(rule, target, measure)
    figures = figures or machine(target)
    if figures.threads != where.threads:
        figures = replace(figures, threads=where.threads)
    trials = rank(rule, geo, target, fast_math, variants, figures, where.threads)
    chosen = _to_measure(trials, rule, geo, target, fast_math, top, where.threads)
    return Search(rule, geo, target, fast_math, trials, chosen, where, repeat, rounds, started)


def run(search: Search, bar: tqdm | None = None) -> TuneResult:
    """Time the chosen candidates ``rounds`` times (``bar``: advanced once per
    measurement) and keep the fastest; nothing is stored (``tune`` stores)."""
    _measure(search, bar)
    done = [t for t in search.chosen if t.measured_ms is not None]
    if not done:
        raise RuntimeError("no candidate could be built and timed: " +
                           "; ".join(t.error for t in search.chosen))
    hand = search.chosen[-1]
    win = _winner(done, hand if hand.measured_ms is not None else None)
    best = replace(win.plan, reason=f"tuned: {win.measured_ms:.3f} ms measured, best of "
                                    f"{len(done)} (model {win.predicted_ms:.3f} ms)")
    seconds = time.perf_counter() - search.started
    rule, geo = search.rule, search.geo
    key = entry_key(rule, geo, search.target, search.where.identity, search.fast_math)
    return TuneResult(best, search.trials, seconds, len(search.trials), key=key,
                      record={"plan": plan_params(win.plan), "measured_ms": win.measured_ms,
                              "predicted_ms": win.predicted_ms,
                              "candidates": len(search.trials), "measured": len(done),
                              "seconds": round(seconds, 3)})


def progress_bar(total: int, progress: bool = True) -> tqdm:
    """The search's progress bar (shown on a terminal only, gone when closed)."""
    return tqdm(total=total, desc="tuning", unit="run", leave=False,
                disable=None if progress else True)


def tune(rule, geo: Geometry, target: str = "cpu", top: int = 4, repeat: int = 5,
         rounds: int = 2, fast_math: bool = True, variants: tuple[str, ...] | None = None,
         db: TuningDB | None | bool = None, progress: bool = True,
         measure: Measure | None = None, figures: Machine | None = None,
         where: Measurer | None = None) -> TuneResult:
    """Search the schedule of ``rule`` at ``geo``: rank, measure the ``top`` few and the
    hand-written plan (here, or on ``where``: e.g. ``pool.DevicePool.measurer``), keep
    the fastest and store it under the measuring machine's identity (``db=False``: do not
    store).

    Examples
    --------
    >>> import redfuser, tempfile
    >>> from redfuser.tune.machine import nominal_cpu
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> tmp = tempfile.TemporaryDirectory()
    >>> db = TuningDB(tmp.name + "/tuning.json")
    >>> res = tune(rule, shape_geometry(rule, {"x": (8, 256)}), top=2, repeat=2,
    ...            rounds=1, db=db, progress=False, figures=nominal_cpu())
    >>> len(res.measured) >= 2 and db.get(res.key)["plan"] == plan_params(res.best)
    True
    >>> tmp.cleanup()
    """
    search = prepare(rule, geo, target, top, repeat, rounds, fast_math, variants, figures,
                     where, measure)
    bar = progress_bar(search.runs, progress)
    try:
        result = run(search, bar)
    finally:
        bar.close()
    if db is not False:
        store_or_warn(db or TuningDB(), result)
    return result


def store_or_warn(db: TuningDB, result: TuneResult) -> None:
    """``store``, with a warning instead of an error: a database that cannot be written
    costs the record, never the search's result."""
    try:
        store(db, result)
    except (DatabaseError, ValueError) as e:
        warnings.warn(f"redfuser: the tuned plan was not stored: {e}", RuntimeWarning,
                      stacklevel=user_level())


def _to_measure(trials, rule, geo, target, fast_math, top, threads=None) -> list[Trial]:
    """The ``top`` predicted candidates, the best predicted of every other variant (so a
    wrong variant call by the model is caught) and the hand-written plan (the baseline)."""
    chosen = trials[:top]
    for variant in dict.fromkeys(t.plan.variant for t in trials):
        if not any(t.plan.variant == variant for t in chosen):
            chosen.append(next(t for t in trials if t.plan.variant == variant))
    hand = replace(choose(rule, geo, target=target, fast_math=fast_math, threads=threads),
                   reason="hand-written")
    match = [t for t in trials if same_plan(t.plan, hand)] or [Trial(hand, float("nan"))]
    return [t for t in chosen if t is not match[0]] + match[:1]  # the hand-written one last


MARGIN = 0.05  # a candidate must beat the hand-written plan by this much to replace it


def _winner(done: list[Trial], hand: Trial | None) -> Trial:
    """The fastest measured candidate, unless it is within the noise (MARGIN) of the
    hand-written plan, which then stays (a tie is not worth a different kernel)."""
    win = min(done, key=lambda t: t.measured_ms)
    if hand is not None and win.measured_ms * (1 + MARGIN) > hand.measured_ms:
        return hand
    return win


def _measure(search: Search, bar: tqdm | None) -> None:
    """Time every chosen candidate ``rounds`` times, a round at a time (a burst of noise on
    a shared machine hits every candidate alike); keep each one's best."""
    tick = bar.update if bar is not None else (lambda n=1: None)
    for _ in range(search.rounds):
        todo = [t for t in search.chosen if not t.error]
        tick(len(search.chosen) - len(todo))  # failed before: not timed again
        outcomes = search.where.run(search.geo, [t.plan for t in todo], search.repeat,
                                    lambda: tick(1))
        for t, got in zip(todo, outcomes, strict=True):
            if got.ms is None:
                t.error = got.error
            elif t.measured_ms is None or got.ms < t.measured_ms:
                t.measured_ms, t.device = got.ms, got.device


def store(db: TuningDB, result: TuneResult) -> str:
    """Put ``result``'s record in ``db``; what happened, in one line.  Raises
    ``DatabaseError`` when the database is unusable or cannot be written, ``ValueError``
    when the record is not one (a ``measure`` that returned a non-finite time).

    Examples
    --------
    >>> import tempfile
    >>> db = TuningDB(tempfile.mkdtemp() + "/tuning.json")
    >>> result = TuneResult(Plan("rolling"), key="k", record={"plan": {"variant": "rolling"},
    ...                                                       "measured_ms": 0.5})
    >>> store(db, result) == f"stored in {db.path}"
    True
    """
    if db.put(result.key, result.record):
        return f"stored in {db.path}"
    held = db.get(result.key) or {}
    return (f"not stored: {db.path} already holds a newer result for this key (stored "
            f"{held.get('stored')}, {held.get('measured_ms')} ms measured)")


def model_plan(rule, geo: Geometry, target: str = "cpu", fast_math: bool = True) -> Plan:
    """The cost model's first choice, nothing measured (``compile(..., tune="model")``)."""
    best = rank(rule, geo, target, fast_math)[0]
    return replace(best.plan, reason=f"cost model: {best.predicted_ms:.3f} ms predicted, "
                                     "not measured")


def tuned_plan(rule, geo: Geometry, target: str = "cpu", fast_math: bool = True,
               search: bool = False, db: TuningDB | None = None,
               measure: Measure | None = None) -> Plan | None:
    """The database's plan for ``rule`` at ``geo`` (None when there is none); with
    ``search``, tune first when there is none.  Never raises on a bad database."""
    db = db or TuningDB()
    key = entry_key(rule, geo, target, machine_id(target), fast_math)
    record = db.get(key)
    if record is not None:
        try:
            return record_plan(record, rule, geo, target, fast_math)
        except (KeyError, TypeError, ValueError) as e:
            warnings.warn(f"redfuser: ignoring a tuning record in {db.path}: {e}",
                          RuntimeWarning, stacklevel=user_level())
    if not search:
        return None
    try:
        return tune(rule, geo, target, fast_math=fast_math, db=db, measure=measure).best
    except RuntimeError as e:  # nothing could be measured (e.g. no device): hand-written
        warnings.warn(f"redfuser: schedule search failed ({e}); using the hand-written plan",
                      RuntimeWarning, stacklevel=user_level())
        return None


def record_plan(record: dict, rule, geo: Geometry, target: str = "cpu",
                fast_math: bool = True) -> Plan:
    """The plan of a database record, checked against the schedule space of ``rule`` at
    ``geo``: ``ValueError`` naming the field when the record is malformed or its plan is
    not a candidate here (a stale or tampered record must not build, e.g. a row block of
    1000 would compile for minutes).

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> geo = shape_geometry(rule, {"x": (32, 256)})
    >>> record_plan({"plan": {"variant": "rolling", "lanes": 16, "tile": 8},
    ...              "measured_ms": 0.1}, rule, geo).lanes
    16
    >>> try:
    ...     record_plan({"plan": {"variant": "rolling", "row_block": 1000},
    ...                  "measured_ms": 0.1}, rule, geo)
    ... except ValueError as e:
    ...     print(e)
    row_block=1000 is not in the space of rolling here (1)
    """
    problem = record_problem(record, target)
    if problem is not None:
        raise ValueError(problem)
    plan = plan_from_params(record["plan"], fast_math,
                            f"tuned: {float(record['measured_ms']):.3f} ms measured", target)
    why = space(rule, geo, target, fast_math).why_not(plan)
    if why is not None:
        raise ValueError(why)
    return plan
