"""Real transformers architectures (tiny configs, seeded random weights, nothing downloaded)
through the Relax pass, built and run at two sequence lengths against PyTorch; the pass's
report names every reduction of each model, and the cascades each architecture must fuse
are fused."""

from __future__ import annotations

import numpy as np
import pytest

import redfuser.relax as rr
from redfuser.examples.hf import ARCHS, LENGTHS, evaluate_hf, hf_table
from redfuser.tvm_adapter import relax

# Hidden states of O(1) (each model ends in a norm), float32 on both sides: the fused
# kernels' polynomial exp (relative error 8.5e-8) and reassociated sums measured ~1e-6 per
# model; 1e-4 leaves room for other summation orders and still catches a wrong mask/scale.
ATOL = 1e-4
LAYERS = 1  # one block per model keeps this file's builds small; the CLI table uses 2


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_architecture_fused_end_to_end_at_two_lengths(name):
    r = evaluate_hf(name, "eager", layers=LAYERS, dynamic=name == "gpt2", timing=False)
    assert sorted(r.errors) == sorted(LENGTHS)
    assert max(r.errors.values()) < ATOL, (r.errors, str(r.report))
    assert r.unreported == (), f"reductions missing from the report: {r.unreported}"
    must = set(ARCHS[name].must_fuse["eager"])
    assert must <= r.fused_ops(), f"{sorted(must - r.fused_ops())} not fused:\n{r.report}"
    table = hf_table([r])
    assert all(line.split(": ", 1)[-1].splitlines()[0] in table for line in r.report.reasons())
    if name == "gpt2":  # the symbolic-length export was tried, and the result says how it went
        assert "symbolic length" in r.note or r.mode == "dynamic"


def test_sdpa_attention_is_reported():
    r = evaluate_hf("llama", "sdpa", layers=LAYERS, dynamic=False, timing=False)
    assert max(r.errors.values()) < ATOL, r.errors
    assert r.unreported == ()
    assert set(ARCHS["llama"].must_fuse["sdpa"]) <= r.fused_ops(), str(r.report)


def test_the_transformers_mask_value_is_a_float32_literal():
    """transformers masks with finfo(float32).min; through sympy it came out a hair below
    -FLT_MAX and TVM refused the literal, skipping every attention softmax."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 32), "float32"))
    keep = relax.Var("keep", relax.TensorType((4, 32), "bool"))
    lowest = relax.const(np.finfo(np.float32).min, "float32")
    with bb.function("main", [x, keep]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.softmax(relax.op.where(keep, x, lowest)))
        bb.emit_func_output(y)
    executable, report = rr.build(bb.get())
    assert report.fused == 1, str(report)
    rng = np.random.default_rng(0)
    xv, kv = rng.normal(size=(4, 32)).astype(np.float32), rng.random((4, 32)) > 0.3
    w = np.where(kv, xv.astype(np.float64), -np.inf)
    ref = np.exp(w - w.max(1, keepdims=True))
    np.testing.assert_allclose(rr.run(executable, xv, kv), ref / ref.sum(1, keepdims=True),
                               rtol=2e-5, atol=2e-6)
