"""The command line, run in-process."""

import json
import os

import pytest

import redfuser
from algebra import LIBRARY
from redfuser import cli
from redfuser.cli import main
from redfuser.lowering import shape_geometry


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


@pytest.mark.parametrize(("spec", "passes", "line"), [
    ("softmax", "1", "dx[i] = y[i]*(d*g_d + dy[i])"),
    ("mad", "1", "staged forward (2 passes)"),  # a library cascade that needs stages
    ("mu = sum(x[i]) / N\nv = sum(relu(x[i] - mu))\nw = sum(relu(x[i] - v))", "auto",
     "[proven] dx[i] = d loss / d x[i] at N = 3"),  # nested kinks, and a staged backward
])
def test_derive_backward_prints_the_proven_backward_and_its_rule(capsys, spec, passes, line):
    code, out, _ = run(capsys, "derive", spec, "--backward", "--passes", passes)
    assert code == 0 and line in out and "[FAILED]" not in out


def test_derive_backward_refuses_an_index_output_by_name(capsys):
    code, _, err = run(capsys, "derive", "j = argmax(x[i])", "--backward")
    assert code != 0 and "index" in err


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


# -- bad command lines: one line on stderr, exit code 2, no traceback (repro cli_issues.sh) ---

def _one_line_error(code: int, err: str, *words: str):
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err


def test_spec_file_that_cannot_be_read(capsys, tmp_path):
    """Repro cli_issues.sh: a missing file, a directory and a binary file printed tracebacks."""
    binary = tmp_path / "a.out"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\xd0\xff\xfe")
    for path, words in ((tmp_path / "missing.spec", ["cannot read", "No such file"]),
                        (tmp_path, ["is a directory"]),
                        (binary, ["not UTF-8 text", "byte 0xd0 at offset 8"])):
        code, out, err = run(capsys, "derive", "-f", str(path))
        _one_line_error(code, err, str(path), *words)
        assert out == ""


def test_spec_file_reads_are_bounded(capsys, tmp_path):
    """Repro cli_issues.sh: -f /dev/zero read until memory ran out; a FIFO would block
    forever (it is refused from os.stat, before it is opened)."""
    code, _, err = run(capsys, "derive", "-f", "/dev/zero")
    _one_line_error(code, err, "larger than", "MAX_SPEC_CHARS")
    big = tmp_path / "big.spec"
    big.write_text("m = max(x[i])\n" + "#" * cli.MAX_FILE_BYTES)
    code, _, err = run(capsys, "derive", "-f", str(big))
    _one_line_error(code, err, "larger than")
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    code, _, err = run(capsys, "derive", "-f", str(fifo))  # returns at once: no writer needed
    _one_line_error(code, err, "FIFO")


@pytest.mark.parametrize("argv, option", [
    (["kernels", "attention", "--d", "0"], "--d"),  # was a ZeroDivisionError traceback
    (["kernels", "softmax", "--n", "-3"], "--n"),
    (["kernels", "softmax", "--rows", "zero"], "--rows"),
    (["tune", "softmax", "--rows", "0", "--no-store"], "--rows"),  # ZeroDivisionError
    (["tune", "softmax", "--rows", "4x0", "--no-store"], "--rows"),
    (["tune", "softmax", "--n", "0", "--no-store"], "--n"),  # silently became 64
    (["tune", "softmax", "--d", "-1", "--no-store"], "--d"),
    (["tune", "softmax", "--shape", "x=4x0", "--no-store"], "--shape"),
    (["tune", "softmax", "--top", "0", "--no-store"], "--top"),
    (["tune", "softmax", "--repeat", "0", "--no-store"], "--repeat"),
])
def test_sizes_must_be_positive(capsys, argv, option):
    """Repro cli_issues.sh: zero or negative sizes are argparse errors naming the option."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {option}: expected" in err, err
    assert "Traceback" not in err


def test_shape_geometry_keeps_the_sizes_it_is_given():
    """`tune --n 0` used to become N = 64 (`n or 64`): a size given is checked, never
    replaced by the default."""
    rule = redfuser.derive("softmax")
    assert shape_geometry(rule, n=7).n == 7 and shape_geometry(rule).n == 64
    for kw, what in ((dict(n=0), "n must be"), (dict(rows=(4, 0)), "row axis"),
                     (dict(d=-1), "d must be")):
        with pytest.raises(ValueError, match=what):
            shape_geometry(rule, **kw)


def test_all_and_list_as_json_are_one_document(capsys, monkeypatch):
    """Repro cli_issues.sh: `derive --all --json` printed one document per rule and a table."""
    monkeypatch.setattr(cli, "LIBRARY", {k: LIBRARY[k] for k in ("softmax", "variance")})
    code, out, _ = run(capsys, "derive", "--all", "--json")
    docs = json.loads(out)
    assert code == 0 and list(docs) == ["softmax", "variance"]
    assert all(p["proven"] for p in docs["variance"]["proof"]) and docs["softmax"]["derive_ms"] > 0
    monkeypatch.undo()
    code, out, _ = run(capsys, "derive", "--list", "--json")
    listed = json.loads(out)
    assert code == 0 and set(listed) == set(LIBRARY)
    assert listed["softmax"]["spec"] == LIBRARY["softmax"][0]


def test_library_name_typo_suggests_the_name(capsys):
    code, out, err = run(capsys, "derive", "softmx")
    assert code == 1 and out == "" and "did you mean 'softmax'?" in err, err
    code, _, err = run(capsys, "kernels", "atention", "variance")
    _one_line_error(code, err, "not in the library: atention (did you mean attention?)")
    code, _, err = run(capsys, "derive")
    _one_line_error(code, err, "give a spec")
