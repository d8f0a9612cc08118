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


# -- inputs that disagree with each other (kernels and evaluate share this check) ------------

X = np.ones((4, 16), np.float32)


@pytest.mark.parametrize("T, words", [
    (np.full((6, 1), 0.7, np.float32), r"input 'T' has shape \(6, 1\); expected a scalar or "
                                       r"\(\*rows,\) = \(4,\)"),
    (np.full((4, 1), 0.7, np.float32), r"input 'T' has shape \(4, 1\).*\(4, 4\) results"),
])
def test_parameter_rows_that_would_pair_with_every_stream_row(T, words):
    """A keepdim column (4, 1) next to x (4, N) would broadcast to 4 x 4 results: refused,
    naming the input and the expected shape, by evaluate and by the kernel alike."""
    with pytest.raises(ValueError, match=words):
        redfuser.derive("softmax_entropy").evaluate({"x": X, "T": T})
    with pytest.raises(ValueError, match=words):
        redfuser.compile("softmax_entropy")(x=X, T=T)


def test_parameters_may_widen_or_be_widened_by_the_stream_rows():
    """What broadcasting is for stays: per-query q over a K shared by a head's queries, a
    K shared by every query, and a per-query scale over K's (H, 1) rows."""
    rule = redfuser.derive("attention")
    q, kv = np.ones((2, 3, 4)), np.ones((2, 1, 5, 4))
    assert rule.evaluate({"q": q, "k": kv, "v": kv, "scale": np.ones(3)})["o"].shape == (2, 3, 4)
    assert rule.evaluate({"q": q[0], "k": kv[0, 0], "v": kv[0, 0], "scale": 1.0})["o"].shape \
        == (3, 4)
    assert redfuser.derive("softmax_entropy").evaluate(
        {"x": X, "T": np.full(4, 0.7)})["h"].shape == (4,)


@pytest.mark.parametrize("N, words", [
    (7, r"input 'N' is 7, but stream 'x' has length 40 \(shape \(2, 40\)\)"),
    (-1, "a non-negative integer, not -1"),
    (2.5, "a non-negative integer, not 2.5"),
    (True, "a non-negative integer, not True"),
    ([40], r"a non-negative integer, not \[40\]"),
])
def test_stream_length_must_agree_with_the_streams(N, words):
    x = np.zeros((2, 40), np.float32)
    with pytest.raises(ValueError, match=words):
        redfuser.derive("m = max(x[i] + i)").evaluate({"x": x, "N": N})
    with pytest.raises(ValueError, match=words):
        redfuser.compile("m = max(x[i] + i)")(x=x, N=N)
    assert redfuser.derive("m = max(x[i] + i)").evaluate({"x": x, "N": 40})["m"].shape == (2,)


def test_stream_length_of_an_index_only_spec():
    """Only i is streamed: N is a count, of any integer type (a 0-d integer array too), and
    each value is its own kernel signature."""
    k = redfuser.compile("m = max(where(i < 3, 1.0 * i, -inf))")
    assert float(k(N=np.int64(5))["m"]) == 2.0
    assert float(k(N=np.array(2))["m"]) == 1.0
    with pytest.raises(ValueError, match="a non-negative integer"):
        k(N=np.array(2.5))


@pytest.mark.parametrize("option, error, words", [
    (dict(splits=0), ValueError, "splits must be a positive integer"),
    (dict(splits=True), ValueError, "splits must be a positive integer"),
    (dict(threads=0), ValueError, "threads must be a positive integer"),
    (dict(threads=-2), ValueError, "threads must be a positive integer"),
    (dict(fast_math="no"), TypeError, "fast_math must be True or False"),
    (dict(variant="fused"), ValueError, "variant must be one of"),
    (dict(tune="yes"), ValueError, "tune must be None, True, False or 'model'"),
    (dict(target="tpu"), ValueError, "target must be one of"),
])
def test_compile_refuses_options_no_plan_can_honour(option, error, words):
    with pytest.raises(error, match=words):
        redfuser.compile("softmax", **option)


def test_source_before_a_call_names_what_exists():
    """The hint used to name compile(..., example=...), which does not exist."""
    k = redfuser.compile("softmax")
    with pytest.raises(RuntimeError, match=r"kernel\.prepare\(\*\*inputs\)"):
        k.source()
    assert "prim_func" in k.prepare(x=X).source()


def test_kernel_names_an_empty_feature_axis_and_returns_empty_rows():
    """TVM refuses zero-sized buffers with a message about strides: the kernel names the
    input with D = 0 instead (evaluate and the reference give numpy's empty results); no
    rows gives empty outputs, as numpy (tests/api/test_call_reliability.py)."""
    q, kv = np.ones((2, 3, 0), np.float32), np.ones((2, 1, 5, 0), np.float32)
    with pytest.raises(ValueError, match=r"input 'k' has shape \(2, 1, 5, 0\): a feature axis "
                                         "D of 0"):
        redfuser.compile("attention")(q=q, k=kv, v=kv, scale=1.0)
    assert redfuser.derive("attention").evaluate({"q": q, "k": kv, "v": kv, "scale": 1.0})[
        "o"].shape == (2, 3, 0)
    assert redfuser.compile("softmax")(x=np.ones((3, 0, 8), np.float32))["y"].shape == (3, 0, 8)
