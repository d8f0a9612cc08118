"""Software prefetch of the next rows (``redfuser.lowering.cpu.prefetch``): the policy
asks for it where a thread folds rows one after another, the hot loop carries one
``prefetcht1`` per cache line of the rows ahead, and the results are the same bits as
without it (a prefetch changes no value), up to the last rows, where the rows ahead are
past the end."""

from __future__ import annotations

import dataclasses
import re

import ml_dtypes
import numpy as np
import pytest

import redfuser
from redfuser.lowering.cpu.plan import CpuPlan
from redfuser.lowering.cpu.prefetch import AHEAD_BYTES, LINE
from redfuser.tune.space import plan_from_params, plan_params
from tests.support import KERNEL_TOL
from tests.support.precision import assert_one_ulp, oracle


def _softmax(dtype, rows: int, n: int):
    x = np.random.default_rng(rows + n).normal(0, 3, (rows, n)).astype(dtype)
    x[1, 3], x[2, :] = np.nan, -np.inf
    return x


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_rows_ahead_cover_the_bytes_in_flight_and_change_no_bit(dtype):
    x = _softmax(dtype, 64, 1000)
    kernel = redfuser.compile("softmax", tune=False)
    got = kernel(x=x)
    row = x.shape[1] * x.itemsize
    assert kernel.plan.ahead == -(-AHEAD_BYTES // row), kernel.plan
    assert f"prefetch {kernel.plan.ahead} row(s) ahead" in str(kernel.plan)
    # every cache line of the tile's elements, ahead rows further, into L2
    asm = kernel._last.executable.mod.inspect_source("asm")
    lines = len(re.findall(r"\bprefetcht1\b", asm))
    assert lines == kernel.plan.lanes * x.itemsize // LINE, (lines, kernel.plan)
    plain = redfuser.compile("softmax", tune=False,
                             plan=dataclasses.replace(kernel.plan, ahead=0))
    want = plain(x=x)
    assert "prefetcht1" not in plain._last.executable.mod.inspect_source("asm")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    ref = oracle("softmax", {"x": x})["y"]
    if dtype is np.float32:
        np.testing.assert_allclose(got["y"], ref, rtol=KERNEL_TOL, atol=KERNEL_TOL)
    else:
        assert_one_ulp(got["y"], ref, dtype, "softmax y")


def test_rows_ahead_past_the_last_row_read_nothing_out_of_bounds():
    """A pinned plan asking for more rows ahead than there are: each thread's last rows
    prefetch the last row instead (the kernel stays in bounds; the values are the same)."""
    x = _softmax(np.float32, 5, 300)
    policy = redfuser.compile("softmax", tune=False)
    want = policy(x=x)
    far = redfuser.compile("softmax", tune=False,
                           plan=dataclasses.replace(policy.plan, ahead=64))
    for name, value in far(x=x).items():
        np.testing.assert_array_equal(value, want[name])


def test_no_prefetch_where_nothing_overlaps():
    """One row, work for one thread, and the unfused baseline (the measure of fusion
    stays what it was) fold without it."""
    assert redfuser.compile("softmax", tune=False).prepare(x=np.zeros((1, 4096))).plan.ahead == 0
    assert redfuser.compile("softmax", tune=False).prepare(x=np.zeros((4, 64))).plan.ahead == 0
    unfused = redfuser.compile("softmax", variant="unfused", tune=False)
    assert unfused.prepare(x=np.zeros((64, 4096), np.float32)).plan.ahead == 0


def test_the_rows_ahead_survive_a_tuning_record_and_a_negative_count_is_refused():
    plan = redfuser.compile("softmax", tune=False).prepare(
        x=np.zeros((64, 4096), np.float32)).plan
    assert plan_from_params(plan_params(plan)) == dataclasses.replace(plan, reason="")
    with pytest.raises(ValueError, match="ahead"):
        CpuPlan("rolling", 64, ahead=-1)
