"""CUDA source and nvcc (compiling needs nvcc on PATH; nothing here needs a GPU)."""

from __future__ import annotations

import tvm
from tvm.support import nvcc

from .target import cuda_target


def cuda_source(executable) -> str:
    """The generated .cu text of a CUDA executable (a PrimFunc's or a Relax VM's: the CUDA
    module is found among the imports at any depth)."""
    pending = [executable.mod]
    while pending:
        module = pending.pop()
        if module.kind == "cuda":
            return module.inspect_source()
        pending += list(module.imports)
    raise ValueError("the executable holds no CUDA module")


def nvcc_compile(source: str, arch: str = "sm_90", fmt: str = "ptx") -> bytes:
    """Compile CUDA source with nvcc (must be on PATH), inside a CUDA target scope, to PTX
    or (``fmt="cubin"``) to machine code: only then does ptxas check the kernel's resources
    (shared memory, registers, stack) against the architecture's limits."""
    with tvm.target.Target(cuda_target(arch)):
        return nvcc.compile_cuda(source, target_format=fmt, arch=arch, compiler="nvcc")
