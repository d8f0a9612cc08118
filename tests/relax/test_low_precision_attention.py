"""``R.nn.attention`` on bfloat16 and float16 tensors (``relax/attention.py``): one fused
kernel that reads q, k and v in their dtype, computes in float32 and stores ``o`` in the
op's dtype, rounded once (a feature-vector result, ``signature.stored_results``): within
one unit in the last place of the float64 oracle rounded to that dtype, as torch's
attention on such tensors.  Another dtype is refused by name."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm

from redfuser.relax import build, fuse_module
from redfuser.tvm.graph import relax, relax_vm
from redfuser.tvm.runtime import empty_aligned
from tests.support.precision import assert_one_ulp

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
ALIGN = 64  # what code TVM compiled itself reads (``graph.relax_tensor``)


def _module(shapes, dtype: str, causal: str | None):
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"a{k}", relax.TensorType(s, dtype)) for k, s in enumerate(shapes)]
    with bb.function("main", xs):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.attention(*xs, None, None, causal))
        bb.emit_func_output(y)
    return bb.get()


def _tensor(array: np.ndarray, dtype: str):
    """A TVM tensor of ``dtype`` over an aligned copy of ``array`` (numpy hands bfloat16 to
    DLPack as its int16 bits only; torch's view carries the dtype)."""
    bits = empty_aligned(array.shape, np.int16, ALIGN)
    np.copyto(bits, array.view(np.int16))
    return tvm.runtime.from_dlpack(torch.from_numpy(bits).view(getattr(torch, dtype)))


def _reference(q, k, v, causal: bool) -> np.ndarray:
    """float64 attention in BSNH with K/V heads repeated for the grouped query heads."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bshd,bnhd->bhsn", q, k) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhsn,bnhd->bshd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("causal", [None, "TopLeft"])
def test_low_precision_attention_stores_o_in_its_dtype(dtype, causal):
    shapes = [(2, 5, 4, 16), (2, 9, 2, 16), (2, 9, 2, 16)]  # grouped query heads
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=s).astype(DTYPES[dtype]) for s in shapes]
    mod = _module(shapes, dtype, causal)
    fused, report = fuse_module(mod)
    assert (report.found, report.fused) == (1, 1), str(report)
    assert "R.nn.attention" not in fused.script() and "R.astype" not in fused.script()
    executable, _ = build(mod)
    out = relax_vm(executable)["main"](*(_tensor(a, dtype) for a in arrays))
    got = torch.from_dlpack(out)
    assert got.dtype == getattr(torch, dtype)
    got = got.view(torch.int16).numpy().view(DTYPES[dtype])
    assert_one_ulp(got, _reference(*arrays, causal is not None), DTYPES[dtype],
                   f"attention in {dtype}")


def test_other_dtypes_are_refused_by_name():
    _, report = fuse_module(_module([(1, 3, 2, 8), (1, 5, 2, 8), (1, 5, 2, 8)], "float64",
                                    None))
    assert report.fused == 0 and "dtype float64" in str(report), str(report)
