"""Score tiles (``lowering.cpu.scores``, ``lowering.cpu.score_tiles``): a dot product of a
per-row vector against a shared stream matrix computed as ``S = H W^T`` on the GEMM
micro-kernel, each row of S folded into the row's state.

Every kernel is checked against the float64 oracle ``redfuser.reference``: the policy's
plans, and blockings small enough that every tail shows (rows that fill no panel, K pieces
that do not divide D, tiles and micro-kernel groups that do not divide V, D not a multiple
of the lanes, V = 1, one row), with labels at the first and last vocabulary entries and
rows of large logits.

Tolerance: each logit is a float32 sum of D products, within about D * eps32 of the sum of
their magnitudes (blocked sums do no worse), and every output (m, lse, loss) is a logit or
one log of a sum of exps away from one: atol (2 D + 16) * eps32 * M with M the row's largest
sum of |h_k w_ck|, plus rtol ``KERNEL_TOL``.  An indexing error is off by O(M).
"""

from __future__ import annotations

import numpy as np
import pytest

import redfuser
from redfuser.lowering import choose, shape_geometry
from redfuser.lowering.cpu.plan import FOLD_LANES, CpuPlan
from redfuser.lowering.cpu.scores import ISA, score_blocks, score_dot
from tests.support import EPS32, KERNEL_TOL, assert_matches

SPEC = "linear_cross_entropy"
MR, NR = ISA.gemm_rows, ISA.gemm_vectors * ISA.lanes  # the host's micro-kernel
LARGE = 1e3  # a row of h scaled by this: logits of thousands, exp(s - m) underflows for most


def lce_inputs(rows: int, d: int, v: int, seed: int, large: bool = True) -> dict:
    """h ~ N(0, 1), w ~ N(0, 1/D); labels at the first and last vocabulary entries (and
    random); one row of h LARGE times bigger where there are several rows."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(rows, d))
    if large and rows > 1:
        h[rows // 2] *= LARGE
    label = rng.integers(0, v, rows)
    label[0], label[-1] = 0, v - 1
    return {"h": h.astype(np.float32),
            "w": (rng.normal(size=(v, d)) / np.sqrt(d)).astype(np.float32),
            "label": label.astype(np.float32)}


def check(out: dict, inputs: dict, what: str):
    ref = redfuser.reference(SPEC, inputs)
    h, w = inputs["h"].astype(np.float64), inputs["w"].astype(np.float64)
    magnitude = (np.abs(h) @ np.abs(w).T).max(axis=1)  # the largest |logit| terms of a row
    atol = (2 * h.shape[1] + 16) * EPS32 * magnitude
    assert list(out) == list(ref)
    for name in ref:
        assert_matches(out[name], ref[name], KERNEL_TOL, atol, f"{what} {name}")


def forced(kc: int, nc: int, mc: int) -> CpuPlan:
    """A score-tile plan with the host's micro-kernel and a small blocking."""
    return CpuPlan("rolling", FOLD_LANES, 1, True, "score tiles (test blocking)", mr=MR, nr=NR,
                   kc=kc, nc=nc, mc=mc, nt=1)


def test_the_plan_picks_score_tiles_at_the_bench_shape():
    """linear_cross_entropy at the bench shape (4096 x 2048 -> 32000) and at 512 x 2048 ->
    8000 gets score tiles with the host's micro-kernel, blocks sized by its caches, and says
    why; a small vocabulary that fits L1 and fewer rows than a panel do not."""
    rule = redfuser.derive(SPEC)
    for rows, d, v in ((4096, 2048, 32000), (512, 2048, 8000)):
        geo = shape_geometry(rule, {"h": (rows, d), "w": (v, d), "label": (rows,)})
        plan = choose(rule, geo, threads=2)
        assert (plan.mr, plan.nr) == (MR, NR) and plan.mc % NR == 0 and plan.kc <= d
        assert plan.lanes > 1 and "S = h w^T" in plan.reason, plan
        assert choose(rule, geo, "rolling", threads=2) == plan  # requested: the same
    few = shape_geometry(rule, {"h": (NR - 1, 2048), "w": (8000, 2048), "label": (NR - 1,)})
    tiny = shape_geometry(rule, {"h": (512, 4), "w": (8, 4), "label": (512,)})
    assert score_blocks(rule, few, 2) is None and score_blocks(rule, tiny, 2) is None
    assert choose(rule, few, threads=2).mr == 0


def test_kernel_plan_says_score_tiles_and_matches_the_oracle():
    """A bench-like shape through the public API: the kernel's plan names the score tile;
    rows in two blocks, the last one ragged, V in tiles with a ragged last one, D in K pieces
    with a ragged last one and not a multiple of the lanes."""
    rows, d, v = NR + 66, 600 + 3, 2100
    inputs = lce_inputs(rows, d, v, seed=1)
    kernel = redfuser.compile(SPEC)
    out = kernel(**inputs)
    assert kernel.plan.mr == MR and "S = h w^T" in kernel.plan.reason, kernel.plan
    assert v % kernel.plan.nc and d % kernel.plan.kc, "the shape must leave tails"
    check(out, inputs, str(kernel.plan))


@pytest.mark.parametrize("rows,d,v,kc,nc,mc", [
    (1, 5, 7, 2, 16, NR),  # one row, one panel mostly padding
    (5, 17, 1, 7, 16, NR),  # V = 1: one element, one micro-kernel group of repeated rows
    (NR + 3, 40, 100, 9, 48, NR),  # two row blocks, the second of 3 rows; ragged tiles
    (70, 1, 33, 1, 16, 2 * NR),  # D = 1; 33 elements: two tiles and one
    (9, 33, 2 * MR + 1, 33, 2 * MR + 1, NR),  # one K piece, one tile, a ragged micro group
])
def test_small_blockings_match_the_oracle(rows, d, v, kc, nc, mc):
    inputs = lce_inputs(rows, d, v, seed=rows * 1000 + v)
    plan = forced(kc, nc, mc)
    out = redfuser.compile(SPEC, plan=plan)(**inputs)
    check(out, inputs, f"{rows} x {d} -> {v}: {plan}")


def test_infinite_logits_match_the_oracle():
    """A row whose every logit is -inf (h has -inf at a feature where all of w is positive),
    one with +inf logits, and one with a NaN: the fold's special rows (its finalize folds
    them again) give what the reference gives."""
    inputs = lce_inputs(NR + 2, 24, 50, seed=7, large=False)
    inputs["w"][:, 3] = np.abs(inputs["w"][:, 3]) + 0.5
    inputs["h"][0, 3], inputs["h"][1, 3], inputs["h"][2, 5] = -np.inf, np.inf, np.nan
    plan = forced(8, 16, NR)
    out = redfuser.compile(SPEC, plan=plan)(**inputs)
    check(out, inputs, str(plan))


def test_attention_keeps_its_row_blocks():
    """Attention's dot against keys shared by the queries is found, but its D-vector sum
    folds in one lane: the plan keeps the row-block path (not measured faster as tiles)."""
    rule = redfuser.derive("attention")
    geo = shape_geometry(rule, {"q": (512, 64), "k": (1024, 64), "v": (1024, 64)})
    assert score_dot(rule, geo) is not None
    assert choose(rule, geo, threads=2).mr == 0
