"""``make gpu-check``'s training and low-precision checks (``redfuser.tools.oracle_checks``),
run here on the CPU: the harness a GPU session relies on passes on the kernels CI can run,
and fails on a wrong result.  Every kernel a training step calls also compiles for CUDA
(sm_90, ptxas), and the device call path (inputs copied over, results copied back) runs on
the CPU device with torch tensors in."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch

import redfuser
from algebra.oracle_measures import one_ulp_failure
from redfuser.kernel import Kernel
from redfuser.tools.oracle_checks import check_dtypes, check_training
from redfuser.tvm.cuda import nvcc_compile
from tests.support import KERNEL_TOL, needs_nvcc

# one op of each backward shape: row cascade (softmax), rows + a column cascade over the
# rows (layernorm's dg, db), coefficients through the scores (attention), sorted ranges
# (causal attention), the LM head through the scores, a GEMM's column sum (rmsnorm_gemm's
# dw), selections (moe_routing's top-k), a staged cascade (threshold_mass)
TRAINING = ("softmax", "layernorm", "attention", "causal_attention", "linear_cross_entropy",
            "rmsnorm_gemm", "moe_routing", "threshold_mass")


@needs_nvcc
def test_training_steps_match_the_oracle_and_each_kernel_compiles_for_cuda(monkeypatch, capsys):
    calls = {}
    run = Kernel.__call__

    def record(kernel, out=None, **inputs):
        key = kernel.rule.cascade.text
        calls.setdefault(key, (kernel.rule, {k: v.numpy().copy() if isinstance(v, torch.Tensor)
                                             else v for k, v in inputs.items()}))
        return run(kernel, out, **inputs)

    monkeypatch.setattr(Kernel, "__call__", record)
    assert check_training("cpu", TRAINING) == 0, capsys.readouterr().out
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in printed] == [["ok", n] for n in TRAINING]
    texts = list(calls)
    # the row backward, a column sum over the rows (dw) and the scores' coefficients ran
    assert all(any(word in t for t in texts) for word in ("dx[i] =", "dw = sum(", "c[i] =")), \
        texts
    for rule, inputs in calls.values():
        k = redfuser.compile(rule, target="cuda", tune=False).prepare(**inputs)
        assert nvcc_compile(k.cuda_source(), arch="sm_90", fmt="cubin")[:4] == b"\x7fELF", \
            rule.cascade.text


def test_low_precision_library_outputs_pass_the_gpu_checks_measure(capsys):
    assert check_dtypes("cpu", ("softmax", "rmsnorm_gemm", "moe_routing")) == 0, \
        capsys.readouterr().out


def test_the_measures_fail_a_wrong_result():
    ref = np.linspace(1.0, 2.0, 2000)
    right = ref.astype(ml_dtypes.bfloat16)
    assert one_ulp_failure(right, ref, ml_dtypes.bfloat16) is None
    wrong = right.copy()
    wrong[:3] = (ref[:3] * (1 + 2 ** -6)).astype(ml_dtypes.bfloat16)  # 2 units in 3 elements
    assert "beyond 1 ulp" in one_ulp_failure(wrong, ref, ml_dtypes.bfloat16)
    assert "shape" in one_ulp_failure(right[:5], ref, ml_dtypes.bfloat16)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_the_device_call_path_copies_inputs_over_and_results_back(kind):
    """A device target's call path (``Kernel._on_device``) on the CPU device: the same
    numbers as the host path, from numpy arrays or torch tensors, into ``out=`` too."""
    x = np.random.default_rng(3).normal(size=(5, 37)).astype(np.float32)
    host = redfuser.compile("softmax", tune=False)
    device = redfuser.compile("softmax", tune=False)
    device.backend = dataclasses.replace(device.backend, host_memory=False)
    given = torch.from_numpy(x) if kind == "torch" else x
    want = host(x=x)
    got = device(x=given)
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), value)
    out = {"y": np.zeros_like(x)}
    device(x=given, out=out)
    np.testing.assert_array_equal(out["y"], want["y"])
    ref = redfuser.reference("softmax", {"x": x.astype(np.float64)})
    np.testing.assert_allclose(out["y"], ref["y"], rtol=KERNEL_TOL, atol=KERNEL_TOL)
