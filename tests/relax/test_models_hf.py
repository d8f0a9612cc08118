"""Real transformers architectures (tiny configs, seeded random weights, nothing downloaded)
through the Relax pass, built and run at two sequence lengths against PyTorch; the pass's
report names every reduction of each model, and the cascades each architecture must fuse
are fused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from redfuser.examples.hf import ARCHS, LENGTHS, build_model, evaluate_hf, hf_table, model_inputs
from redfuser.relax import FuseCascadedReductions, build, run
from redfuser.tvm.graph import import_torch

# Hidden states of O(1) (each model ends in a norm), float32 on both sides: the fused
# kernels' polynomial exp (relative error 8.5e-8) and reassociated sums measured ~1e-6 per
# model; 1e-4 leaves room for other summation orders and still catches a wrong mask/scale.
ATOL = 1e-4
LAYERS = 1  # one block per model keeps this file's builds small; the CLI table uses 2


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_architecture_fused_end_to_end_at_two_lengths(name):
    # one symbolic-length build serves both lengths
    r = evaluate_hf(name, "eager", layers=LAYERS, timing=False)
    assert sorted(r.errors) == sorted(LENGTHS)
    assert max(r.errors.values()) < ATOL, (r.errors, str(r.report))
    assert r.unreported == (), f"reductions missing from the report: {r.unreported}"
    must = set(ARCHS[name].must_fuse["eager"])
    assert must <= r.fused_ops(), f"{sorted(must - r.fused_ops())} not fused:\n{r.report}"
    table = hf_table([r])
    assert all(line.split(": ", 1)[-1].splitlines()[0] in table for line in r.report.reasons())
    assert r.mode == "dynamic", r.note  # fused at a symbolic length: one build for both


def test_sdpa_export_is_fused_and_reported():
    r = evaluate_hf("llama", "sdpa", layers=LAYERS, dynamic=False, timing=False)
    assert max(r.errors.values()) < ATOL, r.errors
    assert r.unreported == ()
    assert set(ARCHS["llama"].must_fuse["sdpa"]) <= r.fused_ops(), str(r.report)


def test_gpt2_with_sdpa_exports_at_a_symbolic_length_and_fuses():
    """torch.export of GPT-2 with ``sdpa`` failed in transformers' Conv1D ("Cannot view a
    tensor with shape [2, s, 64] and strides (64, 128, 1)": the CPU flash backend's fake
    strides); ``import_torch`` traces under the math backend, whose graph holds the same SDPA
    op."""
    r = evaluate_hf("gpt2", "sdpa", layers=LAYERS, timing=False)
    assert r.mode == "dynamic", r.note
    assert max(r.errors.values()) < ATOL, (r.errors, str(r.report))
    assert r.unreported == ()
    assert set(ARCHS["gpt2"].must_fuse["sdpa"]) <= r.fused_ops(), str(r.report)


@pytest.mark.parametrize("name,folded", [("llama", 8), ("mixtral", 8), ("t5", 8), ("bert", 2),
                                         ("gpt2", 2)])
def test_bfloat16_models_fuse_as_many_cascades_as_in_float32(name, folded):
    """transformers' model in bfloat16 fuses as many cascades as in float32: the norms and
    the softmax with the cast to float32 before them folded into the kernel's loads
    (bfloat16 read, float32 inside) and the cast back after them into its stores
    (``folded`` casts fewer at least); a norm's output rounded to bfloat16, scaled and
    projected in bfloat16 (Llama's, Mixtral's) fused with its GEMM, computed in float32
    (``frag.computed``); BERT's LayerNorms on bfloat16 tensors (computed in float32, as
    torch does) fused with their output stored in bfloat16, and its linears import
    (``graph._linear``); GPT-2's GELU power imports (``graph._pow``: TVM cannot legalize a
    bfloat16 power), and BERT's and GPT-2's LayerNorms in float32 between casts
    (``graph._layer_norm``: nor a bfloat16 LayerNorm), so their unfused builds run too.
    The model's output agrees with torch's bfloat16 eager within two bfloat16 units in
    the last place of its scale, fused and unfused."""
    fuse32 = FuseCascadedReductions(check_build=False)
    fuse32(import_torch(build_model(name, "eager", LAYERS), model_inputs(name, LENGTHS[0])))
    model = build_model(name, "eager", LAYERS).to(torch.bfloat16)
    inputs = model_inputs(name, LENGTHS[0])
    imported = import_torch(model, inputs)
    fuse = FuseCascadedReductions()
    mod, report = fuse(imported), fuse.report
    assert report.fused == fuse32.report.fused, f"{report}\nfloat32:\n{fuse32.report}"
    casts = [str(m["main"]).count("R.astype") for m in (imported, mod)]
    assert casts[1] <= casts[0] - folded, casts
    assert "R.nn.layer_norm" not in str(mod["main"])  # TVM cannot legalize it in bfloat16
    with torch.no_grad():
        want = model(*inputs).float().numpy().astype(np.float64)
    # the fused module, and the unfused one (the baseline every speed-up is measured
    # against: a bfloat16 LayerNorm is imported in float32 between casts, ``graph._layer_norm``)
    for built in (mod, imported):
        got = run(build(built, fuse=False)[0], *(x.numpy() for x in inputs))
        got = np.asarray(got[0] if isinstance(got, list) else got).astype(np.float64)
        assert np.max(np.abs(got - want)) <= 2 * 2.0 ** -7 * np.abs(want).max()
