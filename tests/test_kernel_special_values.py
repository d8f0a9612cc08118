"""Generated cascades through ``compile``, fed NaN and ties, in every variant: the kernel must
put NaN, +inf and -inf exactly where the float64 oracle has them, pick the same indices, and
match it elsewhere.  The cascades and the tolerance are those of test_kernel_properties.py
(the twin moves inputs and results by a few float32 ulps; where that flips the oracle to or
from NaN/inf, or moves it by half its size, no float32 computation can be held to it).
Derandomized in CI (tests/conftest.py).

Infinite and huge elements are not drawn: rules that expand a body into power sums
(``sum((x - r)**3)``) or factor a result out of a sum (``sum(x * r)`` as ``r * sum(x)``)
give inf - inf = NaN, or an infinity, where the element-wise reference gives the other at
an infinite element or anchor; that is the engine's algebra, not the kernels (evaluate does
the same).  Infinite anchors over finite states are covered by the settle tests.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_indices_equal, assert_matches, examples, rule_for
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_kernel_properties import SAFETY, VARIANTS, cascades, make_inputs, sensitivity

import redfuser

SPECIAL = ("nan", "ties")  # what replaces some entries of x (see the module docstring)
NAN_SHARE = 0.2  # of the entries of the other rows: most rows hold a NaN, some none


def inject(x: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """x with special values: NaN at random entries and in the whole first row, or few
    distinct values (ties)."""
    x = x.copy()
    if kind == "ties":
        return np.round(x).astype(np.float32)
    value = np.float32(np.nan)
    x[rng.random(x.shape) < NAN_SHARE] = value
    x.reshape(-1, x.shape[-1])[0] = value  # the first row is all special
    return x


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=examples(0.4))  # 10 cascades per variant: each compiles a kernel
@given(specs=cascades(), seed=st.integers(0, 2**32 - 1), n=st.integers(2, 40),
       rows=st.sampled_from([(3,), (2, 2)]), kind=st.sampled_from(SPECIAL))
def test_generated_kernels_follow_the_oracle_on_special_values(variant, specs, seed, n, rows,
                                                               kind):
    spec, twin = specs
    try:
        rule = rule_for(spec)
    except (redfuser.NotFusable, redfuser.SpecError):
        assume(False)  # a template combination the engine rightly refuses
    rng = np.random.default_rng(seed)
    inputs = make_inputs(rule, rng, rows, n, d=3)
    inputs["x"] = inject(inputs["x"], kind, rng)
    out = redfuser.compile(spec, variant=variant, tune=False)(**inputs)
    with np.errstate(all="ignore"):
        ref = redfuser.reference(spec, inputs)
        slack = sensitivity(spec, twin, inputs, rows, rng)
    assert list(out) == list(ref)
    for name in ref:
        where = f"{spec!r} [{variant}, {kind}] {name}"
        if ref[name].dtype.kind in "iu":
            assert_indices_equal(out[name], ref[name], where)
            continue
        stable = np.isfinite(slack[name])
        scale = np.abs(np.where(np.isfinite(ref[name]), ref[name], 0.0))
        atol = SAFETY * np.where(stable, slack[name], 0.0) + 1e-5 * (1 + scale)
        assert_matches(np.where(stable, out[name], ref[name]), ref[name], 1e-4, atol, where)
