"""The array convention: shapes, broadcasting and clear errors for bad inputs."""

import numpy as np
import pytest

import redfuser


def test_kv_broadcast_over_queries_and_output_shapes():
    rule = redfuser.derive("attention")
    q = np.ones((2, 3, 4), np.float32)
    kv = np.ones((2, 1, 5, 4), np.float32)
    out = rule.evaluate({"q": q, "k": kv, "v": kv, "scale": 1.0})
    assert out["o"].shape == (2, 3, 4) and out["m"].shape == (2, 3)
    assert out["o"].dtype == np.float32


def test_per_element_and_topk_shapes():
    x = np.zeros((2, 3, 9), np.float32)
    assert redfuser.derive("softmax").evaluate({"x": x})["y"].shape == (2, 3, 9)
    out = redfuser.derive("moe_routing").evaluate({"x": x})
    assert out["p"].shape == (2, 3, 8) and out["e"].dtype == np.int64


@pytest.mark.parametrize(("inputs", "words"), [
    ({}, "missing input(s) ['x']"),
    ({"x": np.ones((2, 4)), "z": 1.0}, "unexpected input(s) ['z']"),
    ({"x": "abc"}, "must be a number or an array"),
    ({"x": np.ones(3, dtype=complex)}, "expected a real number type"),
])
def test_bad_inputs_name_the_input(inputs, words):
    with pytest.raises((ValueError, TypeError)) as err:
        redfuser.derive("softmax").evaluate(inputs)
    assert words in str(err.value)


def test_wrong_stream_length_and_row_mismatch():
    rule = redfuser.derive("m = max(x[i]); s = sum(exp(x[i] - m) * v[i])")
    with pytest.raises(ValueError, match=r"input 'v' has shape \(2, 5\); expected \(\*rows, 4\)"):
        rule.evaluate({"x": np.ones((2, 4)), "v": np.ones((2, 5))})
    with pytest.raises(ValueError, match="row axes do not broadcast"):
        rule.evaluate({"x": np.ones((2, 4)), "v": np.ones((3, 4))})


def test_undeclared_stream_reads_scalar_unless_rows_say_otherwise():
    # x (3, 3) with w[i, :] (3, 3): x is (*rows, N) as documented, not an (N, D) matrix
    out = redfuser.derive("rmsnorm_gemm").evaluate(
        {"x": np.ones((3, 3)), "w": np.ones((3, 3)), "eps": 0.0})
    assert out["y"].shape == (3, 3) and out["r"].shape == (3,)
    # v (1, 4, 4) next to q (1, 4) and k (1, 4, 4) with N == D == 4: read as (*rows, N, D),
    # since reading it as (*rows, N) would give it more row axes than q has
    rule = redfuser.derive("s = dot(q, k[i]); m = max(s); o = sum(exp(s - m) * v[i])")
    out = rule.evaluate({"q": np.ones((1, 4)), "k": np.ones((1, 4, 4)), "v": np.ones((1, 4, 4))})
    assert out["o"].shape == (1, 4)


def test_topk_larger_than_the_stream():
    with pytest.raises(ValueError, match="k = 8 values of a stream of length N = 3"):
        redfuser.derive("moe_routing").evaluate({"x": np.ones((1, 3))})


def test_bad_chunks_and_trees():
    rule, x = redfuser.derive("softmax"), {"x": np.ones((1, 4))}
    with pytest.raises(ValueError, match="adding up to N = 4"):
        rule.evaluate(x, chunks=[2, 1])
    with pytest.raises(ValueError, match="each chunk number"):
        rule.evaluate(x, chunks=[2, 2], tree=(0, 0))
