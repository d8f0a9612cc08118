"""The benchmark's comparison of this search with MetaSchedule on the unfused baselines.

For softmax and LayerNorm statistics (1024 x 1024 rows x N, times the benchmark's
scale), MetaSchedule tunes TVM's own unfused form (TOPI softmax; mean and variance as
two reductions) for a fixed trial budget; this package's search tunes redfuser's
unfused variant (``variants=("unfused",)``) and, for reference, the fused kernel.
The size is smaller than the benchmark's 4096 x 4096 because MetaSchedule builds and
runs every trial in worker processes (several seconds a trial there: 10+ minutes a
workload for 32 trials).
Reported: time to tune and kernel time (TVM's time evaluator, inputs in place).
MetaSchedule failing or missing is printed with the reason; nothing here raises.
"""

from __future__ import annotations

import numpy as np

from algebra import derive

from ..lowering import shape_geometry
from ..tune import tune

CASES = (("softmax", "softmax"), ("layernorm stats", "variance"))  # (MetaSchedule, library)
ROWS = N = 1024


def print_comparison(scale: float = 1.0, trials: int = 32) -> list[dict]:
    """Run both tuners on each case and print one line per case."""
    rows = max(1, int(ROWS * scale))
    print(f"\nschedule search vs MetaSchedule ({trials} trials) on the unfused baselines, "
          f"{rows} x {N}; tune in s, kernels in ms (TVM time evaluator)")
    print(f"{'workload':<18}{'MS tune':>9}{'MS kernel':>10}{'rf tune':>9}{'rf unfused':>11}"
          f"{'rf fused':>9}   notes")
    out = []
    for ms_name, spec in CASES:
        line = {"workload": ms_name, **_ours(spec, rows), **_theirs(ms_name, rows, trials)}
        out.append(line)
        print(_format(line), flush=True)
    return out


def _ours(spec: str, rows: int) -> dict:
    rule = derive(spec)
    geo = shape_geometry(rule, {"x": (rows, N)})
    unfused = tune(rule, geo, variants=("unfused",), top=3, repeat=3, rounds=2, db=False,
                   progress=False)
    fused = tune(rule, geo, top=3, repeat=3, rounds=2, db=False, progress=False)
    return {"rf tune": unfused.seconds, "rf unfused": _best(unfused), "rf fused": _best(fused),
            "rf fused tune": fused.seconds}


def _best(result) -> float:
    return min(t.measured_ms for t in result.measured)


def _theirs(name: str, rows: int, trials: int) -> dict:
    try:  # lazily: MetaSchedule needs psutil and cloudpickle (the test extras)
        from .metaschedule import tune_te
    except ImportError as e:  # psutil / cloudpickle missing
        return {"notes": f"MetaSchedule unavailable: {e}"}
    r = tune_te(name, rows, N, trials)
    notes = f"MetaSchedule {r.trials} trials, setup {r.setup_s:.0f} s (tensor intrinsics)"
    if r.error:
        notes = f"MetaSchedule failed: {r.error}"
    return {"MS tune": r.tune_s, "MS kernel": r.kernel_ms, "notes": notes}


def _format(line: dict) -> str:
    def cell(key: str, width: int) -> str:
        v = line.get(key)
        return f"{v:{width}.2f}" if isinstance(v, float) and np.isfinite(v) else f"{'-':>{width}}"

    return (f"{line['workload']:<18}{cell('MS tune', 9)}{cell('MS kernel', 10)}"
            f"{cell('rf tune', 9)}{cell('rf unfused', 11)}{cell('rf fused', 9)}   "
            f"{line.get('notes', '')}")
