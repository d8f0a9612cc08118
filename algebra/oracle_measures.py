"""Measures against the float64 oracle (``algebra.reference``): how far a low-precision
output is from the oracle rounded to its dtype, and the oracle's gradient by central
differences.  The tests and ``make gpu-check`` judge kernels with these, never with the
code under test.

A bfloat16 or float16 output is judged in units of the last place of the oracle rounded to
its dtype: the kernels accumulate in float32, so only the final rounding may differ, and a
float32 value a few float32 ulps from a rounding midpoint can land on the other side.  The
target (docs/precision.md): within one unit on at least 99.9% of the elements
(``BEYOND_ONE``), within two everywhere (``WORST``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .reference import reference

LOW = (ml_dtypes.bfloat16, np.float16)  # the low-precision storage dtypes measured in ulps
BEYOND_ONE = 1e-3  # the share of elements that may be more than one unit away
WORST = 2.0  # units in the last place, everywhere


def ulps(got: np.ndarray, ref: np.ndarray, dtype) -> np.ndarray:
    """|got - ref rounded to dtype| in units of the last place of that rounding; 0 where
    both are the same infinity or both NaN.  The unit is at least float32's smallest
    normal: bfloat16's subnormals are float32's, which the float32 compute flushes (the
    polynomial exp returns 0 below -87.3), so there only float32's own floor holds.

    Examples
    --------
    >>> ulps(np.float16([1.0, 1.001, np.nan]), np.array([1.0, 1.0, np.nan]), np.float16)
    array([0., 1., 0.])
    """
    want = np.asarray(ref, np.float64).astype(dtype)
    got64, want64 = np.asarray(got).astype(np.float64), want.astype(np.float64)
    same = (got64 == want64) | (np.isnan(got64) & np.isnan(want64))
    with np.errstate(invalid="ignore"):
        spacing = np.maximum(np.abs(np.spacing(want).astype(np.float64)),
                             np.finfo(np.float32).tiny)
        out = np.abs(got64 - want64) / np.where(np.isfinite(spacing), spacing, 1.0)
    return np.where(same, 0.0, np.where(np.isnan(out), np.inf, out))


def one_ulp_failure(got, ref, dtype) -> str | None:
    """Why ``got`` misses the low-precision target against ``ref`` (module docstring), or
    None where it meets it (also where there is no element: N = 0)."""
    if np.shape(got) != np.shape(ref):
        return f"shape {np.shape(got)} where the oracle's is {np.shape(ref)}"
    u = ulps(got, ref, dtype).ravel()
    if u.size and (np.mean(u > 1) > BEYOND_ONE or u.max() > WORST):
        return f"{np.mean(u > 1):.2%} beyond 1 ulp, worst {u.max()} ulps"
    return None


def central_differences(spec: str, inputs: dict, upstream: dict, name: str, step: float,
                        rows: tuple | None = None) -> np.ndarray:
    """d/d ``name`` of sum(upstream[o] * reference(spec)[o]), by central differences in
    float64.  With ``rows``, inputs are broadcast to them first, so an input the rows share
    (shape (1, N, D)) gets the sum over the rows of its per-row derivatives.

    Examples
    --------
    >>> x = np.array([[0.0, 1.0]])
    >>> g = central_differences("s = sum(x[i]**2)", {"x": x}, {"s": np.ones(1)}, "x", 1e-6)
    >>> g.round(6).tolist()
    [[0.0, 2.0]]
    """
    base = {k: np.asarray(v, np.float64) for k, v in inputs.items()}
    out = np.zeros_like(base[name])
    for idx in np.ndindex(out.shape):
        h = step * max(1.0, abs(base[name][idx]))
        moved = []
        for sign in (1, -1):
            value = base[name].copy()
            value[idx] += sign * h
            moved.append(_loss(spec, base | {name: value}, upstream, rows))
        out[idx] = (moved[0] - moved[1]) / (2 * h)
    return out


def _loss(spec: str, inputs: dict, upstream: dict, rows: tuple | None) -> float:
    if rows is not None:
        inputs = {k: np.broadcast_to(v, (*rows, *np.shape(v)[len(rows):]))
                  for k, v in inputs.items()}
    ref = reference(spec, inputs)
    return float(sum(np.sum(upstream[o] * ref[o]) for o in upstream))
