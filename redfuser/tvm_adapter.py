"""Every TVM import and version-specific name lives here (TVM 0.27: tirx, s_tir, tvm.compile).

The rest of redfuser imports TVM only through this module, so a TVM upgrade touches
one file.  See shared/TVM-NOTES.md for why each choice is what it is.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

# TVM's runtime uses one thread unless told, and reads this when it loads: set it first.
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402
from tvm import tirx  # noqa: E402
from tvm.script.ir_builder import IRBuilder  # noqa: E402
from tvm.script.ir_builder import tirx as T  # noqa: E402

# Node classes for isinstance checks (0.27 exports BufferLoad as a builder function).
BufferLoadNode = type(tirx.decl_buffer((1,), "float32")[0])
LEAVES = (tirx.Var, tirx.IntImm, tirx.FloatImm, BufferLoadNode)

__all__ = ["ALIGNMENT", "LEAVES", "IRBuilder", "T", "arg_buffer", "build", "cpu_target",
           "cuda_source", "cuda_target", "default_threads", "device", "empty_aligned",
           "from_numpy", "nvcc_compile", "structural_equal", "time_ms", "tirx"]


def default_threads() -> int:
    """Threads the TVM runtime uses (TVM_NUM_THREADS, default: every core)."""
    return int(os.environ["TVM_NUM_THREADS"])


@lru_cache(maxsize=1)
def cpu_target() -> dict:
    """The host CPU by name: "native" and plain "llvm" silently give generic SSE code."""
    return {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}


def cuda_target(arch: str = "sm_90") -> dict:
    return {"kind": "cuda", "arch": arch}


def build(func: tirx.PrimFunc, target: dict):
    """Compile one PrimFunc; returns the executable (call ``ex[name](*tensors)``)."""
    return tvm.compile(func, target=target)


def device(target: dict):
    return tvm.cuda(0) if target["kind"] == "cuda" else tvm.cpu(0)


# Kernel buffers are declared 16-byte aligned (numpy's guarantee for float arrays), so numpy
# inputs pass without a copy; TVM's own default (64) would force a copy of most of them.
ALIGNMENT = 16


def arg_buffer(name: str, shape: tuple, dtype: str = "float32"):
    """A PrimFunc argument buffer, declared ALIGNMENT-aligned: every kernel argument must go
    through here, since from_numpy hands over numpy's 16-byte aligned memory as it is and
    code compiled for TVM's default 64-byte alignment would fault on it."""
    return T.match_buffer(T.arg(name, T.handle()), shape, dtype, align=ALIGNMENT)


def empty_aligned(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def from_numpy(array: np.ndarray, dev=None):
    """A TVM tensor over a numpy array: zero-copy through DLPack when it is C-contiguous,
    writeable and ALIGNMENT-aligned (numpy's arrays are); otherwise an aligned copy."""
    if dev is None or dev.dlpack_device_type() == tvm.cpu(0).dlpack_device_type():
        if not (array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0
                and array.flags.writeable):
            aligned = empty_aligned(array.shape, array.dtype)
            np.copyto(aligned, array)
            array = aligned
        return tvm_ffi.from_dlpack(array, require_alignment=ALIGNMENT, require_contiguous=True)
    return tvm.runtime.tensor(np.ascontiguousarray(array), dev)


def time_ms(executable, name: str, dev, args, repeat: int = 5) -> float:
    """Median time of one call of ``executable[name]`` in milliseconds (TVM's evaluator,
    which synchronises the device)."""
    timer = executable.mod.time_evaluator(name, dev, number=1, repeat=repeat, min_repeat_ms=0)
    return float(timer(*args).median) * 1e3


def structural_equal(a, b) -> bool:
    """IR equality up to variable names (TVM's structural equality)."""
    return bool(tvm_ffi.structural_equal(a, b, map_free_vars=True))


def cuda_source(executable) -> str:
    """The generated .cu text of a CUDA executable."""
    return executable.mod.imports[0].inspect_source()


def nvcc_compile(source: str, arch: str = "sm_90") -> bytes:
    """Compile CUDA source with nvcc (must be on PATH) to PTX, inside a CUDA target scope."""
    from tvm.support import nvcc

    with tvm.target.Target(cuda_target(arch)):
        return nvcc.compile_cuda(source, target_format="ptx", arch=arch, compiler="nvcc")
