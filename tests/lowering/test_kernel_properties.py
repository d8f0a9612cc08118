"""Kernels for cascades nobody wrote a test for: hypothesis writes a chain of 1-3 reductions
(each later body anchored at earlier results, plus epilogues, per-element outputs and feature
vectors), ``derive`` proves it, and every variant's kernel must match the float64 oracle.

Tolerance: the kernel computes in float32, the oracle in float64 on the same (float32)
inputs.  A cascade may be ill-conditioned (``sum(x - mean)`` is all cancellation), so the
bound is taken from the problem itself: how far the float64 results move when the inputs and
every intermediate result move by a few float32 ulps (``support.generated.sensitivity``; the
spec's *twin* multiplies each use of a result by a per-row 1 + u), times a safety factor, plus
float32 rounding of the result (rtol 1e-4: sums over N <= 40 elements, exp/log within 1e-7).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import redfuser
from tests.support import (
    SAFETY,
    VARIANTS,
    assert_indices_equal,
    assert_matches,
    cascades,
    examples,
    rule_for,
    sensitivity,
)

# under the name it had when the derandomized examples were chosen: hypothesis seeds them
# from each test's source text, so renaming a call inside a test draws other examples
from tests.support import cascade_inputs as make_inputs


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=examples(0.6))  # 15 cascades per variant: each one compiles a kernel
@given(specs=cascades(), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40),
       rows=st.sampled_from([(1,), (3,), (2, 2)]))
def test_generated_cascade_kernels_match_the_oracle(variant, specs, seed, n, rows):
    spec, twin = specs
    try:
        rule = rule_for(spec)
    except (redfuser.NotFusable, redfuser.SpecError):
        assume(False)  # a template combination the engine rightly refuses
    rng = np.random.default_rng(seed)
    n = max(n, 2) if "topk" in spec else n  # top-2 of one element is a documented ValueError
    inputs = make_inputs(rule, rng, rows, n, d=3)
    out = redfuser.compile(rule, variant=variant)(**inputs)
    ref = redfuser.reference(spec, inputs)
    slack = sensitivity(spec, twin, inputs, rows, rng)
    assert list(out) == list(ref)
    for name in ref:
        if ref[name].dtype.kind in "iu":
            assert_indices_equal(out[name], ref[name], name)
            continue
        stable = np.isfinite(slack[name])
        scale = np.abs(np.where(np.isfinite(ref[name]), ref[name], 0.0))
        atol = SAFETY * np.where(stable, slack[name], 0.0) + 1e-5 * (1 + scale)
        assert_matches(np.where(stable, out[name], ref[name]), ref[name], 1e-4, atol,
                       f"{spec!r} [{variant}] {name}")
