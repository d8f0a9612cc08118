"""The low-precision tests' measure (tests/api/test_low_precision*.py, the Relax pass's
attention in bfloat16): ``algebra.oracle_measures``'s units in the last place of the float64
oracle rounded to the output's dtype, as an assertion."""

from __future__ import annotations

import numpy as np

import redfuser
from algebra.oracle_measures import LOW as LOW
from algebra.oracle_measures import one_ulp_failure
from algebra.oracle_measures import ulps as ulps

IDS = ("bfloat16", "float16")


def assert_one_ulp(got, ref, dtype, what: str):
    why = one_ulp_failure(got, ref, dtype)
    assert why is None, f"{what}: {why}"


def oracle(spec: str, inputs: dict) -> dict:
    """``redfuser.reference`` (float64) of the same input values, not the code under test."""
    return redfuser.reference(spec, {k: np.asarray(v, np.float64) for k, v in inputs.items()})
