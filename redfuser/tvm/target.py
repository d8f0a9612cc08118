"""The machines a kernel is built for: TVM target dicts, the host CPU's features, the AMX
grant, the target in scope."""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from functools import lru_cache
from pathlib import Path

import tvm

SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86-64 Linux
# LLVM features by the /proc/cpuinfo flag that shows them: LLVM names the CPU by its model,
# and a virtual machine's model can lack what its CPU has (an Emerald Rapids guest named
# "rocketlake": no AVX-512 BF16, no AMX).  flag -> (feature, needs the AMX grant)
HOST_FLAGS = {"avx512_bf16": ("+avx512bf16", False), "avx512_fp16": ("+avx512fp16", False),
              "amx_tile": ("+amx-tile", True), "amx_int8": ("+amx-int8", True),
              "amx_bf16": ("+amx-bf16", True)}


def default_threads() -> int:
    """Threads the TVM runtime uses (TVM_NUM_THREADS, default: every core)."""
    return int(os.environ["TVM_NUM_THREADS"])


@lru_cache(maxsize=1)
def cpu_target() -> dict:
    """The host CPU by name: "native" and plain "llvm" silently give generic SSE code."""
    return {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}


@lru_cache(maxsize=1)
def host_grants_amx() -> bool:
    """Does Linux let this process use AMX tiles?  It must ask first (ARCH_REQ_XCOMP_PERM
    for XTILEDATA, granted to every thread of the process); a tile instruction without the
    grant is SIGILL.  The kernel refuses when the CPU or the hypervisor has no AMX."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


@lru_cache(maxsize=1)
def host_target() -> dict:
    """The host CPU (``cpu_target``) with the features of ``HOST_FLAGS`` that /proc/cpuinfo
    lists (AMX's only where the process is granted the tiles): every CPU kernel is built for
    it, and the plans read the host's features from it.

    Examples
    --------
    >>> host_target()["mcpu"] == cpu_target()["mcpu"]
    True
    """
    info = Path("/proc/cpuinfo")
    flags = set(info.read_text().split()) if info.exists() else set()
    extra = [feature for flag, (feature, amx) in HOST_FLAGS.items()
             if flag in flags and (not amx or host_grants_amx())]
    return {**cpu_target(), "mattr": extra} if extra else cpu_target()


def cpu_has(target: dict, feature: str) -> bool:
    """Does the LLVM CPU ``target`` names have ``feature`` ("avx512vnni", "avx2")?"""
    return bool(tvm.target.codegen.target_has_features(feature, tvm.target.Target(target)))


def cuda_target(arch: str = "sm_90") -> dict:
    return {"kind": "cuda", "arch": arch}


def host_triple() -> str:
    """The LLVM triple of this machine (a target with another one is cross-compiled)."""
    return str(tvm.target.codegen.llvm_get_system_triple())


def device(target: dict):
    """Device 0 of the kind ``target`` builds for (TVM's own map: llvm and c, the CPU).

    Examples
    --------
    >>> str(device(cpu_target()))
    'cpu:0'
    """
    return tvm.runtime.device_from_target(target, 0)


def cuda_device_name() -> str | None:
    """The name of GPU 0, or None where there is no driver or no device."""
    try:
        dev = tvm.cuda(0)
        return str(dev.device_name) if dev.exist else None
    except Exception:  # noqa: BLE001 - no driver: TVM raises its own error classes
        return None


def target_in_scope():
    """The ``tvm.target.Target`` in scope (``with Target(...)``), or None."""
    return tvm.target.Target.current(allow_none=True)


def current_target_kind() -> str | None:
    """The kind ("llvm", "cuda", ...) of the target in scope, or None when there is none."""
    target = target_in_scope()
    return None if target is None else str(target.kind.name)
