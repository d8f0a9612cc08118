"""Relax modules: import from torch, compile, load and save, the virtual machine.

0.27 spellings: struct info is ``.ty`` (TensorType/TupleType), var names are ``.name``.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir import GenericConst, IRModule
from tvm.ir.transform import Sequential, module_pass
from tvm.s_tir import dlight

from algebra.dtypes import COMPUTE, storage

from .runtime import TVM_ALIGNMENT, from_numpy

__all__ = ["GenericConst", "IRModule", "Sequential", "build_relax", "dlight", "import_torch",
           "load_ir_module", "module_pass", "relax", "relax_tensor", "relax_vm",
           "save_ir_module"]


def import_torch(model, args: tuple, dynamic_shapes=None) -> IRModule:
    """A PyTorch module as Relax through TVM's own importer (torch.export, then
    from_exported_program); the model runs in inference mode.  ``dynamic_shapes`` is
    torch.export's (``torch.export.Dim`` per symbolic axis): those axes become Relax
    shape variables.  It traces under the math backend of scaled_dot_product_attention: the
    graph keeps the one SDPA op either way, but the CPU flash backend's fake output has
    strides a later ``view`` refuses (transformers' GPT-2 with ``sdpa``: "Cannot view a
    tensor with shape [2, s, 64] and strides (64, 128, 1)", pytorch/pytorch#141107)."""
    # lazily: torch is an optional dependency, and loading it costs seconds
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel  # (torch, as above)
    from tvm.relax.frontend.torch import from_exported_program  # (imports torch)

    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        exported = torch.export.export(model, tuple(args), dynamic_shapes=dynamic_shapes)
        if _low_precision(model):
            exported = exported.run_decompositions({
                torch.ops.aten.addmm.default: _addmm, torch.ops.aten.linear.default: _linear,
                torch.ops.aten.pow.Tensor_Scalar: _pow,
                torch.ops.aten.layer_norm.default: _layer_norm})
        return from_exported_program(exported)


def _low_precision(model) -> bool:
    """Does the model hold parameters of a storage dtype narrower than float32?"""
    return any(storage(p.dtype) not in (None, COMPUTE) for p in model.parameters())


def _addmm(bias, mat1, mat2, beta=1, alpha=1):
    """``aten.addmm`` of a low-precision model in float32, rounded once at the end, as
    torch's CPU kernel computes it: TVM's importer writes the product in float32 and adds the
    low-precision bias to it, which Relax refuses ("Binary operators must have the same
    datatype"; GPT-2's Conv1D and BERT's linears in bfloat16)."""
    out = alpha * (mat1.float() @ mat2.float()) + beta * bias.float()
    return out.to(mat1.dtype)


def _linear(x, weight, bias=None):
    """``aten.linear`` of a low-precision model: with a bias as ``_addmm`` (BERT's), else
    the product in the model's dtype, as TVM imports it."""
    if bias is None:
        return x @ weight.transpose(0, 1)
    return ((x.float() @ weight.float().transpose(0, 1)) + bias.float()).to(x.dtype)


def _pow(x, exponent):
    """``aten.pow`` of a low-precision tensor in float32, rounded once, as torch's CPU
    kernel computes it: TVM cannot legalize ``power`` in bfloat16 (GPT-2's GELU, x**3).
    Other dtypes keep the op (``NotImplemented``: the float32 power this traces too)."""
    if storage(x.dtype) in (None, COMPUTE):
        return NotImplemented
    return (x.float() ** exponent).to(x.dtype)


def _layer_norm(x, shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    """``aten.layer_norm`` of a low-precision tensor in float32, rounded once, as torch's
    CPU kernel computes it: TVM cannot legalize ``layer_norm`` in bfloat16 (BERT's and
    GPT-2's), so their unfused builds failed.  The casts around it are the ones the pass
    folds into its kernel's loads and stores (transformers writes RMSNorm that way)."""
    import torch  # only reached from import_torch, which has loaded it

    if storage(x.dtype) in (None, COMPUTE):
        return NotImplemented
    wide = [t.float() if t is not None else None for t in (weight, bias)]
    return torch.nn.functional.layer_norm(x.float(), shape, *wide, eps).to(x.dtype)


def build_relax(mod: IRModule, pipeline, target: dict):
    """Compile a Relax module with ``pipeline`` (a Pass, run inside the target's scope as
    dlight needs) for ``target``; returns the VM executable."""
    with tvm.target.Target(target):
        return tvm.compile(mod, target=tvm.target.Target(target), relax_pipeline=pipeline)


def load_ir_module(path: str) -> IRModule:
    """The IRModule saved at ``path``: JSON (``save_ir_module``, ``tvm.ir.save_json``) when
    the name ends in ``.json``, else TVMScript text (``mod.script()``).  ``ValueError``
    naming the file when it holds something else."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    how = "tvm.ir.save_json JSON" if path.endswith(".json") else "TVMScript"
    try:
        mod = tvm.ir.load_json(text) if path.endswith(".json") else tvm.script.from_source(text)
    except Exception as e:  # noqa: BLE001 - the parsers raise many classes (SyntaxError too)
        first = str(e).strip().splitlines()[:1] or [type(e).__name__]
        raise ValueError(f"{path} is not a module in {how}: {first[0]}") from None
    if not isinstance(mod, IRModule):
        raise ValueError(f"{path} holds a {type(mod).__name__}, not an IRModule")
    return mod


def save_ir_module(mod: IRModule, path: str) -> None:
    """Write ``mod`` as JSON (``load_ir_module`` reads it back)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(tvm.ir.save_json(mod))


def relax_tensor(array: np.ndarray):
    """A host tensor a Relax executable may read: TVM_ALIGNMENT-aligned (copied if not)."""
    return from_numpy(np.ascontiguousarray(array), align=TVM_ALIGNMENT)


def relax_vm(executable, dev=None):
    """A Relax virtual machine over ``executable`` (CPU by default)."""
    return relax.VirtualMachine(executable, dev or tvm.cpu(0))
