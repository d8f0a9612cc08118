"""Symbolic shapes: one kernel for every row count and stream length (``dynamic=True``).

Each kernel is built once and called at N in {0, 1, 7, 64, 333} and several row counts;
every output is compared with the float64 oracle (``redfuser.reference``).  Tolerances:
RTOL 2e-5 / ATOL 1e-5 as in test_kernel_edges (float32 sums of up to 333 terms, fast exp
at 8.5e-8), attention's ATOL scaled by D (its output is a sum of D-wide products).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_matches

import redfuser
from redfuser.lowering import shape_geometry
from redfuser.lowering.geometry import dynamic_key, fits

RTOL, ATOL = 2e-5, 1e-5
LENGTHS = (0, 1, 7, 64, 333)
ROWS = ((3,), (1,), (5,), (2,), (4,))  # one per length: several row counts, one build
rng = np.random.default_rng(13)


def check(kernel, name: str, inputs: dict, atol: float = ATOL) -> None:
    out, ref = kernel(**inputs), redfuser.reference(name, inputs)
    assert list(out) == list(ref)
    shapes = {k: np.shape(v) for k, v in inputs.items()}
    for k, r in ref.items():
        assert_matches(out[k], r, RTOL, atol, f"{name} {k} at {shapes}")


def stream(rows: tuple, n: int) -> np.ndarray:
    return rng.normal(size=(*rows, n)).astype(np.float32) * 3


@pytest.mark.parametrize("name", ["softmax", "variance", "log_softmax"])
def test_one_build_serves_every_row_count_and_length(name):
    kernel = redfuser.compile(name, dynamic=True)
    for rows, n in zip(ROWS, LENGTHS, strict=True):
        check(kernel, name, {"x": stream(rows, n)})
    assert kernel.builds == 1
    assert "dynamic shapes" in str(kernel.plan)


def test_layernorm_weights_broadcast_over_any_rows():
    """g and b are streams shared by every row (broadcast row axis) next to x (rows, N)."""
    kernel = redfuser.compile("layernorm", dynamic=True)
    for rows, n in zip(((2, 3), (1, 1), (4, 1), (1, 5)), (5, 1, 64, 333), strict=True):
        x = stream(rows, n)
        check(kernel, "layernorm", {"x": x, "g": stream((), n), "b": stream((), n), "eps": 1e-5})
    assert kernel.builds == 1


def test_attention_one_build_for_heads_queries_and_keys():
    """A stream with a feature axis: K/V (H, 1, N, D) broadcast over the L queries of a
    head; L = 1 (decode) runs on the kernel built for L > 1 (``geometry.fits``)."""
    kernel, d = redfuser.compile("attention", dynamic=True), 16
    for (h, queries), n in zip(((2, 4), (2, 1), (3, 5), (1, 1), (2, 3)), LENGTHS, strict=True):
        q = rng.normal(size=(h, queries, d)).astype(np.float32)
        k, v = (rng.normal(size=(h, 1, n, d)).astype(np.float32) for _ in "kv")
        check(kernel, "attention", {"q": q, "k": k, "v": v, "scale": 0.25}, ATOL * d)
    assert kernel.builds == 1


def test_special_values_and_the_unfused_baseline():
    """-inf rows, a NaN, huge magnitudes and ties, fused and unfused, both dynamic."""
    x = stream((4,), 77)
    x[0] = -np.inf
    x[1, 5] = np.nan
    x[2] *= 1e30
    x[3] = 2.0
    for variant in ("rolling", "unfused"):
        kernel = redfuser.compile("softmax", dynamic=True, variant=variant)
        check(kernel, "softmax", {"x": x})
        check(kernel, "softmax", {"x": x[:, :3]})
        assert kernel.builds == 1 and kernel.plan.variant == variant


def test_new_broadcast_pattern_is_a_second_build_and_old_ones_stay():
    rule = redfuser.derive("attention")

    def geo(queries):
        kv = (2, 1, 9, 8)
        return shape_geometry(rule, {"q": (2, queries, 8), "k": kv, "v": kv})

    assert fits(dynamic_key(rule, geo(3)), rule, geo(1))
    assert not fits(dynamic_key(rule, geo(1)), rule, geo(3))
    kernel = redfuser.compile("attention", dynamic=True)
    def args(queries):
        return {"q": np.ones((2, queries, 8), np.float32), "scale": 1.0,
                **{s: np.ones((2, 1, 9, 8), np.float32) for s in "kv"}}

    kernel(**args(1))
    kernel(**args(3))  # K/V now broadcast over the queries: another kernel
    kernel(**args(1))
    kernel(**args(6))
    assert kernel.builds == 2


@pytest.mark.parametrize(("options", "message"), [
    ({"splits": 2}, "splits"), ({"variant": "split"}, "split"), ({"tune": True}, "tune"),
    ({"target": "cuda"}, "CPU"), ({"dynamic": "yes"}, "dynamic")])
def test_options_a_dynamic_kernel_cannot_honour_are_refused(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        redfuser.compile("softmax", **{"dynamic": True, **options})(x=stream((2,), 8))
