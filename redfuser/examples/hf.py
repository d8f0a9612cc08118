"""Real transformers architectures through the Relax pass, built from small configs.

GPT-2, Llama (grouped-query attention), Mixtral (MoE router: softmax + top-k), BERT (an
encoder with a padding mask) and T5's encoder (RMSNorm without the mean, relative position
bias), each with ``attn_implementation`` "eager" and "sdpa".  Every model comes from its
config with seeded random weights (``from_config``; nothing is downloaded).  Each is
exported with a symbolic sequence length (``torch.export.Dim``); where the pass fuses fewer
cascades in that module than in a static export (the pass builds kernels per static
shape today), the model is exported again at each length instead, and the result says so.
Both builds go through ``redfuser.relax.cpu_pipeline``, without and with the pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers
from torch import nn

from ..relax import FuseCascadedReductions, FuseReport, build, run
from ..tvm.graph import import_torch, relax, relax_tensor, relax_vm
from ..tvm.target import cpu_target, device

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN = 128, 64, 4, 2, 128  # the brief's tiny configs
MAX_SEQ = 64  # position tables and the symbolic length's upper bound
LENGTHS = (16, 24)  # two sequence lengths per model
BATCH, PADDED = 2, 3  # encoders: the second sequence ends in PADDED padding tokens
ATTENTION = ("eager", "sdpa")
# Every Relax op that reduces along an axis: the pass's report must name each one it meets,
# fused or skipped with a reason (a scan such as cumsum is not a reduction)
REDUCTION_OPS = frozenset(f"relax.{op}" for op in (
    "nn.softmax", "nn.log_softmax", "nn.layer_norm", "nn.rms_norm", "nn.group_norm",
    "nn.instance_norm", "nn.batch_norm", "nn.attention", "nn.attention_bias", "sum", "mean",
    "max", "min", "prod", "variance", "std", "argmax", "argmin", "topk"))
_DECODER = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_SEQ,
                bos_token_id=0, eos_token_id=0, pad_token_id=0)


@dataclass(frozen=True)
class Arch:
    """One architecture: its config, the model class, whether its input is padded, and the
    op kinds whose cascades must fuse (per attention implementation)."""

    name: str
    config: type
    model: type
    options: dict
    padded: bool
    must_fuse: dict = field(default_factory=dict)
    contents: str = ""

    def layers_option(self, layers: int) -> dict:
        key = "n_layer" if self.name == "gpt2" else "num_layers" if self.name == "t5" \
            else "num_hidden_layers"
        return {key: layers}


ARCHS = {a.name: a for a in (
    Arch("gpt2", transformers.GPT2Config, transformers.GPT2Model,
         dict(n_embd=HIDDEN, n_head=HEADS, n_positions=MAX_SEQ, bos_token_id=0,
              eos_token_id=0), False,
         {"eager": ("layer_norm", "softmax"), "sdpa": ("layer_norm",)},
         "LayerNorm, causal attention, GELU MLP"),
    Arch("llama", transformers.LlamaConfig, transformers.LlamaModel, _DECODER, False,
         {"eager": ("mean", "softmax"), "sdpa": ("mean",)},
         "RMSNorm + projections, rotary GQA attention (2 K/V heads for 4), SwiGLU"),
    Arch("mixtral", transformers.MixtralConfig, transformers.MixtralModel,
         # batched_mm: the default grouped_mm path calls grouped_mm_fallback and histc,
         # which TVM's importer does not know
         dict(_DECODER, num_local_experts=4, num_experts_per_tok=2,
              experts_implementation="batched_mm"), False,
         {"eager": ("mean", "softmax", "topk"), "sdpa": ("mean",)},
         "as Llama, with an MoE of 4 experts: router softmax + top-2"),
    Arch("bert", transformers.BertConfig, transformers.BertModel,
         dict(hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=FFN,
              max_position_embeddings=MAX_SEQ, pad_token_id=0), True,
         # each post-LN LayerNorm reads the previous one's output back (Lifter.
         # recomputed_reads); the token-type gather is not lifted
         {"eager": ("layer_norm", "softmax"), "sdpa": ("layer_norm", "softmax")},
         "post-LN encoder, attention with a padding mask"),
    Arch("t5", transformers.T5Config, transformers.T5EncoderModel,
         dict(d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_heads=HEADS, pad_token_id=0,
              eos_token_id=0, decoder_start_token_id=0), True,
         {"eager": ("mean", "softmax"), "sdpa": ("mean",)},
         "encoder: RMSNorm without the mean, relative position bias, padding mask"),
)}


class LastHidden(nn.Module):
    """(input_ids, attention_mask) -> last_hidden_state: one tensor in the exported graph."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def build_model(name: str, attn: str = "eager", layers: int = 2, seed: int = 0) -> LastHidden:
    """The architecture ``name`` from its small config with seeded random weights.

    Examples
    --------
    >>> m = build_model("llama", layers=1)
    >>> m.model.config.num_key_value_heads < m.model.config.num_attention_heads
    True
    """
    arch = ARCHS[name]
    config = arch.config(vocab_size=VOCAB, attn_implementation=attn, use_cache=False,
                         **arch.options, **arch.layers_option(layers))
    torch.manual_seed(seed)
    return LastHidden(arch.model._from_config(config, attn_implementation=attn)).eval()


def model_inputs(name: str, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of BATCH sequences; encoders pad the second one."""
    gen = torch.Generator().manual_seed(seed + seq)
    ids = torch.randint(1, VOCAB, (BATCH, seq), generator=gen)
    mask = torch.ones(BATCH, seq, dtype=torch.int64)
    if ARCHS[name].padded:
        mask[1, -PADDED:] = 0
        ids[1, -PADDED:] = 0
    return ids, mask


@dataclass(frozen=True)
class HFResult:
    """One model: how it was exported (``mode``, ``note``), the pass's report (at the first
    length for a static export), the max error against PyTorch per length, both run times
    (ms, at the first length; None without timing)."""

    name: str
    attn: str
    mode: str
    note: str
    report: object
    errors: dict
    unreported: tuple = ()  # reduction bindings of the module its report does not name
    unfused_ms: float | None = None
    fused_ms: float | None = None
    seconds: float = 0.0
    dtype: str = "float32"  # the model's parameters and activations

    @property
    def label(self) -> str:
        return f"{self.name}/{self.attn}" + ("" if self.dtype == "float32" else
                                             f"/{self.dtype}")

    def fused_ops(self) -> set[str]:
        """The op kinds ("softmax", "mean", ...) of every fused cascade."""
        return {op.split()[0] for g in self.report.groups if g.fused for op in g.ops}


def evaluate_hf(name: str, attn: str = "eager", lengths=LENGTHS, layers: int = 2,
                dynamic: bool = True, timing: bool = True, repeat: int = 10,
                dtype: str = "float32") -> HFResult:
    """Export (symbolic length first when ``dynamic``), fuse, build, run at ``lengths``;
    ``dtype``: the model's (``torch_dtype``), its error against torch's eager in it."""
    start = time.perf_counter()
    model = build_model(name, attn, layers).to(getattr(torch, dtype))
    # the static pass as a yardstick: a symbolic build must fuse as much (its kernels are
    # compiled only if the static export is the one built)
    static = _fuse(import_torch(model, model_inputs(name, lengths[0])), check_build=not dynamic)
    mode, note, chosen = "static", "static export at each length", static
    if dynamic:
        symbolic, why = _try_dynamic(model, name, lengths[0])
        if symbolic is not None and symbolic.report.fused >= static.report.fused:
            mode, note, chosen = "dynamic", "one symbolic-length build", symbolic
        else:
            note = f"{why}; static export at each length"
            chosen = _fuse(static.imported)
    executable, errors, times = build(chosen.module, fuse=False)[0], {}, ()
    for seq in lengths:
        if mode == "static" and seq != lengths[0]:  # a build per length
            executable = build(_fuse(import_torch(model, model_inputs(name, seq))).module,
                               fuse=False)[0]
        errors[seq] = _max_error(model, executable, model_inputs(name, seq))
        if timing and seq == lengths[0]:
            times = _times(model, name, seq, mode == "dynamic", executable, repeat)
    missing = tuple(b for b in reduction_bindings(chosen.imported)
                    if b not in named(chosen.report))
    return HFResult(name, attn, mode, note, chosen.report, errors, missing, *times,
                    seconds=time.perf_counter() - start, dtype=dtype)


def reduction_bindings(mod) -> list[str]:
    """"op var" for every binding of ``main`` that calls a reduction op (REDUCTION_OPS)."""
    out = []
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            op = getattr(getattr(b.value, "op", None), "name", None)
            if isinstance(b.value, relax.Call) and op in REDUCTION_OPS:
                out.append(f"{op.removeprefix('relax.').removeprefix('nn.')} {b.var.name}")
    return out


def named(report) -> set[str]:
    """Every "op var" a report's groups name."""
    return {op for g in report.groups for op in g.ops}


@dataclass(frozen=True)
class _Fused:
    imported: object  # the Relax module as imported
    module: object  # after the pass
    report: object


def _fuse(mod, check_build: bool = True) -> _Fused:
    """The pass alone (the builds take its result, so each kernel is compiled once)."""
    fuse = FuseCascadedReductions(check_build)
    return _Fused(mod, fuse(mod), fuse.report)


def _try_dynamic(model, name: str, seq: int):
    """(_Fused, what it fused) for the symbolic-length export, or (None, why not)."""
    try:
        fused = _fuse(import_torch(model, model_inputs(name, seq), _dynamic_shapes()))
    except Exception as e:  # noqa: BLE001 - any export/import failure is reported, not raised
        return None, f"symbolic length: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return fused, (f"symbolic length: {fused.report.fused} of {fused.report.found} "
                   "cascades fused")


def _max_error(model, executable, inputs) -> float:
    with torch.no_grad():
        expected = model(*inputs).float().numpy().astype(np.float64)
    got = run(executable, *(x.numpy() for x in inputs))
    got = got[0] if isinstance(got, list) else got
    return float(np.max(np.abs(np.asarray(got, np.float64) - expected)))


def _times(model, name: str, seq: int, symbolic: bool, executable,
           repeat: int) -> tuple[float | None, float]:
    """Median ms of the unfused build (the same export, without the pass; None where TVM
    cannot build it: a bfloat16 LayerNorm) and the fused one."""
    inputs = model_inputs(name, seq)
    mod = import_torch(model, inputs, _dynamic_shapes() if symbolic else None)
    arrays = [relax_tensor(x.numpy()) for x in inputs]
    try:
        unfused = _median_ms(build(mod, fuse=False)[0], arrays, repeat)
    except Exception:  # noqa: BLE001 - TVM's own errors: the row says the build failed
        unfused = None
    return unfused, _median_ms(executable, arrays, repeat)


def _dynamic_shapes() -> dict:
    length = torch.export.Dim("seq", min=2, max=MAX_SEQ)
    return {"input_ids": {1: length}, "attention_mask": {1: length}}


def _median_ms(executable, arrays, repeat: int) -> float:
    vm = relax_vm(executable)
    timer = vm.time_evaluator("main", device(cpu_target()), number=3, repeat=repeat)
    return float(timer(*arrays).median) * 1e3


def hf_table(results: list[HFResult]) -> str:
    """The per-model summary (found / fused / skipped, error per length, times), then every
    cascade still skipped with its reason."""
    errs = "  ".join(f"err@{n:<4d}" for n in LENGTHS)
    head = (f"{'model':14s} {'export':8s} {'found':>5s} {'fused':>5s} {'skip':>4s}  {errs}"
            f" {'unfused ms':>10s} {'fused ms':>8s}")
    lines = [head, "-" * len(head)]
    for r in results:
        e = "  ".join(f"{r.errors.get(n, float('nan')):8.1e}" for n in LENGTHS)
        timed = r.fused_ms is not None  # untimed: neither; timed: the unfused may not build
        t = f"{_ms(r.unfused_ms, 'no build' if timed else '-'):>10s} {_ms(r.fused_ms, '-'):>8s}"
        lines.append(f"{r.label:14s} {r.mode:8s} {r.report.found:5d} {r.report.fused:5d} "
                     f"{r.report.skipped:4d}  {e} {t}")
    lines += ["", "Export notes and cascades still skipped:"]
    for r in results:
        lines.append(f"  {r.label}: {r.note}")
        lines += [f"    skipped {reason}" for reason in _distinct(r.report.reasons())]
    return "\n".join(lines)


def _ms(value: float | None, missing: str) -> str:
    return missing if value is None else f"{value:.3f}"


def _distinct(reasons: list[str]) -> list[str]:
    """Each reason once, with how many cascades it stopped (layers repeat them)."""
    counts: dict[str, int] = {}
    for line in reasons:
        why = line.split(": ", 1)[-1].splitlines()[0]
        counts[why] = counts.get(why, 0) + 1
    return [f"x{n}: {why}" for why, n in counts.items()]


def evaluate_all(names=tuple(ARCHS), attns=ATTENTION, **options) -> list[HFResult]:
    """``evaluate_hf`` for every architecture and attention implementation; a model whose
    export, import or build fails gets a "failed" row with the error instead."""
    out = []
    for name in names:
        for attn in attns:
            try:
                out.append(evaluate_hf(name, attn, **options))
            except Exception as e:  # noqa: BLE001 - one model's failure is its row, not the run's
                why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
                out.append(HFResult(name, attn, "failed", why, FuseReport(), {},
                                    dtype=options.get("dtype", "float32")))
    return out
