"""float64's polynomial exp (``redfuser.lowering.fastmath64``) against numpy's: accuracy on
dense grids (measured: 1 ulp at most on [-745, 709.78]; the bound keeps one more),
subnormal results, special values, and vector code with no libm call, alone and inside a
float64 kernel."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

import redfuser
from redfuser.lowering.fastmath import elementwise_kernel
from redfuser.lowering.fastmath64 import fast_exp64
from redfuser.tvm.runtime import build, from_numpy
from redfuser.tvm.target import cpu_target

CHUNK = 1 << 18
ULPS = 2
LIBM = re.compile(r"^(llvm\.)?exp(\.|@|$)")


@functools.cache
def _kernel():
    return build(elementwise_kernel(fast_exp64, CHUNK, lanes=8, dtype="float64"),
                 cpu_target())


def _exp(xs: np.ndarray) -> np.ndarray:
    padded = np.zeros(CHUNK)
    padded[:len(xs)] = xs
    y = from_numpy(np.empty(CHUNK))
    _kernel()["fastmath_kernel"](from_numpy(padded), y)
    return y.numpy()[:len(xs)]


@pytest.mark.parametrize(("lo", "hi"), [(-745.0, 709.78), (-1.0, 1.0), (-745.1, -708.0)])
def test_within_two_ulp_of_numpy(lo, hi):
    """Normal results and subnormal ones (below ln DBL_MIN = -708.4: rounded once)."""
    xs = np.concatenate([np.linspace(lo, hi, CHUNK // 2),
                         np.random.default_rng(0).uniform(lo, hi, CHUNK // 2)])
    got, want = _exp(xs), np.exp(xs)
    assert (np.abs(got - want) <= ULPS * np.spacing(want)).all()


def test_special_values_are_numpys():
    xs = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, 709.79, 710.0, 1e300, -745.2, -1e300])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(_exp(xs), np.exp(xs))


def _calls(mod) -> set[str]:
    llvm_ir, asm = mod.inspect_source("ll"), mod.inspect_source("asm")
    return (set(re.findall(r"call [^@\n]*@([\w.]+)", llvm_ir))
            | set(re.findall(r"\bcall[lq]?\s+([\w.]+)", asm)))


def test_vectorized_without_libm_calls():
    mod = _kernel().mod
    assert "<8 x double>" in mod.inspect_source("ll")
    assert not [c for c in _calls(mod) if LIBM.match(c)]


def test_a_float64_softmax_calls_no_libm_exp():
    """A kernel that computes in float64 takes this exp, not TVM's (one libm call per lane:
    the float64 softmax ran 24x slower than the float32 one)."""
    kernel = redfuser.compile("softmax", tune=False)
    x = np.random.default_rng(1).normal(size=(4, 256))
    assert kernel.geometry(x=x).compute == "float64"
    y = np.asarray(kernel(x=x)["y"])
    llvm_ir, asm = kernel.assembly("ll"), kernel.assembly()
    calls = set(re.findall(r"call [^@\n]*@([\w.]+)", llvm_ir)) | set(
        re.findall(r"\bcall[lq]?\s+([\w.]+)", asm))
    assert "double>" in llvm_ir and not [c for c in calls if LIBM.match(c)]
    want = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(y, want / want.sum(-1, keepdims=True), rtol=1e-14)
