"""The low-precision tests' measure (tests/api/test_low_precision*.py, the Relax pass's
attention in bfloat16): an output in bfloat16 or float16 against the float64 oracle rounded
to its dtype, in units of the last place of that rounding.  Target, from the issue: within
one unit on at least 99.9% of the elements and within two everywhere (the accumulation is
float32, so only the final rounding may differ: a float32 value a few float32 ulps from a
rounding midpoint can land on the other side)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import redfuser

LOW = (ml_dtypes.bfloat16, np.float16)
IDS = ("bfloat16", "float16")


def ulps(got: np.ndarray, ref: np.ndarray, dtype) -> np.ndarray:
    """|got - ref rounded to dtype| in units of the last place of that rounding; 0 where
    both are the same infinity or both NaN.  The unit is at least float32's smallest
    normal: bfloat16's subnormals are float32's, which the float32 compute flushes (the
    polynomial exp returns 0 below -87.3), so there only float32's own floor holds."""
    want = np.asarray(ref, np.float64).astype(dtype)
    got64, want64 = np.asarray(got).astype(np.float64), want.astype(np.float64)
    same = (got64 == want64) | (np.isnan(got64) & np.isnan(want64))
    with np.errstate(invalid="ignore"):
        spacing = np.maximum(np.abs(np.spacing(want).astype(np.float64)),
                             np.finfo(np.float32).tiny)
        out = np.abs(got64 - want64) / np.where(np.isfinite(spacing), spacing, 1.0)
    return np.where(same, 0.0, np.where(np.isnan(out), np.inf, out))


def assert_one_ulp(got, ref, dtype, what: str):
    u = ulps(got, ref, dtype).ravel()
    assert np.shape(got) == np.shape(ref), what
    if u.size == 0:  # N = 0: nothing to hold
        return
    assert np.mean(u > 1) <= 1e-3 and u.max() <= 2, \
        f"{what}: {np.mean(u > 1):.2%} beyond 1 ulp, worst {u.max()} ulps"


def oracle(spec: str, inputs: dict) -> dict:
    """``redfuser.reference`` (float64) of the same input values, not the code under test."""
    return redfuser.reference(spec, {k: np.asarray(v, np.float64) for k, v in inputs.items()})
