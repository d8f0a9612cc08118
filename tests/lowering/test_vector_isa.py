"""The host vector-unit table (``redfuser.lowering.cpu.vector``) and the plans sized by it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

import redfuser
from redfuser.lowering.cpu.plan import GEMM, LANES
from redfuser.lowering.cpu.vector import (
    FMA_IN_FLIGHT,
    VECTOR_ISAS,
    _bytes,
    host_isa,
    host_narrowing,
)
from redfuser.tvm.target import cpu_has, host_target

CPUINFO = Path("/proc/cpuinfo")
# /proc/cpuinfo flag -> the VECTOR_ISAS row it means, best first (any x86-64 has sse2)
CPUINFO_ROWS = (("avx512f", "avx512"), ("avx2", "avx2"), ("asimd", "neon"))


@pytest.mark.parametrize("isa", VECTOR_ISAS, ids=lambda i: i.name)
def test_each_micro_kernel_fits_its_registers_and_covers_the_latency(isa):
    assert isa.fits(isa.gemm_rows, isa.gemm_vectors * isa.lanes), isa.why
    assert isa.gemm_sums >= FMA_IN_FLIGHT, "too few independent sums to hide the FMA latency"
    # negative self-tests: one more row of sums, or a column that is not whole vectors
    too_many = -(-(isa.registers - isa.gemm_vectors) // isa.gemm_vectors)
    assert not isa.fits(too_many, isa.gemm_vectors * isa.lanes)
    assert not isa.fits(isa.gemm_rows, isa.gemm_vectors * isa.lanes + 1)


@pytest.mark.skipif(not CPUINFO.exists(), reason="no /proc/cpuinfo: not Linux")
def test_the_host_row_is_the_vector_unit_linux_reports():
    """LLVM's view of the host (``host_isa``, from the CPU's name) against the kernel's
    (/proc/cpuinfo): the plans are sized by the widest vector unit Linux says this CPU has."""
    text = CPUINFO.read_text()
    flags = set(re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.M).group(1).split())
    expected = next((row for flag, row in CPUINFO_ROWS if flag in flags), "sse2")
    isa = next(isa for isa in VECTOR_ISAS if isa.name == expected)
    assert host_isa().name == expected, f"/proc/cpuinfo flags say {expected}"
    assert LANES == isa.lanes
    assert (GEMM["mr"][0], GEMM["nr"][0]) == (isa.gemm_rows, isa.gemm_vectors * isa.lanes)


def test_sysfs_sizes_are_read_with_their_suffix():
    assert (_bytes("32K\n"), _bytes("2M"), _bytes("512")) == (32768, 2 << 20, 512)


def test_a_blocking_of_partial_vectors_is_refused_not_computed():
    """nr = 24 with 16 lanes once built a kernel that skipped columns (error 4.9 against the
    oracle); it is now a ValueError naming the blocking."""
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((16, 256), np.float32),
              "w": rng.standard_normal((256, 64), np.float32), "eps": 1e-6}
    base = redfuser.compile("rmsnorm_gemm", tune=False)
    base.prepare(**inputs)
    assert base.plan.mr, "the policy blocks this shape as a GEMM"
    bad = dataclasses.replace(base.plan, nr=LANES + LANES // 2, nc=2 * (LANES + LANES // 2))
    with pytest.raises(ValueError, match="GEMM blocking: nr"):
        redfuser.compile("rmsnorm_gemm", plan=bad)(**inputs)


@pytest.mark.skipif(not CPUINFO.exists(), reason="no /proc/cpuinfo: not Linux")
def test_the_features_linux_reports_reach_the_kernels_when_llvm_names_an_older_model():
    """A virtual machine's CPU model can lack what its CPU has (an Emerald Rapids guest that
    LLVM names "rocketlake"): the host target adds what /proc/cpuinfo lists, so the bfloat16
    rounding instruction is used wherever Linux says the CPU has it."""
    text = CPUINFO.read_text()
    flags = set(re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.M).group(1).split())
    has = "avx512_bf16" in flags and host_isa().lanes == LANES == 16
    assert (host_narrowing("bfloat16", LANES) is not None) == has
    assert cpu_has(host_target(), "avx512bf16") == ("avx512_bf16" in flags)
