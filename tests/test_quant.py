"""Quantization in the spec language and the int8 path: ``round`` (half to even, as numpy
and torch), ``clip(x, lo, hi)`` (numpy's ``np.clip``), the VNNI int8 GEMM micro-kernel and
the per-token quantization + GEMM kernel, against numpy.

Exactness is the point here, so most comparisons are ``array_equal``: rounding and clipping
are exact in float32, an int8 x int8 product accumulated in int32 is exact for any K below
2**31 / 127**2 (133 000), and the quantized values are compared with numpy's float32
evaluation of the same expression.  The only rounding left is the final float32 scaling
``acc * a / 127 * ws``, done in the same order as the numpy reference: bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import redfuser
from algebra.errors import SpecError
from algebra.functions import Clip, Round, bounds

TIES = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 4.5, 1e7 + 0.5, -0.49999997,
                 0.49999997, 8388607.5, np.inf, -np.inf, np.nan, -0.0], np.float32)


def _row(values: np.ndarray, n: int = 48) -> np.ndarray:
    """``values`` tiled to a row of ``n`` (past a vector width, so vector and tail code run)."""
    return np.resize(values, n).reshape(1, n).astype(np.float32)


# -- round and clip: the language and the kernels ------------------------------------------------

def test_round_half_to_even_in_the_kernel():
    x = _row(TIES)
    out = redfuser.compile("s = sum(x[i])\ny[i] = round(x[i])")(x=x)["y"]
    ref, nan = np.round(x), np.isnan(x)
    assert np.array_equal(np.isnan(out), nan)  # bit for bit elsewhere: -0.0 stays -0.0
    np.testing.assert_array_equal(out.view(np.int32)[~nan], ref.view(np.int32)[~nan])
    assert out[0, 0] == -2.0 and out[0, 4] == 2.0 and out[0, 7] == 4.0


def test_clip_matches_np_clip_in_the_kernel():
    x = _row(np.concatenate([TIES, [-300.0, 300.0, 126.6, -127.4]]))
    k = redfuser.compile("s = sum(clip(x[i], -1, 1))\ny[i] = clip(round(x[i] * 2), -127, 127)")
    out = k(x=np.nan_to_num(x, nan=0.0))
    with np.errstate(over="ignore"):  # 2 * 3.4e38 is inf, in the kernel too
        ref = np.clip(np.round(np.nan_to_num(x, nan=0.0) * np.float32(2)), -127, 127)
    np.testing.assert_array_equal(out["y"], ref)
    np.testing.assert_allclose(out["s"], np.clip(np.nan_to_num(x, nan=0.0), -1, 1).sum(),
                               rtol=1e-6)
    assert np.isnan(k(x=x)["y"][0, 14]), "clip(NaN) is NaN, as np.clip"


def test_clip_facts_and_errors():
    x, a = sp.Symbol("x", real=True), sp.Symbol("a", positive=True)
    q = Clip(Round(x * 127 / a), -127, 127)
    assert q.is_integer and bounds(q) == (-127, 127)
    assert Clip(x, -1, 1).is_integer is not True and bounds(Clip(x, a, 1)) is None
    assert Clip(sp.Float(3.5), -1, 1) == 1
    with pytest.raises(SpecError, match="clip"):
        redfuser.derive("s = sum(clip(x[i], 1))")
    with pytest.raises(redfuser.NotFusable, match="clip"):
        redfuser.derive("m = max(x[i])\ns = sum(clip(x[i] - m, -1, 1))")
