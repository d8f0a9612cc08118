"""The library on one target against the float64 oracle: bfloat16 and float16 storage, and
training (forward + derived backward through ``redfuser.torch``).  ``make gpu-check`` runs
them with ``target="cuda"``; the tests run them on the CPU, so the harness a GPU session
relies on is the one CI has run.

Each returns the number of failures and prints one line a case: ``ok``, ``FAIL`` with the
measure, or ``refused`` with the engine's reason (a backward the engine refuses is listed,
not counted).
"""

from __future__ import annotations

import numpy as np

import redfuser
from algebra.library import example_inputs
from algebra.oracle_measures import LOW, central_differences, one_ulp_failure

# float32 statistics from the same low-precision values: float32 sums of at most a few
# hundred O(1) terms against float64 (the float32 check's tolerance)
STAT_TOL = 2e-5
# inputs small enough for central differences of the oracle in float64: two oracle runs an
# input element.  The vocabulary / stream length stays under 256 so that an index stored
# as a float (a label, a position) is exact in bfloat16 too.
TRAIN_SHAPE = {"n": 9, "rows": (3,), "d": 4}
DTYPE_SHAPE = {"n": 200, "rows": (8,), "d": 64}
# central differences: step relative to the element (truncation ~1e-10, float64 rounding
# ~1e-11); the kernels' float32 gradients err by a few float32 roundings of their scale
STEP = 1e-5
GRAD_TOL = 1e-4


def check_dtypes(target: str, names=None, dtypes=LOW) -> int:
    """Every library cascade (or ``names``) in each low-precision dtype: per-element and
    stored outputs within one unit in the last place of the oracle rounded to the dtype
    (``algebra.oracle_measures``), float32 statistics within ``STAT_TOL``, indices equal."""
    failures = 0
    for name in names or redfuser.LIBRARY:
        for dtype in dtypes:
            inputs = {k: v.astype(dtype) if isinstance(v, np.ndarray) else v
                      for k, v in example_inputs(name, **DTYPE_SHAPE).items()}
            try:
                out = redfuser.compile(name, target=target, tune=False)(**inputs)
                why = _dtype_failure(out, redfuser.reference(name, _wide(inputs)), dtype)
            except Exception as e:  # noqa: BLE001 - reported, and the check goes on
                why = first_line(e)
            failures += why is not None
            _report(why, f"{name} {np.dtype(dtype).name}")
    return failures


def _dtype_failure(out: dict, ref: dict, dtype) -> str | None:
    for o, want in ref.items():
        got = np.asarray(out[o])
        if got.dtype == np.dtype(dtype):
            why = one_ulp_failure(got, want, dtype)
        elif got.dtype.kind in "iu":
            why = None if np.array_equal(got, want) else "indices differ"
        else:
            close = np.allclose(got, want, rtol=STAT_TOL, atol=STAT_TOL, equal_nan=True)
            why = None if close else f"{got.dtype} statistic beyond {STAT_TOL}"
        if why is not None:
            return f"{o}: {why}"
    return None


def check_training(target: str, names=None) -> int:
    """Every library op (or ``names``) registered with ``redfuser.torch.op`` on ``target``:
    forward and derived backward kernels run there, and the gradient of every input the
    backward differentiates matches central differences of the float64 oracle within
    ``GRAD_TOL`` of its scale."""
    failures = 0
    for name in names or redfuser.LIBRARY:
        try:
            derived = redfuser.derive(name).backward()
        except redfuser.NoBackward as e:
            _report(None, f"{name} backward", refused=str(e))
            continue
        inputs = example_inputs(name, **TRAIN_SHAPE)
        try:
            why = _gradient_failure(name, target, derived, inputs)
        except Exception as e:  # noqa: BLE001 - reported, and the check goes on
            why = first_line(e)
        failures += why is not None
        _report(why, f"{name} backward")
    return failures


def _gradient_failure(name: str, target: str, derived, inputs: dict) -> str | None:
    import torch  # the torch ops need torch, which the forward checks do not

    from .. import torch as rt  # loads torch: only where training is checked

    scalars = tuple(k for k, v in inputs.items() if not isinstance(v, np.ndarray))
    op = rt.op(name, name=f"{name}_{target}", scalars=scalars, target=target, tune=False)
    leaves = {k: torch.from_numpy(v).requires_grad_(k in derived.gradients)
              if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    outs = dict(zip(op.outputs, op(*(leaves[k] for k in op.inputs)), strict=True))
    rng = np.random.default_rng(1)
    upstream = {o: rng.normal(size=outs[o].shape) for o in derived.upstream}
    torch.autograd.backward([outs[o] for o in upstream],
                            [torch.from_numpy(u.astype(np.float32)) for u in upstream.values()])
    for k, leaf in leaves.items():
        if not isinstance(leaf, torch.Tensor) or not leaf.requires_grad:
            continue
        why = gradient_mismatch(leaf.grad.double().numpy(),
                                central_differences(name, inputs, upstream, k, STEP))
        if why is not None:
            return f"d{k}: {why}"
    return None


def gradient_mismatch(got: np.ndarray, want: np.ndarray) -> str | None:
    """Why a kernel's gradient misses central differences ``want`` (``GRAD_TOL`` of the
    largest magnitude, plus the same absolute), or None.

    Examples
    --------
    >>> want = np.array([1.0, -2.0])
    >>> gradient_mismatch(want + 1e-6, want) is None, gradient_mismatch(want * 1.01, want)
    (True, 'off by 2.0e-02 (scale 2.0e+00)')
    """
    scale = float(np.max(np.abs(want), initial=0.0))
    if np.shape(got) == np.shape(want) and np.all(np.abs(got - want) <= GRAD_TOL * (1 + scale)):
        return None
    if np.shape(got) != np.shape(want):
        return f"shape {np.shape(got)} where the oracle's is {np.shape(want)}"
    return f"off by {np.max(np.abs(got - want)):.1e} (scale {scale:.1e})"


def _wide(inputs: dict) -> dict:
    return {k: np.asarray(v, np.float64) for k, v in inputs.items()}


def _report(why: str | None, what: str, refused: str = "") -> None:
    if refused:
        print(f"refused {what:<30} {refused.splitlines()[0][:160]}", flush=True)
    else:
        print(f"{'ok  ' if why is None else 'FAIL'} {what:<30} {why or ''}", flush=True)


def first_line(e: Exception) -> str:
    """An error in one line: its type and its last non-empty line (TVM's and sympy's
    messages end with what went wrong)."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:200]
