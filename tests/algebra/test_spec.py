"""Parsing and lifting: statements, hoisting, shapes, and SpecError positions."""

import pytest
import sympy as sp

import redfuser
from algebra.spec import parse
from redfuser import SpecError


def test_attention_lifts_lets_hoists_and_marks_vectors():
    c = parse("s = dot(q, k[i]) * scale  # a let\nm = max(s)\nd = sum(exp(s - m))\n"
              "o = sum(exp(s - m) * v[i]) / d")
    assert [r.name for r in c.reductions] == ["m", "d", "o_sum"]
    assert c.outputs == ("m", "d", "o")
    assert str(c.epilogues["o"]) == "o_sum/d"
    assert {s.name for s in c.streams} == {"k", "v"}
    assert {p.name for p in c.params} == {"q", "scale"}
    assert c.vector_inputs == {"q", "k"}  # forced by dot(); v stays undecided
    assert [a.name for a in c.reductions[2].anchors] == ["m"]
    assert (c.reductions[1].line, c.reductions[1].col) == (3, 5)


def test_semicolons_per_element_outputs_and_topk_shapes():
    c = parse("m = max(x[i]); d = sum(exp(x[i] - m)); y[i] = exp(x[i] - m) / d; "
              "t = topk(x[i], 3)")
    assert c.outputs == ("m", "d", "y", "t")
    assert set(c.elementwise) == {"y"}
    assert c.shapes["t"].k == 3
    assert c.reductions[1].symbol.is_positive  # a sum of exponentials: used by monotonicity


def test_epilogue_as_anchor_and_stream_let_depending_on_a_result():
    c = parse("mean = sum(x[i]) / N; z = x[i] - mean; var = sum(z**2) / N")
    var = c.reductions[1]
    assert [a.name for a in var.anchors] == ["mean"]
    assert var.body == (sp.Symbol("x", real=True) - sp.Symbol("mean", real=True)) ** 2


@pytest.mark.parametrize(("spec", "line", "col", "words"), [
    ("", 1, 1, "empty spec"),
    ("   # only a comment\n", 1, 1, "empty spec"),
    ("m = mx(x[i])", 1, 5, "unknown function 'mx'"),
    ("m = max(x[i])\nd = sum(exp(x[i] - max(x[i])))", 2, 20, "nested inside"),
    ("a = sum(x[i] * c)\nc = max(x[i])", 1, 16, "used before its definition on line 2"),
    ("a = sum(x[i] * b)\nb = sum(x[i] * a)", 1, 16, "cycle"),
    ("a = sum(a * x[i])", 1, 9, "cycle"),
    ("t = sum(dot(x[i], k[i]))\ns = dot(t, k[i])", 2, 9, "shape mismatch"),
    ("t = topk(x[i], 2)\ny = sum(t * x[i])", 2, 9, "over top-k values"),
    ("t = topk(x[i, :], 2)", 1, 10, "needs a scalar per element"),
    ("t = topk(x[i], 2)\nu = argmax(x[i])\nw = t + u * x[i, :]", 3, 5, "shape mismatch"),
    ("t = topk(x[i], k)", 1, 16, "k must be a positive integer literal"),
    ("m = max(x[j])", 1, 9, "indexed by 'i' only"),
    ("m = max(x[i]) +", 1, 16, "syntax error"),
    ("m = max(x[i]); x = 2", 1, 9, "before its definition"),
    ("m = max(x[i]); s = sum(x * m)", 1, 24, "used both as a stream"),
    ("m = max(x[i])\nm = min(x[i])", 2, 1, "assigned twice"),
    ("N = sum(x[i])", 1, 1, "reserved"),
    ("a = sum(x[i] / 0)", 1, 9, "undefined"),
    ("a = 2 * b", 1, 1, "no reduction"),
    ("a = sum(x[i] > 0)", 1, 9, "is a condition (true or false), used as a number"),
    # limits (algebra.limits): each names itself and points at the node over it
    ("m = max(x[i] + 10**10**10)", 1, 16, "limit MAX_CONSTANT_BITS = 1100"),
    ("m = max(" + "-" * 70 + "x[i])", 1, 72, "limit MAX_DEPTH = 64"),  # the 64th '-'
    ("m = max(x[i] * 1" + "0" * 400 + ")", 1, 16, "limit MAX_CONSTANT_BITS"),
])
def test_bad_specs_name_line_column_and_problem(spec, line, col, words):
    with pytest.raises(SpecError) as err:
        parse(spec)
    assert (err.value.line, err.value.col) == (line, col), str(err.value)
    assert words in str(err.value)
    assert f"line {line}, column {col}" in str(err.value)


def test_spec_error_is_a_value_error():
    with pytest.raises(ValueError):
        parse("m = max(")


def test_a_lone_word_is_a_library_name():
    """A typo of a library name gets the nearest name, not a syntax error."""
    with pytest.raises(SpecError, match="'softmx' is not a library cascade \\(did you mean "
                                        "'softmax'\\?\\)"):
        redfuser.derive("softmx")
    assert redfuser.derive(" variance\n").cascade.text == redfuser.derive("variance").cascade.text
