"""Every TVM import and version-specific name lives here (TVM 0.27: tirx, s_tir, tvm.compile).

The rest of redfuser imports TVM only through this module, so a TVM upgrade touches
one file.  See docs/TVM-NOTES.md for why each choice is what it is.
"""

from __future__ import annotations

import math
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
from tvm.support import nvcc  # noqa: E402

# Node classes for isinstance checks (0.27 exports BufferLoad as a builder function).
BufferLoadNode = type(tirx.decl_buffer((1,), "float32")[0])
LEAVES = (tirx.Var, tirx.IntImm, tirx.FloatImm, BufferLoadNode)

__all__ = ["ALIGNMENT", "LEAVES", "IRBuilder", "T", "arg_buffer", "build", "cpu_target",
           "cuda_device_name", "cuda_source", "cuda_target", "default_threads", "device",
           "empty_aligned", "from_dlpack", "from_numpy", "nvcc_compile", "structural_equal",
           "time_ms", "tirx"]


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


def cuda_device_name() -> str | None:
    """The name of GPU 0, or None where there is no driver or no device."""
    try:
        dev = tvm.cuda(0)
        return str(dev.device_name) if dev.exist else None
    except Exception:  # noqa: BLE001 - no driver: TVM raises its own error classes
        return None


# Kernel buffers are declared 16-byte aligned (numpy's guarantee for float arrays), so numpy
# inputs pass without a copy; TVM's own default (64) would force a copy of most of them.
ALIGNMENT = 16
# What code TVM compiles itself (a Relax executable's kernels) assumes of every tensor: handing
# it numpy's 16-byte aligned memory segfaults when the address is 16, 32 or 48 mod 64.
TVM_ALIGNMENT = 64


def arg_buffer(name: str, shape: tuple, dtype: str = "float32"):
    """A PrimFunc argument buffer, declared ALIGNMENT-aligned: every kernel argument must go
    through here, since from_numpy hands over numpy's 16-byte aligned memory as it is and
    code compiled for TVM's default 64-byte alignment would fault on it."""
    return T.match_buffer(T.arg(name, T.handle()), shape, dtype, align=ALIGNMENT)


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
        return tvm_ffi.from_dlpack(array, require_alignment=align, require_contiguous=True)
    return tvm.runtime.tensor(np.ascontiguousarray(array), dev)


def from_dlpack(tensor):
    """A TVM tensor over a host array (numpy's, or any DLPack tensor such as torch's):
    zero-copy when it is contiguous and ALIGNMENT-aligned, else an aligned numpy copy.  TVM
    never checks at call time the alignment a kernel was compiled for (a misaligned view
    would fault or misread), so every input goes through here."""
    try:
        return tvm_ffi.from_dlpack(tensor, require_alignment=ALIGNMENT, require_contiguous=True)
    except (ValueError, RuntimeError, TypeError):  # misaligned or strided: copy once
        return from_numpy(np.from_dlpack(tensor))


MIN_REPEAT_MS = 1  # each timed repeat runs the kernel for at least this long: a single
# call of a 0.1 ms kernel measures the thread pool's wake-up as much as the kernel


def time_ms(executable, name: str, dev, args, repeat: int = 5) -> float:
    """Median time of one call of ``executable[name]`` in milliseconds (TVM's evaluator,
    which synchronises the device), after one warm-up call (JIT, page faults, idle threads)."""
    executable[name](*args)
    timer = executable.mod.time_evaluator(name, dev, number=1, repeat=repeat,
                                          min_repeat_ms=MIN_REPEAT_MS)
    return float(timer(*args).median) * 1e3


def structural_equal(a, b) -> bool:
    """IR equality up to variable names (TVM's structural equality)."""
    return bool(tvm_ffi.structural_equal(a, b, map_free_vars=True))


def host_source(executable, fmt: str = "asm") -> str:
    """The code LLVM generated for a CPU executable: ``fmt`` "asm" (assembly) or "ll"
    (LLVM IR), to count instructions per element in a hot loop."""
    if fmt not in ("asm", "ll"):
        raise ValueError(f"fmt must be 'asm' or 'll', not {fmt!r}")
    return executable.mod.inspect_source(fmt)


def cuda_source(executable) -> str:
    """The generated .cu text of a CUDA executable."""
    return executable.mod.imports[0].inspect_source()


def nvcc_compile(source: str, arch: str = "sm_90") -> bytes:
    """Compile CUDA source with nvcc (must be on PATH) to PTX, inside a CUDA target scope."""
    with tvm.target.Target(cuda_target(arch)):
        return nvcc.compile_cuda(source, target_format="ptx", arch=arch, compiler="nvcc")


# --- Relax: names used by redfuser.relax (the model-level pass) ------------------------------
# 0.27 spellings: struct info is `.ty` (TensorType/TupleType), var names are `.name`.
from tvm import relax  # noqa: E402, F401
from tvm.ir import GenericConst, IRModule  # noqa: E402, F401
from tvm.ir.transform import Sequential, module_pass  # noqa: E402, F401
from tvm.s_tir import dlight  # noqa: E402, F401


def with_root_block(func):
    """``func`` with its body inside a root SBlock: Relax passes (RewriteDataflowReshape's
    reshape detection) read a called PrimFunc's root block."""
    return func.with_body(SBlockRealize([], True, SBlock([], [], [], "root", func.body)))


def import_torch(model, args: tuple) -> IRModule:
    """A PyTorch module as Relax through TVM's own importer (torch.export, then
    from_exported_program); the model runs in inference mode."""
    # lazily: torch is an optional dependency, and loading it costs seconds
    import torch
    from tvm.relax.frontend.torch import from_exported_program  # (imports torch)

    with torch.no_grad():
        return from_exported_program(torch.export.export(model, tuple(args)))


def build_relax(mod: IRModule, pipeline, target: dict):
    """Compile a Relax module with ``pipeline`` (a Pass, run inside the target's scope as
    dlight needs) for ``target``; returns the VM executable."""
    with tvm.target.Target(target):
        return tvm.compile(mod, target=tvm.target.Target(target), relax_pipeline=pipeline)


def relax_tensor(array: np.ndarray):
    """A host tensor a Relax executable may read: TVM_ALIGNMENT-aligned (copied if not)."""
    return from_numpy(np.ascontiguousarray(array), align=TVM_ALIGNMENT)


def relax_vm(executable, dev=None):
    """A Relax virtual machine over ``executable`` (CPU by default)."""
    return relax.VirtualMachine(executable, dev or tvm.cpu(0))


def current_target_kind() -> str | None:
    """The kind ("llvm", "cuda", ...) of the target in scope, or None when there is none."""
    target = tvm.target.Target.current(allow_none=True)
    return None if target is None else str(target.kind.name)


# --- TensorIR lifting and rewriting: names used by redfuser.tensorir (lift, fuse) ------------
# 0.27: a buffer *is* a Var (BufferType); loads are tvm.ir.expr.TensorLoad (`.source` is the
# buffer); PrimFunc has no buffer_map; SBlock/SBlockRealize live in s_tir; there is no Python
# stmt_functor: tvm_ffi.structural_map / structural_walk replace it.
from tvm import s_tir  # noqa: E402
from tvm.ir import Range  # noqa: E402
from tvm.ir.expr import Call, TensorLoad, TensorRegion  # noqa: E402
from tvm.tirx.buffer import is_buffer_var  # noqa: E402
from tvm_ffi import WalkResult, structural_map, structural_walk  # noqa: E402

SBlock, SBlockRealize = s_tir.SBlock, s_tir.SBlockRealize
__all__ += ["Call", "Range", "SBlock", "SBlockRealize", "TensorLoad", "TensorRegion",
            "WalkResult", "is_buffer_var", "structural_map", "structural_walk",
            "verify_sblock_func"]


def verify_sblock_func(func) -> str:
    """'' when ``func`` (a PrimFunc with SBlocks) is well formed, else TVM's message (the
    tirx verifier refuses every SBlock, so s_tir's is the one that applies)."""
    try:
        s_tir.analysis.verify_well_formed(func, assert_mode=True)
    except Exception as e:  # noqa: BLE001 - TVM raises its own error classes
        return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return ""
