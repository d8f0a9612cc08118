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


def test_ambiguous_feature_axis_asks_for_a_declaration():
    rule = redfuser.derive("s = dot(q, k[i]); m = max(s); o = sum(exp(s - m) * v[i])")
    k = np.ones((1, 4, 4))
    with pytest.raises(ValueError, match=r"write v\[i, :\]"):
        rule.evaluate({"q": np.ones((1, 4)), "k": k, "v": np.ones((1, 4, 4))})


def test_topk_larger_than_the_stream():
    with pytest.raises(ValueError, match="k = 8 values of a stream of length N = 3"):
        redfuser.derive("moe_routing").evaluate({"x": np.ones((1, 3))})


def test_bad_chunks_and_trees():
    rule, x = redfuser.derive("softmax"), {"x": np.ones((1, 4))}
    with pytest.raises(ValueError, match="adding up to N = 4"):
        rule.evaluate(x, chunks=[2, 1])
    with pytest.raises(ValueError, match="each chunk number"):
        rule.evaluate(x, chunks=[2, 2], tree=(0, 0))
