"""Every TVM import and version-specific name lives here (TVM 0.27: tirx, s_tir, tvm.compile).

The rest of redfuser imports TVM only through this module, so a TVM upgrade touches
one file.  See shared/TVM-NOTES.md for why each choice is what it is.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import tvm
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

# Node classes for isinstance checks (0.27 exports BufferLoad as a builder function).
BufferLoadNode = type(tirx.decl_buffer((1,), "float32")[0])
LEAVES = (tirx.Var, tirx.IntImm, tirx.FloatImm, BufferLoadNode)

__all__ = ["LEAVES", "IRBuilder", "T", "tirx", "build", "cpu_target", "cuda_target", "device",
           "from_numpy", "empty_aligned", "default_threads", "cuda_source", "nvcc_compile"]


def default_threads() -> int:
    """TVM's runtime uses one thread unless told; we default to every core."""
    return int(os.environ.get("TVM_NUM_THREADS", os.cpu_count() or 1))


os.environ.setdefault("TVM_NUM_THREADS", str(default_threads()))


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


ALIGNMENT = 64  # TVM-generated code assumes 64-byte aligned buffers; from_dlpack checks it


def empty_aligned(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def from_numpy(array: np.ndarray, dev=None):
    """A TVM tensor over a numpy array: zero-copy through DLPack when it is C-contiguous and
    64-byte aligned (large numpy allocations are); otherwise an aligned copy."""
    if dev is None or dev.device_type == tvm.cpu(0).device_type:
        if not (array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0
                and array.flags.writeable):
            aligned = empty_aligned(array.shape, array.dtype)
            np.copyto(aligned, array)
            array = aligned
        return tvm.runtime.from_dlpack(array)
    return tvm.runtime.tensor(array, dev)


def cuda_source(executable) -> str:
    """The generated .cu text of a CUDA executable."""
    return executable.mod.imports[0].inspect_source()


def nvcc_compile(source: str, arch: str = "sm_90") -> bytes:
    """Compile CUDA source with nvcc (must be on PATH) to PTX, inside a CUDA target scope."""
    from tvm.support import nvcc

    with tvm.target.Target(cuda_target(arch)):
        return nvcc.compile_cuda(source, target_format="ptx", arch=arch, compiler="nvcc")
