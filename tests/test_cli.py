"""The command line, run in-process."""

import json

import pytest

from redfuser.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_derive_attention_shows_rescale_and_final_division(capsys):
    code, out, _ = run(capsys, "derive", "attention")
    assert code == 0
    assert "o_sum*exp(m - m')" in out and "o = o_sum/d" in out
    assert "[8/8 obligations proven]" in out


def test_derive_variance_is_anchored(capsys):
    code, out, _ = run(capsys, "derive", "variance")
    assert code == 0 and "at the running mean" in out and "finite-rank re-anchoring" in out


def test_json_and_latex(capsys):
    code, out, _ = run(capsys, "derive", "m = max(x[i]); d = sum(exp(x[i] - m))", "--json")
    data = json.loads(out)
    assert code == 0 and data["outputs"] == ["m", "d"]
    assert all(p["proven"] for p in data["proof"])
    code, out, _ = run(capsys, "derive", "softmax", "--latex")
    assert code == 0 and r"e^{m - m'}" in out


def test_spec_file_and_list(capsys, tmp_path):
    f = tmp_path / "c.spec"
    f.write_text("mean = sum(x[i]) / N\n# comment\nvar = sum((x[i] - mean)**2) / N\n")
    code, out, _ = run(capsys, "derive", "-f", str(f))
    assert code == 0 and "var = var_sum/n" in out
    code, out, _ = run(capsys, "derive", "--list")
    assert code == 0 and "rmsnorm_gemm" in out and "moe_routing" in out


@pytest.mark.parametrize(("spec", "kind"), [
    ("m = max(x[i]); r = sum(relu(x[i] - m))", "NotFusable"),
    ("m = foo(x[i])", "SpecError"),
])
def test_errors_are_reported_not_raised(capsys, spec, kind):
    code, out, err = run(capsys, "derive", spec)
    assert code == 1 and out == "" and err.startswith(kind)
