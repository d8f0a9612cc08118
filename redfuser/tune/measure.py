"""Where the schedule search times its candidates: this machine, or a pool of devices.

The search (``search.py``) hands a ``Measurer`` one round of candidates at a time and gets
one ``Outcome`` per candidate back: milliseconds, or the reason it failed, and the device
that timed it.  ``local`` times them here one after the other through a
``(geometry, plan, repeat) -> ms`` callable (``runtime.time_plan`` unless a ``Kernel``
passes its own, which caches the builds it reuses); ``pool.DevicePool.measurer`` times them
on remote devices in parallel.  The measurer also says whose times these are
(``identity``: the machine the records are stored under) and how many threads that machine
runs (the space and the hand-written plan depend on it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..lowering import Geometry, Plan
from ..runtime import time_plan
from ..tvm.target import default_threads
from .machine import machine_id

Measure = Callable[[Geometry, Plan, int], float]  # (geometry, plan, repeat) -> milliseconds


@dataclass(frozen=True)
class Outcome:
    """One candidate's measurement: ``ms``, or None and ``error`` (why it failed)."""

    ms: float | None
    error: str = ""
    device: str = ""  # where it was timed ("" for this machine)


# (geometry, the round's plans, repeat, called once per finished plan) -> one outcome each
RunRound = Callable[[Geometry, list[Plan], int, Callable[[], None]], list[Outcome]]


@dataclass(frozen=True)
class Measurer:
    """Times a round of candidates (``run``) on the machine named ``identity``, which runs
    kernels with ``threads`` threads."""

    run: RunRound
    identity: str
    threads: int


def local(rule, target: str = "cpu", measure: Measure | None = None) -> Measurer:
    """Time candidates on this machine, one after the other, through ``measure``.

    Examples
    --------
    >>> import redfuser
    >>> from redfuser.lowering import CpuPlan, shape_geometry
    >>> rule = redfuser.derive("softmax")
    >>> here = local(rule, measure=lambda geo, plan, repeat: 0.5)
    >>> here.run(shape_geometry(rule, {"x": (4, 64)}), [CpuPlan("rolling")], 1, lambda: None)
    [Outcome(ms=0.5, error='', device='')]
    """
    measure = measure or (lambda g, plan, rep: time_plan(rule, g, plan, target, rep))

    def run(geo: Geometry, plans: list[Plan], repeat: int, done: Callable[[], None]):
        out = []
        for plan in plans:
            try:
                out.append(Outcome(measure(geo, plan, repeat)))
            except Exception as e:  # noqa: BLE001 - a candidate that fails is skipped
                out.append(Outcome(None, first_line(e)))
            done()
        return out

    return Measurer(run, machine_id(target), default_threads())


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (TVM's errors run to pages of C++ frames)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
