"""Score products (``lowering.cpu.scores.score_product``, ``lowering.cpu.score_products``):
the backward of linear_cross_entropy, ``dh = sum_i f(dot(h, w[i, :])) w[i, :]`` (rows are
tokens) and ``dw`` (rows are vocabulary entries, the stream the tokens), as two GEMMs a tile
at a time: S on the micro-kernel, P = f(S), then P W.

Every kernel is checked against the float64 oracle ``redfuser.reference`` of the backward
rule's own spec: the policy's plans, and blockings small enough that every tail shows (rows
that fill no panel, K pieces that do not divide D, tiles and micro-kernel groups that do not
divide the stream, D not a multiple of the lanes, a stream of 1, one row), with labels at
the first and last vocabulary entries and a row of large logits.

Tolerance: a logit s is a float32 sum of D products, within (2 D + 16) eps32 M of the exact
one (M: the sum of |h_k w_ik|), so P = dloss (exp(s - m) / lse_sum - [i == label]) is
within |dloss| exp(s - m) / lse_sum of that times P's own rounding; each output is a sum of
P times a row of the stream matrix over the stream (N more roundings; a P under float32's
normal range may flush to zero).  The bound is that propagated entry by entry, plus rtol
``KERNEL_TOL``; an indexing error is off by O(|P w|).
"""

from __future__ import annotations

import numpy as np
import pytest

import redfuser
from redfuser.lowering import choose, shape_geometry
from redfuser.lowering.cpu.plan import CpuPlan
from redfuser.lowering.cpu.scores import ISA, score_product
from tests.support import EPS32, KERNEL_TOL, TINY32, assert_matches

BACKWARD = redfuser.derive("linear_cross_entropy").backward()
MR, NR = ISA.gemm_rows, ISA.gemm_vectors * ISA.lanes  # the host's micro-kernel
LARGE = 1e3  # a row of h scaled by this: logits of thousands, exp(s - m) underflows for most


def lce_backward_inputs(tokens: int, d: int, v: int, seed: int) -> dict:
    """h ~ N(0, 1) with one row LARGE times bigger, w ~ N(0, 1/D), labels at the first and
    last vocabulary entries, the forward's saved m and lse_sum in float64, dloss ~ N(0, 1),
    and ``at`` (each vocabulary entry's position: the columns kernel's rows)."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(tokens, d))
    h[tokens // 2] *= LARGE
    w = rng.normal(size=(v, d)) / np.sqrt(d)
    label = rng.integers(0, v, tokens)
    label[0], label[-1] = 0, v - 1
    s = h.astype(np.float32).astype(np.float64) @ w.astype(np.float32).astype(np.float64).T
    m = s.max(axis=1)
    values = {"h": h, "w": w, "label": label, "m": m,
              "lse_sum": np.exp(s - m[:, None]).sum(axis=1), "dloss": rng.normal(size=tokens),
              "at": np.arange(v)}
    return {k: np.ascontiguousarray(x, dtype=np.float32) for k, x in values.items()}


def bound(inputs: dict, name: str) -> np.ndarray:
    """The entrywise tolerance of ``name`` (dh or dw) described in the module docstring."""
    h, w = (inputs[k].astype(np.float64) for k in ("h", "w"))
    d, (tokens, v) = h.shape[1], (h.shape[0], w.shape[0])
    s = h @ w.T
    p = np.exp(s - inputs["m"][:, None]) / inputs["lse_sum"][:, None]
    p[np.arange(tokens), inputs["label"].astype(int)] += 1  # |P| <= its two terms
    p *= np.abs(inputs["dloss"])[:, None]
    rounding = (2 * d + 16) * EPS32 * (np.abs(h) @ np.abs(w).T) + (max(tokens, v) + 16) * EPS32
    weighted = p * rounding + TINY32  # a P below float32's normal range may flush to 0
    return weighted @ np.abs(w) if name == "dh" else weighted.T @ np.abs(h)


def check(out: dict, inputs: dict, name: str, what: str):
    spec = BACKWARD.spec if name == "dh" else BACKWARD.columns
    ref = redfuser.reference(spec, arguments(name, inputs))
    assert list(out) == [name] == list(ref)
    assert_matches(out[name], ref[name], KERNEL_TOL, bound(inputs, name), f"{what} {name}")


def run(name: str, inputs: dict, plan: CpuPlan | None = None):
    """The dh kernel (rows: tokens) or the dw kernel (rows: vocabulary entries) on
    ``inputs``, with the policy's plan or ``plan``."""
    spec = BACKWARD.spec if name == "dh" else BACKWARD.columns
    kernel = redfuser.compile(spec, plan=plan) if plan else redfuser.compile(spec)
    return kernel, kernel(**arguments(name, inputs))


def arguments(name: str, inputs: dict) -> dict:
    """The inputs a kernel reads: dh has no ``at`` (its rows are the tokens)."""
    return dict(inputs) if name == "dw" else {k: x for k, x in inputs.items() if k != "at"}


def geometry(name: str, tokens: int, d: int, v: int):
    rule = redfuser.derive(BACKWARD.spec if name == "dh" else BACKWARD.columns)
    shapes = {"h": (tokens, d), "w": (v, d), "label": (tokens,), "m": (tokens,),
              "lse_sum": (tokens,), "dloss": (tokens,)}
    return rule, shape_geometry(rule, shapes if name == "dh" else {**shapes, "at": (v,)})


@pytest.mark.parametrize("name", ["dh", "dw"])
def test_the_plan_picks_score_products_at_the_bench_shape(name):
    """Both backward kernels at 512 x 2048 -> 8000 get score products with the host's
    micro-kernel and say why; fewer rows than a panel fall back to the one-lane path."""
    rule, geo = geometry(name, 512, 2048, 8000)
    plan = choose(rule, geo, threads=2)
    assert (plan.mr, plan.nr) == (MR, NR) and plan.mc % NR == 0, plan
    assert f"{name} += f(S)" in plan.reason, plan
    few = geometry(name, NR - 1, 2048, 8000) if name == "dh" else geometry(name, 512, 2048,
                                                                             NR - 1)
    assert choose(few[0], few[1], threads=2).mr == 0


def test_only_a_factor_of_the_dot_times_its_stream_matrix_is_a_score_product():
    """The forward (a max and sums of the dot), attention (a re-anchored D-vector sum) and
    RMSNorm + GEMM (no dot) are refused: their plans stay as they were."""
    lce = redfuser.derive("linear_cross_entropy")
    att = redfuser.derive("attention")
    rms = redfuser.derive("rmsnorm_gemm")
    for rule, shapes in ((lce, {"h": (512, 2048), "w": (8000, 2048), "label": (512,)}),
                         (att, {"q": (512, 64), "k": (1024, 64), "v": (1024, 64)}),
                         (rms, {"x": (256, 512), "w": (512, 512)})):
        geo = shape_geometry(rule, shapes)
        assert score_product(rule, geo) is None
        assert "f(S)" not in choose(rule, geo, threads=2).reason


@pytest.mark.parametrize("name", ["dh", "dw"])
def test_kernel_plan_says_score_products_and_matches_the_oracle(name):
    """A bench-like shape through the public API: rows in two blocks, the last ragged; the
    stream in tiles with a ragged last one; D in K pieces with a ragged last one and not a
    multiple of the lanes."""
    tokens, d, v = (NR + 66, 600 + 3, 2100) if name == "dh" else (1100, 600 + 3, NR + 66)
    inputs = lce_backward_inputs(tokens, d, v, seed=1)
    kernel, out = run(name, inputs)
    assert kernel.plan.mr == MR and "f(S)" in kernel.plan.reason, kernel.plan
    n = v if name == "dh" else tokens
    assert n % kernel.plan.nc and d % kernel.plan.kc, "the shape must leave tails"
    check(out, inputs, name, str(kernel.plan))


@pytest.mark.parametrize("name", ["dh", "dw"])
@pytest.mark.parametrize("rows,d,n,kc,nc,mc", [
    (1, 5, 7, 2, 16, NR),  # one row, one panel mostly padding
    (5, 17, 1, 7, 16, NR),  # a stream of 1: one element, one micro-kernel group
    (NR + 3, 40, 100, 9, 48, NR),  # two row blocks, the second of 3 rows; ragged tiles
    (70, 1, 33, 1, 16, 2 * NR),  # D = 1; 33 elements: two tiles and one
    (9, 33, 2 * MR + 1, 33, 2 * MR + 1, NR),  # one K piece, one tile, a ragged micro group
    (3, 2 * NR + 5, 20, 64, 8, NR),  # sums of three panels, the last past D
])
def test_small_blockings_match_the_oracle(name, rows, d, n, kc, nc, mc):
    """Forced blockings of the host's micro-kernel: ``rows`` are the kernel's rows and ``n``
    its stream (tokens and vocabulary for dh, the other way round for dw)."""
    tokens, v = (rows, n) if name == "dh" else (n, rows)
    inputs = lce_backward_inputs(tokens, d, v, seed=rows * 1000 + n)
    plan = CpuPlan("rolling", 1, 1, True, "score products (test blocking)", mr=MR, nr=NR,
                   kc=kc, nc=nc, mc=mc, nt=1)
    kernel, out = run(name, inputs, plan)
    check(out, inputs, name, f"{rows} x {d} -> {n}: {plan}")


@pytest.mark.parametrize("name", ["dh", "dw"])
def test_before_and_after_agree_on_the_one_lane_path(name):
    """The one-lane row-block path the kernels ran before gives the same gradients (a
    stream of 1 and one row fall back to it: its results are checked here too)."""
    inputs = lce_backward_inputs(NR + 5, 48, 300, seed=3)
    old = CpuPlan("rolling", 1, 1, True, "one lane", tile=32, row_block=8)
    check(run(name, inputs, old)[1], inputs, name, "one lane")
    for tokens, v in ((1, 300), (NR + 5, 1)):
        small = lce_backward_inputs(tokens, 48, v, seed=4)
        kernel, out = run(name, small)
        check(out, small, name, str(kernel.plan))
