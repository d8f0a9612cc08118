"""Reliability of the call path (redfuser/call.py, redfuser/kernel.py, redfuser/quant.py):
``out=`` arrays that share memory with each other or with an input, ``out`` of the wrong
type, a dynamic kernel with variant="split", two threads calling quant_gemm, and calls with
no rows.  Every value is compared with an independent float64 numpy reference."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

import redfuser
from redfuser.quant import QuantGemm

RNG = np.random.default_rng(0)


def softmax64(x: np.ndarray) -> dict:
    """float64 softmax statistics and output of a float32 array."""
    x64 = x.astype(np.float64)
    m = x64.max(-1)
    e = np.exp(x64 - m[..., None])
    return {"m": m, "d": e.sum(-1), "y": e / e.sum(-1, keepdims=True)}


def normal(*shape) -> np.ndarray:
    return RNG.normal(size=shape).astype(np.float32)


# 1. Outputs that share memory ------------------------------------------------------------
@pytest.mark.parametrize("layout", ["same", "overlap"])
def test_outputs_that_share_memory_are_refused_by_name(layout):
    """Repro r2_out_alias_outputs.py: both were accepted and m (or d) came back wrong."""
    buf = np.empty(64 + 4, np.float32)
    m, d = (buf[:64], buf[:64]) if layout == "same" else (buf[:64], buf[4:68])
    with pytest.raises(ValueError, match=r"out\['m'\] and out\['d'\] share memory"):
        redfuser.compile("softmax")(x=normal(64, 100), out={"m": m, "d": d})


def test_torch_outputs_that_share_memory_are_refused():
    buf = torch.empty(2 * 8 + 2)
    x = torch.from_numpy(normal(8, 50))
    with pytest.raises(ValueError, match=r"out\['m'\] and out\['d'\] share memory"):
        redfuser.compile("softmax")(x=x, out={"m": buf[:8], "d": buf[4:12]})


def test_adjacent_outputs_in_one_buffer_are_written():
    """Neighbours that do not overlap are no error (and no copy)."""
    x, buf = normal(64, 100), np.empty(128, np.float32)
    out = redfuser.compile("softmax")(x=x, out={"m": buf[:64], "d": buf[64:]})
    ref = softmax64(x)
    np.testing.assert_allclose(buf[:64], ref["m"], rtol=1e-6)
    np.testing.assert_allclose(buf[64:], ref["d"], rtol=1e-5)
    np.testing.assert_allclose(out["y"], ref["y"], rtol=1e-5, atol=1e-7)


# 2. Outputs that overlap an input --------------------------------------------------------
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_an_output_shifted_over_its_input_is_computed_correctly(kind):
    """Repro r2_out_overlap_input.py: y over x shifted by 16 bytes gave a 0.036 error; it
    is now written to a temporary and copied into the caller's y."""
    buf = normal(4 * 64 + 4)
    ref = softmax64(buf[:256].reshape(4, 64))["y"]
    if kind == "torch":
        buf = torch.from_numpy(buf)
    x, y = buf[:256].reshape(4, 64), buf[4:].reshape(4, 64)
    got = redfuser.compile("softmax")(x=x, out={"y": y})["y"]
    assert got is y
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-7)


def _attention64(q, k, v, scale) -> np.ndarray:
    s = np.einsum("hld,hnd->hln", q.astype(np.float64), k[:, 0].astype(np.float64)) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hln,hnd->hld", p / p.sum(-1, keepdims=True), v[:, 0].astype(np.float64))


@pytest.mark.parametrize("over", ["v", "q"])
def test_attention_output_over_an_input_is_computed_correctly(over):
    """o laid over the start of v (a partial overlap), or exactly over q (a per-row result
    over a parameter of its shape: written to a temporary too)."""
    q, k, v = normal(2, 16, 16), normal(2, 1, 64, 16), normal(2, 1, 64, 16)
    ref = _attention64(q, k, v, 0.2)
    o = v.reshape(-1)[:2 * 16 * 16].reshape(2, 16, 16) if over == "v" else q
    redfuser.compile("attention")(q=q, k=k, v=v, scale=0.2, out={"o": o})
    np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5)


def test_a_staged_result_over_a_parameter_a_later_stage_reads():
    """threshold_mass with out={'m': t}: the second stage read m as the threshold (mass 0)."""
    x, t = normal(6, 500), np.full(6, 0.002, np.float32)
    p = softmax64(x)["y"]
    ref = {"m": x.astype(np.float64).max(1), "mass": np.where(p >= 0.002, p, 0).sum(1)}
    out = redfuser.compile("threshold_mass")(x=x, t=t, out={"m": t})
    assert out["m"] is t
    np.testing.assert_allclose(out["mass"], ref["mass"], rtol=1e-5)
    np.testing.assert_allclose(t, ref["m"], rtol=1e-6)


def _norm64(name: str, x: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    if name == "softmax":
        return softmax64(x)["y"]
    if name == "log_softmax":
        m = x64.max(-1, keepdims=True)
        return x64 - m - np.log(np.exp(x64 - m).sum(-1, keepdims=True))
    if name == "l2_normalize":
        return x64 / np.sqrt((x64 ** 2).sum(-1, keepdims=True))
    if name == "rmsnorm":
        return x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * g
    mean = x64.mean(-1, keepdims=True)
    return (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def _norm_inputs(name: str, x: np.ndarray, g: np.ndarray, b: np.ndarray) -> dict:
    return {"x": x, **({"g": g, "eps": 1e-5} if name == "rmsnorm" else {}),
            **({"g": g, "b": b, "eps": 1e-5} if name == "layernorm" else {})}


@pytest.mark.parametrize("options", [{"variant": "rolling"}, {"variant": "split"},
                                     {"variant": "unfused"}, {"dynamic": True}, {}])
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layernorm", "rmsnorm",
                                  "l2_normalize"])
def test_exact_in_place_is_correct_and_copy_free(name, options):
    """out={'y': x}: the one per-element output over its stream, exactly the same memory,
    is handed to the kernel as it is (no temporary) and is right in every variant, since
    each element is read before it is written (``call._in_place``)."""
    n = 4096 if options.get("variant") == "split" else 1000
    x, g, b = normal(8, n), normal(n), normal(n)
    ref = _norm64(name, x, g, b)
    k = redfuser.compile(name, tune=False, **options)
    k(**_norm_inputs(name, x.copy(), g, b))  # the signature's plan
    (key, plan), = k._calls.items()
    written = []
    k._calls[key] = dataclasses.replace(plan, func=lambda *args: (written.extend(args),
                                                                   plan.func(*args)))
    k._recent = None
    assert k(**_norm_inputs(name, x, g, b), out={"y": x})["y"] is x
    assert sum(np.shares_memory(np.from_dlpack(a), x) for a in written) == 2  # x and y
    np.testing.assert_allclose(x, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("out,match", [
    ([np.empty((4, 64), np.float32)], "a list"),
    ((np.empty((4, 64), np.float32),), "a tuple"),
    (np.empty((4, 64), np.float32), "a ndarray"),
])
def test_out_that_is_not_a_dict_is_named(out, match):
    """Repro r2_out_not_dict.py: "unhashable type: 'numpy.ndarray'" from inside the call."""
    names = r"\(this kernel's outputs are \['m', 'd', 'y'\]\)"
    with pytest.raises(TypeError, match=rf"out must be a dict mapping output name -> array "
                                        rf"{names}, not {match}"):
        redfuser.compile("softmax")(x=np.ones((4, 64), np.float32), out=out)


# 4. dynamic=True with the split variant --------------------------------------------------
def test_dynamic_split_is_refused_by_compile():
    """Repro r2_dynamic_split_late_refusal.py: compile accepted it, the first call refused."""
    with pytest.raises(ValueError, match="variant 'split' .* needs static shapes"):
        redfuser.compile("softmax", dynamic=True, variant="split")


# 5. quant_gemm from two threads ----------------------------------------------------------
def test_quant_gemm_from_two_threads_is_exact():
    """Repro r2_quant_threads.py: the per-shape scratch buffers were shared by every call,
    and the kernel runs without the GIL: 15 of 400 concurrent calls were wrong."""
    kernel = QuantGemm()
    wq = RNG.integers(-127, 128, (512, 256)).astype(np.int8)
    ws = (RNG.random(256) * 0.01).astype(np.float32)
    xs = [normal(64, 512) * (j + 1) for j in range(2)]

    def reference(x: np.ndarray) -> np.ndarray:  # numpy quantize-then-GEMM, exact
        a = np.abs(x).max(axis=-1, keepdims=True)
        q = np.clip(np.round(x * np.float32(127) / a), -127, 127)
        return (q.astype(np.float64) @ wq).astype(np.float32) * a / np.float32(127) * ws

    refs, wrong = [reference(x) for x in xs], []

    def work(j: int) -> None:
        for _ in range(100):
            if not np.array_equal(kernel(xs[j], wq, ws), refs[j]):
                wrong.append(j)

    threads = [threading.Thread(target=work, args=(j,)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


# 6. No rows ------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [(0,), (2, 0)])
@pytest.mark.parametrize("options", [{}, {"dynamic": True}])
def test_no_rows_gives_numpy_empty_outputs_without_a_kernel(rows, options):
    """numpy's softmax of a (0, 8) array is (0, 8) with (0,) statistics; the kernel raised
    "a kernel needs at least one row"."""
    x = np.zeros((*rows, 8), np.float32)
    k = redfuser.compile("softmax", **options)
    out = k(x=x)
    ref = softmax64(x)
    assert {n: (v.shape, v.dtype) for n, v in out.items()} == \
        {n: (v.shape, np.dtype(np.float32)) for n, v in ref.items()}
    assert k.builds == 0
    y, m = np.empty((*rows, 8), np.float32), np.empty(rows, np.float32)
    given = k(x=x, out={"y": y, "m": m})
    assert given["y"] is y and given["m"] is m and given["d"].shape == rows


def test_no_rows_with_torch_gives_torch():
    out = redfuser.compile("softmax")(x=torch.zeros(0, 8))
    assert {n: (type(v), tuple(v.shape), v.dtype) for n, v in out.items()} == {
        "m": (torch.Tensor, (0,), torch.float32), "d": (torch.Tensor, (0,), torch.float32),
        "y": (torch.Tensor, (0, 8), torch.float32)}


def _empty_numpy(name: str, x: np.ndarray) -> dict:
    """numpy's shapes of each library spec's outputs on ``x`` (the same formulas)."""
    x64, n = x.astype(np.float64), x.shape[-1]
    stat = x64.sum(-1)
    shapes = {"threshold_mass": {"m": stat, "d": stat, "mass": stat},
              "layernorm": {"mean": stat, "var": stat, "y": x64 * np.ones(n)},
              "rmsnorm": {"r": stat, "y": x64 * np.ones(n)},
              "moe_routing": {"m": stat, "d": stat, "p": x64[..., :8], "e": x64[..., :8]},  # top 8
              "mad": {"mu": stat, "mad": stat}}
    return {k: v.shape for k, v in shapes[name].items()}


@pytest.mark.parametrize("name,extra", [
    ("threshold_mass", lambda rows: {"t": np.zeros(rows, np.float32)}),
    ("layernorm", lambda rows: {"g": np.ones(32, np.float32), "b": np.ones(32, np.float32),
                                "eps": 1e-5}),
    ("rmsnorm", lambda rows: {"g": np.ones(32, np.float32), "eps": 1e-5}),
    ("moe_routing", lambda rows: {}),
    ("mad", lambda rows: {}),
])
@pytest.mark.parametrize("rows", [(0,), (3, 0)])
def test_no_rows_for_library_specs_with_stages_and_parameters(name, extra, rows):
    x = np.zeros((*rows, 32), np.float32)
    out = redfuser.compile(name)(x=x, **extra(rows))
    assert {n: v.shape for n, v in out.items()} == _empty_numpy(name, x)
    assert out.get("e", np.empty(0, np.int64)).dtype == np.int64


def test_prepare_without_rows_is_refused_by_name():
    with pytest.raises(ValueError, match=r"no rows \(row axes \(0,\)\)"):
        redfuser.compile("softmax").prepare(x=np.zeros((0, 8), np.float32))
