"""Small real models, fused end to end: GPT-2 and Llama decoder blocks, a Mixtral router,
then real transformers architectures (``hf.py``).

Each model is built in code with seeded random weights (nothing is downloaded), exported
with ``torch.export``, imported with TVM's own importer and compiled for this CPU twice
through the same pipeline (``redfuser.relax.cpu_pipeline``): without and with
``FuseCascadedReductions``.  ``python -m redfuser.examples.models`` prints, per model, the
cascades found, fused and skipped (with reasons), the largest error against PyTorch, and
the median run time of both builds.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..relax import build, run
from ..tvm.graph import import_torch, relax_tensor, relax_vm
from ..tvm.target import cpu_target, device
from . import hf


class GPT2Block(nn.Module):
    """A GPT-2 decoder block: LayerNorm, causal multi-head attention written out as
    matmul -> masked_fill(-inf) -> softmax -> matmul, LayerNorm, GELU MLP."""

    def __init__(self, d: int = 64, heads: int = 4, seq: int = 32):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class RMSNorm(nn.Module):
    """Llama's RMSNorm, written out as the reference implementation does."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    """A Llama decoder block: RMSNorm, rotary embeddings, grouped-query attention (K/V
    heads repeated with repeat_interleave) with an additive causal mask, SwiGLU MLP."""

    def __init__(self, d: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128,
                 seq: int = 32):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm_1, self.norm_2 = RMSNorm(d), RMSNorm(d)
        self.wq, self.wo = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.w1, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)
        inv = 1.0 / 10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)
        angles = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos())
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin())
        self.register_buffer("mask", torch.full((seq, seq), float("-inf")).triu(1))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        cos, sin = self.cos[:t], self.sin[:t]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.hd) + self.mask[:t, :t]
        y = torch.softmax(scores, dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.norm_1(x))
        z = self.norm_2(h)
        return h + self.w2(F.silu(self.w1(z)) * self.w3(z))


class MixtralRouter(nn.Module):
    """Mixtral's MoE routing: RMSNorm, gate, softmax over experts, top-2, renormalise."""

    def __init__(self, d: int = 64, experts: int = 8, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.norm = RMSNorm(d, eps=1e-5)
        self.gate = nn.Linear(d, experts, bias=False)

    def forward(self, x: torch.Tensor):
        logits = self.gate(self.norm(x))
        weights, experts = torch.topk(F.softmax(logits, dim=-1), self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), experts


@dataclass(frozen=True)
class Example:
    """A model, its example input, and how many cascades it contains (stated by hand)."""

    name: str
    model: nn.Module
    inputs: tuple
    cascades: int
    contents: str


def examples(seed: int = 0, batch: int = 2, seq: int = 32) -> list[Example]:
    """The three models with seeded random weights and inputs.

    Examples
    --------
    >>> [(e.name, e.cascades) for e in examples()]
    [('gpt2_block', 3), ('llama_block', 4), ('mixtral_router', 3)]
    """
    torch.manual_seed(seed)
    out = []
    for name, model, x, count, contents in (
        ("gpt2_block", GPT2Block(seq=seq), torch.randn(batch, seq, 64), 3,
         "ln_1 + c_attn, causal attention, ln_2 + c_fc"),
        ("llama_block", LlamaBlock(seq=seq), torch.randn(batch, seq, 64), 4,
         "norm_1 + wq, norm_1 + wk + wv, causal GQA attention, norm_2 + w1 + w3"),
        ("mixtral_router", MixtralRouter(), torch.randn(batch * seq, 64), 3,
         "norm + gate, softmax + top-2, renormalisation"),
    ):
        out.append(Example(name, model.eval(), (x,), count, contents))
    return out


@dataclass(frozen=True)
class Result:
    name: str
    report: object
    max_error: float
    unfused_ms: float | None
    fused_ms: float | None


def evaluate(example: Example, timing: bool = True, repeat: int = 20) -> Result:
    """Export, import, build with and without the pass, compare with PyTorch, time both."""
    mod = import_torch(example.model, example.inputs)
    fused, report = build(mod, fuse=True)
    arrays = [x.numpy() for x in example.inputs]
    with torch.no_grad():
        expected = example.model(*example.inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = run(fused, *arrays)
    error = max(float(np.max(np.abs(np.asarray(g, np.float64) - e.numpy().astype(np.float64))))
                for g, e in zip(got, expected, strict=True))
    times = (None, None)
    if timing:
        unfused, _ = build(mod, fuse=False)
        times = tuple(_median_ms(ex, arrays, repeat) for ex in (unfused, fused))
    return Result(example.name, report, error, *times)


def _median_ms(executable, arrays, repeat: int) -> float:
    vm = relax_vm(executable)
    timer = vm.time_evaluator("main", device(cpu_target()), number=5, repeat=repeat)
    return float(timer(*[relax_tensor(a) for a in arrays]).median) * 1e3


def table(results: list[Result]) -> str:
    """The per-model summary, then every cascade with its ops and outcome."""
    head = (f"{'model':16s} {'found':>5s} {'fused':>5s} {'skipped':>7s} {'max |err|':>10s} "
            f"{'unfused ms':>10s} {'fused ms':>9s}")
    lines = [head, "-" * len(head)]
    for r in results:
        def ms(t):
            return f"{t:10.3f}" if t is not None else f"{'-':>10s}"

        lines.append(f"{r.name:16s} {r.report.found:5d} {r.report.fused:5d} "
                     f"{r.report.skipped:7d} {r.max_error:10.2e} {ms(r.unfused_ms)} "
                     f"{ms(r.fused_ms)[1:]}")
    for r in results:
        lines += ["", f"{r.name}: {r.report}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m redfuser.examples.models",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--no-time", action="store_true", help="skip the timing runs")
    parser.add_argument("--repeat", type=int, default=20, help="timing repeats (median)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length")
    parser.add_argument("--hf", default=",".join(hf.ARCHS),
                        help="transformers architectures for the second table ('' for none)")
    parser.add_argument("--attn", default=",".join(hf.ATTENTION),
                        help="attn_implementation values for the transformers models")
    parser.add_argument("--layers", type=int, default=2, help="transformers layers")
    parser.add_argument("--dtype", default="float32",
                        help="the transformers models' dtypes, e.g. float32,bfloat16,float16")
    args = parser.parse_args(argv)
    results = [evaluate(e, timing=not args.no_time, repeat=args.repeat)
               for e in examples(seq=args.seq)]
    print(table(results))
    print("\nTimes: medians of the Relax VM on this CPU, both builds through "
          "redfuser.relax.cpu_pipeline (legalize, FuseOps/FuseTIR, dlight CPU rules).")
    names = [n for n in args.hf.split(",") if n]
    if names:
        print(f"\ntransformers {hf.transformers.__version__} models ({args.layers} layers, hidden "
              f"{hf.HIDDEN}, {hf.HEADS} heads, vocab {hf.VOCAB}, batch {hf.BATCH}); max |err| "
              "against PyTorch at each length, times at the first:")
        print(hf.hf_table([r for dtype in args.dtype.split(",") for r in hf.evaluate_all(
            names, args.attn.split(","), layers=args.layers, timing=not args.no_time,
            dtype=dtype)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
