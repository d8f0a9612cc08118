"""The measured search: rank the space with the cost model, measure the best few, keep
the fastest, remember it.

``tune(rule, geo)`` enumerates ``space.space`` (every candidate a ``Plan``), predicts
each with ``cost.predict`` on this machine's figures, builds and times the ``top``
predicted candidates, the best predicted of each other variant (rolling, split,
unfused: a wrong variant call by the model gets caught) and the hand-written plan
(``lowering.choose``; it stays unless a candidate beats it by ``MARGIN``, so a tuned kernel
is never slower than the untuned one by more than the noise), ``rounds`` times each,
interleaved (a burst of noise on a shared machine hits every candidate alike), and
keeps each candidate's best median.  The winner is stored in the tuning database
(``db.TuningDB``) under the rule's canonical spec, the geometry, dtype, target and
machine (a database that cannot be written costs a warning, never the search's result);
``Kernel`` reads it on later compiles (``tuned_plan``), after checking the record
against the schedule space (a stale or tampered record is ignored with a warning, never
built).  A progress bar shows
on a terminal; ``TuneResult.report()`` prints predicted vs measured per candidate.

Candidates are timed through a ``measure(geo, plan, repeat) -> ms`` callable: by default
``runtime.time_plan`` (a fresh build on random inputs); ``Kernel`` passes its own, which
caches the builds it then reuses.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tqdm.auto import tqdm

from ..lowering import Geometry, Plan, choose
from ..runtime import time_plan
from .cost import predict
from .db import TuningDB, entry_key, record_problem
from .machine import Machine, machine, machine_id
from .space import GEMM_FIELDS, plan_from_params, plan_params, same_plan, space
from .store import DatabaseError, user_level

Measure = Callable[[Geometry, Plan, int], float]  # (geometry, plan, repeat) -> milliseconds


@dataclass
class Trial:
    """One candidate: predicted and (when measured) measured milliseconds."""

    plan: Plan
    predicted_ms: float
    measured_ms: float | None = None
    error: str = ""


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
        lines = [f"{len(self.measured)} of {self.candidates} candidates measured in "
                 f"{self.seconds:.1f} s (ranked by the cost model; * = kept)",
                 f"  {'plan':<40} {'predicted':>10} {'measured':>10} {'meas/pred':>9}"]
        for t in sorted(self.trials, key=lambda t: t.predicted_ms):
            if t.measured_ms is None and not t.error:
                continue
            mark = "*" if same_plan(t.plan, self.best) else " "
            meas = f"{t.measured_ms:8.3f}ms" if t.measured_ms is not None else t.error[:30]
            ratio = f"{t.measured_ms / t.predicted_ms:9.2f}" if t.measured_ms else ""
            lines.append(f"{mark} {describe(t.plan):<40} {t.predicted_ms:8.3f}ms {meas:>10} "
                         f"{ratio}")
        return "\n".join(lines)


def describe(plan: Plan) -> str:
    """A plan's searched parameters in one short line.

    Examples
    --------
    >>> describe(Plan("split", 16, 4, tile=8))
    'split lanes=16 tile=8 splits=4'
    """
    params = plan_params(plan)
    hidden = {"variant"} | ({"lanes", "tile"} if plan.threads > 1 else {"threads"})
    shown = [f"{k}={v}" for k, v in params.items() if k not in hidden and not (
        (k == "splits" and plan.variant != "split") or (k == "row_block" and v == 1) or
        (k in GEMM_FIELDS and not plan.mr))]
    return " ".join([plan.variant, *shown])


def rank(rule, geo: Geometry, target: str = "cpu", fast_math: bool = True,
         variants: tuple[str, ...] | None = None,
         figures: Machine | None = None) -> list[Trial]:
    """Every candidate of the space with its predicted time, fastest first.

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
    plans = space(rule, geo, target, fast_math, variants).candidates()
    trials = [Trial(p, predict(rule, geo, p, figures, target).ms) for p in plans]
    return sorted(trials, key=lambda t: t.predicted_ms)


def tune(rule, geo: Geometry, target: str = "cpu", top: int = 4, repeat: int = 5,
         rounds: int = 2, fast_math: bool = True, variants: tuple[str, ...] | None = None,
         db: TuningDB | None | bool = None, progress: bool = True,
         measure: Measure | None = None, figures: Machine | None = None) -> TuneResult:
    """Search the schedule of ``rule`` at ``geo``: rank, measure the ``top`` few and the
    hand-written plan, keep the fastest and store it (``db=False``: do not store).

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
    if top < 1 or repeat < 1 or rounds < 1:
        raise ValueError("top, repeat and rounds must be positive integers")
    start = time.perf_counter()
    measure = measure or (lambda g, plan, rep: time_plan(rule, g, plan, target, rep))
    trials = rank(rule, geo, target, fast_math, variants, figures)
    chosen = _to_measure(trials, rule, geo, target, fast_math, top)
    _measure(measure, geo, chosen, repeat, rounds, progress)
    done = [t for t in chosen if t.measured_ms is not None]
    if not done:
        raise RuntimeError("no candidate could be built and timed: " +
                           "; ".join(t.error for t in chosen))
    win = _winner(done, chosen[-1] if any(t is chosen[-1] for t in done) else None)
    best = replace(win.plan, reason=f"tuned: {win.measured_ms:.3f} ms measured, best of "
                                    f"{len(done)} (model {win.predicted_ms:.3f} ms)")
    seconds = time.perf_counter() - start
    result = TuneResult(best, trials, seconds, len(trials),
                        key=entry_key(rule, geo, target, machine_id(target), fast_math),
                        record={"plan": plan_params(win.plan), "measured_ms": win.measured_ms,
                                "predicted_ms": win.predicted_ms, "candidates": len(trials),
                                "measured": len(done), "seconds": round(seconds, 3)})
    if db is not False:
        try:
            store(db or TuningDB(), result)
        except (DatabaseError, ValueError) as e:
            warnings.warn(f"redfuser: the tuned plan was not stored: {e}", RuntimeWarning,
                          stacklevel=user_level())
    return result


def _to_measure(trials, rule, geo, target, fast_math, top) -> list[Trial]:
    """The ``top`` predicted candidates, the best predicted of every other variant (so a
    wrong variant call by the model is caught) and the hand-written plan (the baseline)."""
    chosen = trials[:top]
    for variant in dict.fromkeys(t.plan.variant for t in trials):
        if not any(t.plan.variant == variant for t in chosen):
            chosen.append(next(t for t in trials if t.plan.variant == variant))
    hand = choose(rule, geo, target=target, fast_math=fast_math)
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


def _measure(measure: Measure, geo: Geometry, chosen: list[Trial], repeat: int, rounds: int,
             progress: bool) -> None:
    """Build and time every chosen candidate ``rounds`` times, interleaved; keep the best."""
    bar = tqdm(total=len(chosen) * rounds, desc="tuning", unit="run", leave=False,
               disable=None if progress else True)
    try:
        for _ in range(rounds):
            for t in chosen:
                bar.update(1)
                if t.error:
                    continue
                try:
                    ms = measure(geo, t.plan, repeat)
                except Exception as e:  # noqa: BLE001 - a candidate that fails is skipped
                    t.error = f"{type(e).__name__}: {e}".splitlines()[0]
                    continue
                t.measured_ms = ms if t.measured_ms is None else min(t.measured_ms, ms)
    finally:
        bar.close()


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
    problem = record_problem(record)
    if problem is not None:
        raise ValueError(problem)
    plan = plan_from_params(record["plan"], fast_math,
                            f"tuned: {float(record['measured_ms']):.3f} ms measured")
    why = space(rule, geo, target, fast_math).why_not(plan)
    if why is not None:
        raise ValueError(why)
    return plan
