"""Building and reading TensorIR: the script builder, argument buffers, rounding fences,
structural walks and equality, shape arithmetic.

0.27: a buffer *is* a Var (BufferType); loads are tvm.ir.expr.TensorLoad (``.source`` is the
buffer); PrimFunc has no buffer_map; SBlock/SBlockRealize live in s_tir; there is no Python
stmt_functor: tvm_ffi.structural_map / structural_walk replace it.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir import Range
from tvm.ir.expr import Call, TensorLoad, TensorRegion
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T
from tvm.tirx.buffer import is_buffer_var
from tvm_ffi import WalkResult, structural_map, structural_walk

__all__ = ["ALIGNMENT", "LEAVES", "Call", "IRBuilder", "Range", "SBlock", "SBlockRealize", "T",
           "TensorLoad", "TensorRegion", "WalkResult", "arg_alias", "arg_buffer", "block_sync",
           "bounded_simplify", "cuda_rounded", "is_buffer_var", "llvm_rounded",
           "provably_equal", "shape_var", "structural_equal", "structural_map",
           "structural_walk", "tirx", "verify_sblock_func", "with_root_block"]

# Node classes for isinstance checks (0.27 exports BufferLoad as a builder function).
BufferLoadNode = type(tirx.decl_buffer((1,), "float32")[0])
LEAVES = (tirx.Var, tirx.IntImm, tirx.FloatImm, BufferLoadNode)
SBlock, SBlockRealize = s_tir.SBlock, s_tir.SBlockRealize

# Kernel buffers are declared 16-byte aligned (numpy's guarantee for float arrays), so numpy
# inputs pass without a copy; TVM's own default (64) would force a copy of most of them.
ALIGNMENT = 16
_CUDA_ROUNDED = {tirx.Mul: "__fmul_rn", tirx.Add: "__fadd_rn", tirx.Sub: "__fsub_rn"}


def arg_buffer(name: str, shape: tuple, dtype: str = "float32"):
    """A PrimFunc argument buffer, declared ALIGNMENT-aligned: every kernel argument must go
    through here, since from_numpy hands over numpy's 16-byte aligned memory as it is and
    code compiled for TVM's default 64-byte alignment would fault on it."""
    return T.match_buffer(T.arg(name, T.handle()), shape, dtype, align=ALIGNMENT)


def argument_dtypes(func) -> set[str]:
    """The dtypes of a PrimFunc's buffer arguments."""
    return {str(p.dtype) for p in func.params if is_buffer_var(p)}


def arg_alias(buf, shape: tuple, dtype: str = "float32"):
    """A view of argument buffer ``buf`` with another (flattened) shape over the same
    memory, aligned as the argument is."""
    return T.decl_buffer(shape, dtype, data=buf.data, align=ALIGNMENT)


def shape_var(name: str, dtype: str = "int64"):
    """A TIR shape variable (bound from an argument's shape when the kernel is called)."""
    return tirx.Var(name, dtype)


def llvm_rounded(x):
    """``x`` behind an arithmetic fence: LLVM will not fuse the operation computing it into
    a later one.  TVM builds every LLVM target with AllowFPOpFusion = Fast, so ``a*b - c``
    becomes one FMA (the product unrounded) wherever the product has a single use.  (0.27's
    call_llvm_pure_intrin takes no signature-count argument.)"""
    return tirx.call_llvm_pure_intrin(x.ty.dtype, "llvm.arithmetic.fence", x)


def block_sync():
    """A CUDA block barrier (``__syncthreads``): what the threads stored before it, in
    shared or global memory, is what every thread of the block reads after it."""
    T.evaluate(T.tvm_storage_sync("shared"))


def cuda_rounded(x):
    """``x`` computed by its last operation rounded on its own: nvcc never contracts the
    ``__f*_rn`` intrinsics into an FMA (CUDA C Programming Guide, intrinsic functions); a
    value whose last operation is not one of these has nothing to contract."""
    name = _CUDA_ROUNDED.get(type(x))
    return x if name is None else tirx.call_pure_extern(x.ty.dtype, name, x.a, x.b)


def structural_equal(a, b) -> bool:
    """IR equality up to variable names (TVM's structural equality)."""
    return bool(tvm_ffi.structural_equal(a, b, map_free_vars=True))


def provably_equal(a, b) -> bool:
    """Are two shape values (ints or TIR expressions of shape variables) equal for every
    value of the variables?"""
    return bool(tvm.sym.Analyzer().can_prove_equal(tirx.const(a, "int64") if isinstance(
        a, int) else a, tirx.const(b, "int64") if isinstance(b, int) else b))


def bounded_simplify(bounds: dict):
    """A simplifier of shape expressions that knows each variable's range: ``bounds`` maps
    a TIR variable to (lowest, highest) value."""
    analyzer = tvm.sym.Analyzer()
    for var, (low, high) in bounds.items():
        analyzer.bind(var, tvm.ir.Range(low, high + 1))
    return analyzer.simplify


def with_root_block(func):
    """``func`` with its body inside a root SBlock: Relax passes (RewriteDataflowReshape's
    reshape detection) read a called PrimFunc's root block."""
    return func.with_body(SBlockRealize([], True, SBlock([], [], [], "root", func.body)))


def verify_sblock_func(func) -> str:
    """'' when ``func`` (a PrimFunc with SBlocks) is well formed, else TVM's message (the
    tirx verifier refuses every SBlock, so s_tir's is the one that applies)."""
    try:
        s_tir.analysis.verify_well_formed(func, assert_mode=True)
    except Exception as e:  # noqa: BLE001 - TVM raises its own error classes
        return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return ""
