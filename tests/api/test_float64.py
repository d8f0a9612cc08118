"""float64 in, float64 computed (``algebra.dtypes``: ``compute_of``; ``Geometry.compute``).

Every output is compared with the float64 oracle (``redfuser.reference`` of the same input
values).  Tolerance: ``REL`` = 1e-12 of the output's largest magnitude.  A float64 sum of N
terms (N = 300 here, split over the lanes and merged) is within about N unit roundoffs,
300 x 1.1e-16 = 3.3e-14, in the worst case and far less in practice (measured: a few
1e-16); libm's exp and log are within an ulp; the re-anchoring factors exp(m_old - m_new)
add one rounding per merge.  1e-12 keeps a margin of 30 over that bound, and float32
compute can never meet it: its unit roundoff is 6e-8, so a kernel that silently computed
in float32 fails (``test_float32_compute_could_not_meet_the_tolerance`` holds the two apart
on the same inputs).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import redfuser
from algebra.dtypes import WIDE
from algebra.library import LIBRARY, example_inputs
from redfuser.lowering.cpu.plan import FOLD_REGISTERS, ISA, CpuPlan, fold_lanes
from redfuser.tune.db import entry_key

REL = 1e-12  # of the output's scale: see the module docstring
FLOAT32_FLOOR = 1e-8  # float32 compute's error on the same outputs is above this


def _wide(inputs: dict) -> dict:
    return {k: np.asarray(v, np.float64) if hasattr(v, "dtype") else v
            for k, v in inputs.items()}


def _error(got, ref) -> float:
    """max |got - ref| / max |ref|, 0 where both are the same infinity or both NaN; inf
    where only one is NaN or infinite."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    if same.all():
        return 0.0
    scale = np.max(np.abs(ref[np.isfinite(ref)]), initial=np.finfo(np.float64).tiny)
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(got - ref))
    return float(np.max(np.where(np.isnan(diff), np.inf, diff)) / scale)


def _check(out: dict, ref: dict, what: str):
    for o, value in out.items():
        index = value.dtype.kind == "i"
        assert value.dtype == (np.int64 if index else np.float64), f"{what} {o}: {value.dtype}"
        assert _error(value, ref[o]) <= REL, f"{what} {o}: {_error(value, ref[o]):.3g}"


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_cascades_compute_float64(name):
    inputs = _wide(example_inputs(name, n=300, rows=(5,), d=16, seed=3))
    kernel = redfuser.compile(name, tune=False)
    _check(kernel(**inputs), redfuser.reference(name, inputs), name)
    assert kernel.geometry(**inputs).compute == WIDE.name


@pytest.mark.parametrize("name", ["softmax", "layernorm", "rmsnorm_gemm", "attention"])
def test_float32_compute_could_not_meet_the_tolerance(name):
    """The same float64 inputs with ``compute_dtype="float32"`` (loads rounded to float32)
    miss REL by orders of magnitude: the float64 kernel's accuracy is its compute's."""
    inputs = _wide(example_inputs(name, n=300, rows=(6,), d=16, seed=4))
    ref = redfuser.reference(name, inputs)
    wide = redfuser.compile(name, tune=False)(**inputs)
    narrow = redfuser.compile(name, tune=False, compute_dtype="float32")(**inputs)
    assert max(_error(wide[o], ref[o]) for o in wide) < REL
    assert max(_error(narrow[o], ref[o]) for o in narrow) > FLOAT32_FLOOR


def _special_rows(n: int) -> np.ndarray:
    x = np.random.default_rng(n).normal(0, 3, (7, n))
    x[0, -2:], x[1], x[2, -1], x[3, 0] = -np.inf, -np.inf, np.nan, np.inf
    x[4] *= 1e299  # past float32's range: a float32 load gives inf
    x[5] *= 1e-300  # below float32's smallest subnormal
    return x


SPECIAL = {"softmax": {}, "log_softmax": {}, "logsumexp": {}, "l2_normalize": {},
           "variance": {}, "rmsnorm": {"eps": 1e-5}}


@pytest.mark.parametrize("name", sorted(SPECIAL))
@pytest.mark.parametrize("n", [1, 2, 300])
def test_special_values_and_huge_magnitudes(name, n):
    """-inf, NaN, +inf, magnitudes past float32's range and below its subnormals, N = 1:
    each row as the oracle gives it (finite where it is: 1e300 is an ordinary float64)."""
    inputs = {"x": _special_rows(n), **SPECIAL[name]}
    if name == "rmsnorm":
        inputs["g"] = np.linspace(0.5, 1.5, n)
    out = redfuser.compile(name, tune=False)(**inputs)
    ref = redfuser.reference(name, inputs)
    for o, value in out.items():
        for row in range(len(value)):  # row by row: each row's own scale
            assert _error(value[row], ref[o][row]) <= REL, f"{name} {o} row {row}"


def test_a_float32_load_overflows_where_float64_is_finite():
    x = np.random.default_rng(5).normal(size=(2, 64)) * 1e300
    ref = redfuser.reference("logsumexp", {"x": x})["lse"]
    wide = redfuser.compile("logsumexp", tune=False)(x=x)["lse"]
    narrow = redfuser.compile("logsumexp", tune=False, compute_dtype="float32")(x=x)["lse"]
    assert np.isfinite(ref).all() and np.isfinite(wide).all() and np.isinf(narrow).all()
    assert _error(wide, ref) <= REL


def test_dynamic_kernels_compute_float64_for_every_shape():
    kernel = redfuser.compile("softmax", dynamic=True)
    for rows, n in ((2, 5), (3, 100), (4, 3000)):
        x = np.random.default_rng(n).normal(0, 5, (rows, n))
        _check(kernel(x=x), redfuser.reference("softmax", {"x": x}), f"softmax {rows}x{n}")
    kernel(x=np.ones((2, 8), np.float32))  # float32 is another build, never the float64 one
    assert kernel.builds == 2


def test_out_arrays_of_float64_and_the_wrong_dtype_refused_by_name():
    x = np.random.default_rng(6).normal(size=(3, 50))
    kernel = redfuser.compile("softmax", tune=False)
    y = np.empty((3, 50))
    assert kernel(out={"y": y}, x=x)["y"] is y
    assert _error(y, redfuser.reference("softmax", {"x": x})["y"]) <= REL
    with pytest.raises(TypeError, match=r"out\['y'\] has dtype float32; expected float64"):
        kernel(out={"y": np.empty((3, 50), np.float32)}, x=x)
    with pytest.raises(TypeError, match=r"out\['m'\] has dtype float32; expected float64"):
        kernel(out={"m": np.empty(3, np.float32)}, x=x)


def test_numbers_and_torch_tensors_keep_float64():
    """A Python scale is float64 in a float64 kernel (not rounded to float32), and torch's
    float64 tensors go over as they are and come back as float64 tensors."""
    inputs = _wide(example_inputs("attention", n=40, rows=(2, 3), d=8, seed=7))
    inputs["scale"] = 0.1  # no float32 holds it exactly
    ref = redfuser.reference("attention", inputs)
    kernel = redfuser.compile("attention", tune=False)
    tin = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    out = kernel(**tin)
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in out.values())
    _check({k: v.numpy() for k, v in out.items()}, ref, "attention (torch)")


def test_mixed_inputs_compute_in_the_widest():
    """A float32 stream with a float64 weight computes in float64; compute_dtype pins it."""
    x = np.random.default_rng(8).normal(size=(4, 64))
    g = np.linspace(0.5, 1.5, 64)
    kernel = redfuser.compile("rmsnorm", tune=False)
    out = kernel(x=x.astype(np.float32), g=g, eps=1e-5)
    assert out["y"].dtype == np.float64 and out["r"].dtype == np.float64
    wide = redfuser.compile("rmsnorm", tune=False, compute_dtype="float64")
    assert wide(x=x.astype(np.float32), g=g.astype(np.float32), eps=1e-5)["r"].dtype == \
        np.float64


@pytest.mark.parametrize("bad", ["bfloat16", "int32", 3, "float128"])
def test_compute_dtype_is_validated(bad):
    with pytest.raises(ValueError, match=r"compute_dtype must be one of float32, float64"):
        redfuser.compile("softmax", compute_dtype=bad)


def test_paths_that_compute_float32_refuse_float64_by_name():
    """CUDA's kernels and the CPU's micro-kernels (a pinned GEMM plan) refuse a float64
    kernel with the path and the way out, before TVM sees anything; the policy's own plans
    for those rules fall back to the generic nest (``test_library_cascades_compute_float64``
    runs rmsnorm_gemm, attention and linear_cross_entropy)."""
    x = np.ones((2, 8))
    with pytest.raises(ValueError, match=r"target 'cuda' computes float32 .*compute_dtype="):
        redfuser.compile("softmax", target="cuda").prepare(x=x)
    with pytest.raises(ValueError, match=r"target 'cuda' computes float32"):
        redfuser.compile("softmax", target="cuda", compute_dtype="float64")
    inputs = _wide(example_inputs("rmsnorm_gemm", n=64, rows=(12,), d=32, seed=9))
    plan = CpuPlan("rolling", 1, 1, True, "pinned", mr=6, nr=ISA.lanes, kc=64,
                   nc=ISA.lanes, mc=6, nt=1)
    with pytest.raises(ValueError, match=r"GEMM micro-kernel and score tiles .* compute "
                                         r"float32.*computes float64"):
        redfuser.compile("rmsnorm_gemm", plan=plan)(**inputs)


def test_float64_lanes_keys_and_vector_code():
    """A float64 kernel folds in float64 vectors (half float32's lanes), its geometry and
    its tuning record are keyed apart from float32's, and its hot loop is vector code
    (``<N x double>`` in the LLVM IR; the libm exp is LLVM's vector intrinsic)."""
    x = np.random.default_rng(10).normal(size=(64, 4096))
    kernel = redfuser.compile("rmsnorm", tune=False)
    kernel(x=x, g=np.ones(4096), eps=1e-5)
    assert kernel.plan.lanes == fold_lanes(kernel.geometry(x=x, g=np.ones(4096), eps=1e-5))
    assert kernel.plan.lanes == FOLD_REGISTERS * ISA.lanes // 2
    ll = kernel.assembly("ll")
    assert re.search(rf"<{ISA.lanes // 2} x double>", ll)
    rule = redfuser.derive("softmax")
    wide = redfuser.compile(rule).geometry(x=x)
    pinned = redfuser.compile(rule, compute_dtype="float32").geometry(x=x)
    assert pinned.shape_key() == wide.shape_key() and pinned.key() != wide.key()
    assert entry_key(rule, pinned, "cpu", "m") != entry_key(rule, wide, "cpu", "m")
