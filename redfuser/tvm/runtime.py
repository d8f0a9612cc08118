"""Compiling a PrimFunc, tensors over host memory without copies, and timing."""

from __future__ import annotations

import math

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

from algebra.layout import bits_view

from .ir import ALIGNMENT

# What code TVM compiles itself (a Relax executable's kernels) assumes of every tensor: handing
# it numpy's 16-byte aligned memory segfaults when the address is 16, 32 or 48 mod 64.
TVM_ALIGNMENT = 64
MIN_REPEAT_MS = 1  # each timed repeat runs the kernel for at least this long: a single
# call of a 0.1 ms kernel measures the thread pool's wake-up as much as the kernel


def build(func: tirx.PrimFunc, target: dict):
    """Compile one PrimFunc; returns the executable (call ``ex[name](*tensors)``).  Built
    inside the target's scope: TVM's CUDA compile callback reads the architecture from the
    scope, and otherwise asks the GPU (none where kernels are only compiled)."""
    with tvm.target.Target(target):
        return tvm.compile(func, target=target)


def empty_aligned(shape: tuple, dtype, align: int = ALIGNMENT) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``align``-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def from_numpy(array: np.ndarray, dev=None, align: int = ALIGNMENT):
    """A TVM tensor over a numpy array: zero-copy through DLPack when it is C-contiguous,
    writeable and ``align``-aligned; otherwise an aligned copy.  redfuser's kernels need
    ALIGNMENT (numpy's arrays have it); code TVM compiled itself needs TVM_ALIGNMENT."""
    if dev is None or dev.dlpack_device_type() == tvm.cpu(0).dlpack_device_type():
        array = np.asarray(array)
        if not (array.flags.c_contiguous and array.ctypes.data % align == 0
                and array.flags.writeable):
            aligned = empty_aligned(array.shape, array.dtype, align)
            np.copyto(aligned, array)
            array = aligned
        return kernel_arg(tvm_ffi.from_dlpack(_bits(array), require_alignment=align,
                                              require_contiguous=True))
    return tvm.runtime.tensor(np.ascontiguousarray(array), dev)


def from_dlpack(tensor):
    """A TVM tensor over a host array (numpy's, or any DLPack tensor such as torch's):
    zero-copy when it is contiguous and ALIGNMENT-aligned, else an aligned numpy copy.  TVM
    never checks at call time the alignment a kernel was compiled for (a misaligned view
    would fault or misread), so every input goes through here.  An empty array (an N = 0
    stream) becomes a TVM-allocated one: numpy and torch give it strides TVM's compact
    check refuses ("Mismatched .strides"), and there is nothing to copy.  A torch tensor
    that requires grad, which torch's Python DLPack export refuses (BufferError), is read
    through TVM's own import (torch's C exchange API), which takes it."""
    tensor = _bits(tensor)
    try:
        out = tvm_ffi.from_dlpack(tensor, require_alignment=ALIGNMENT, require_contiguous=True)
    except (ValueError, RuntimeError, TypeError, BufferError):  # misaligned, strided or
        # (torch) requiring grad: copy once
        try:
            host = np.from_dlpack(tensor)
        except BufferError:  # torch, requires grad
            host = np.from_dlpack(tvm_ffi.from_dlpack(tensor))
        out = from_numpy(host)
    return kernel_arg(out) if 0 in tuple(out.shape) else out


def aligned_arg(array):
    """``array`` as a kernel argument without a copy, or None where it is not contiguous
    and ALIGNMENT-aligned: DLPack's own check, in C (reading a numpy view's address through
    ``ctypes`` costs three times as much).  For outputs, which must never be copies."""
    try:
        out = tvm_ffi.from_dlpack(_bits(array), require_alignment=ALIGNMENT,
                                  require_contiguous=True)
    except (ValueError, RuntimeError, TypeError, BufferError):
        return None
    return kernel_arg(out)


def kernel_arg(array):
    """``array`` as a kernel argument: as it is, except an empty one, which is replaced by
    a TVM-allocated empty tensor of its shape and dtype (compact strides, see
    ``from_dlpack``); the kernel never reads or writes an empty buffer."""
    if 0 not in tuple(array.shape):
        return array
    return tvm.runtime.empty(tuple(array.shape), str(array.dtype), tvm.cpu(0))


def host_arg(array: np.ndarray):
    """A host numpy array as a kernel argument over its own memory.  A dtype DLPack cannot
    carry (ml_dtypes' bfloat16: numpy kind "V"), which kernels declare as its bits
    (``algebra.dtypes``), goes over as those bits: a view, no copy."""
    return kernel_arg(_bits(array))


def _bits(array):
    """``array`` as a kernel declares it: a bfloat16 one as its bits (a numpy array's dtype
    kind says so in one attribute read)."""
    if isinstance(array, np.ndarray) and array.dtype.kind != "V":
        return array
    return bits_view(array)


def time_ms(executable, name: str, dev, args, repeat: int = 5) -> float:
    """Median time of one call of ``executable[name]`` in milliseconds (TVM's evaluator,
    which synchronises the device), after one warm-up call (JIT, page faults, idle threads)."""
    executable[name](*args)
    timer = executable.mod.time_evaluator(name, dev, number=1, repeat=repeat,
                                          min_repeat_ms=MIN_REPEAT_MS)
    return float(timer(*args).median) * 1e3


def host_source(executable, fmt: str = "asm") -> str:
    """The code LLVM generated for a CPU executable: ``fmt`` "asm" (assembly) or "ll"
    (LLVM IR), to count instructions per element in a hot loop."""
    if fmt not in ("asm", "ll"):
        raise ValueError(f"fmt must be 'asm' or 'll', not {fmt!r}")
    return executable.mod.inspect_source(fmt)
