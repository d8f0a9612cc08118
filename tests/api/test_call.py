"""The call path (redfuser/call.py): per-signature plans, views instead of copies, ``out=``,
torch in -> torch out; every result compared with the float64 oracle."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import redfuser
from algebra.library import example_inputs
from redfuser import kernel as kernel_module
from tests.support import KERNEL_TOL, assert_matches

RTOL = ATOL = KERNEL_TOL


def _check(out: dict, ref: dict):
    for k, r in ref.items():
        got = out[k].numpy() if isinstance(out[k], torch.Tensor) else out[k]
        assert_matches(got, r, RTOL, ATOL, k)


@pytest.mark.parametrize("name", ["softmax", "attention", "moe_routing", "layernorm"])
def test_repeated_calls_reuse_one_plan_and_return_fresh_views(name):
    k = redfuser.compile(name, tune=False)
    a, b = (example_inputs(name, n=64, rows=(3,), d=16, seed=s) for s in (1, 2))
    first = k(**a)
    (key, plan), = k._calls.items()
    written = []  # the buffers the kernel was handed
    k._calls[key] = dataclasses.replace(plan, func=lambda *args: (written.extend(args),
                                                                   plan.func(*args)))
    second = k(**b)
    assert len(k._calls) == 1  # the same signature: looked up, not worked out again
    _check(first, redfuser.reference(name, a))  # the first call's results stay intact
    _check(second, redfuser.reference(name, b))
    for v in second.values():  # the kernel's own buffer or a view of it: no copy
        assert v.flags.writeable and any(np.shares_memory(v, w) for w in written)
        assert not any(np.shares_memory(v, f) for f in first.values())


def test_out_arrays_are_written_in_place_and_returned():
    k = redfuser.compile("softmax", tune=False)
    x = np.random.default_rng(0).normal(size=(5, 100)).astype(np.float32)
    y = np.empty((5, 100), np.float32)
    res = k(x=x, out={"y": y})
    assert res["y"] is y and res["m"].shape == (5,)
    _check(res, redfuser.reference("softmax", {"x": x}))


@pytest.mark.parametrize("out,error,match", [
    ({"y": np.empty((5, 99), np.float32)}, ValueError, r"out\['y'\] has shape \(5, 99\)"),
    ({"y": np.empty((5, 100), np.float64)}, TypeError, r"out\['y'\] has dtype float64"),
    ({"y": np.empty((100, 5), np.float32).T}, ValueError, "C-contiguous"),
    ({"y": np.empty(501, np.float32)[1:].reshape(5, 100)}, ValueError, "16-byte aligned"),
    ({"z": np.empty((5, 100), np.float32)}, ValueError, r"out names \['z'\]"),
    ({"y": [[0.0] * 100] * 5}, TypeError, r"out\['y'\] must be an array"),
])
def test_bad_out_arrays_are_named(out, error, match):
    x = np.zeros((5, 100), np.float32)
    with pytest.raises(error, match=match):
        redfuser.compile("softmax", tune=False)(x=x, out=out)


def test_torch_in_gives_torch_out_without_copies():
    k = redfuser.compile("attention", tune=False)
    inputs = example_inputs("attention", n=48, rows=(2, 3), d=16)
    tin = {n: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for n, v in inputs.items()}
    out = k(**tin)
    assert all(isinstance(v, torch.Tensor) for v in out.values())
    _check(out, redfuser.reference("attention", inputs))
    o = torch.empty(2, 3, 16)
    assert k(**tin, out={"o": o})["o"] is o


def test_misaligned_and_strided_inputs_are_read_correctly():
    """TVM never checks the 16-byte alignment the kernels are compiled for: a misaligned
    view must be copied, a strided one read through the layout check."""
    k = redfuser.compile("logsumexp", tune=False)
    raw = np.random.default_rng(3).normal(size=4 * 64 + 1).astype(np.float32)
    misaligned = raw[1:].reshape(4, 64)
    strided = np.random.default_rng(4).normal(size=(64, 4)).astype(np.float32).T
    for x in (misaligned, strided, misaligned):
        _check(k(x=x), redfuser.reference("logsumexp", {"x": x}))


def test_torch_tensors_go_over_as_they_are_only_when_aligned():
    """A plain CPU tensor is handed to the FFI as it is (no DLPack wrap in Python), where its
    address is 16-byte aligned: a contiguous but misaligned one (a slice one float in),
    called with the same signature, is copied and read correctly."""
    k = redfuser.compile("logsumexp", tune=False)
    raw = torch.from_numpy(np.random.default_rng(5).normal(size=4 * 64 + 1).astype(np.float32))
    aligned, misaligned = raw[:-1].reshape(4, 64), raw[1:].reshape(4, 64)
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 == 4
    for x in (aligned, misaligned, aligned, misaligned):
        _check(k(x=x), redfuser.reference("logsumexp", {"x": x.numpy()}))
    assert len(k._calls) == 1  # one signature: the address is checked per call


def test_fresh_numpy_memory_is_aligned_as_the_kernels_assume():
    """call.output_arrays relies on numpy's allocations being 16-byte aligned."""
    sizes = [1, 3, 7, 16, 100, 1000, 4097]
    assert all(np.empty(s, np.float32).ctypes.data % 16 == 0 for s in sizes * 20)


def test_a_new_stream_length_given_as_N_is_a_new_plan():
    k = redfuser.compile("s = sum(i)", tune=False)
    assert k(N=4)["s"].item() == 6 and k(N=5)["s"].item() == 10


@pytest.mark.parametrize("spec", ["m = max(out[i])", "out = sum(x[i])", "s = sum(x[i] * out)"])
def test_out_is_a_reserved_name(spec):
    with pytest.raises(redfuser.SpecError, match="'out' is reserved"):
        redfuser.derive(spec)


def test_per_shape_caches_are_bounded(monkeypatch):
    """Repro kernel_cache_growth.py: every new N compiled an executable that stayed in memory
    (81 after 80 shapes).  The executables and the call plans are LRU caches of MAX_CACHED
    (32) entries; lowered to 2 here so that the test compiles 4 shapes, not 34.  An evicted
    shape recompiles and still matches the oracle."""
    monkeypatch.setattr(kernel_module, "MAX_CACHED", 2)
    k = redfuser.compile("softmax", tune=False)
    shapes = [example_inputs("softmax", n=n, rows=(2,)) for n in (5, 6, 7, 8)]
    for inputs in shapes:
        k(**inputs)
        assert len(k._cache) <= 2 and len(k._calls) <= 2
    _check(k(**shapes[0]), redfuser.reference("softmax", shapes[0]))


@pytest.mark.parametrize("name", ["softmax", "attention", "layernorm", "threshold_mass"])
def test_arrays_in_the_kernels_shapes_are_handed_over_and_returned_as_they_are(name):
    """The kernel's arguments take the caller's shapes (``signature.call_shape``): an input
    already of that shape reaches the compiled function as the same object (no reshape), and
    each output is the very array the function wrote."""
    k = redfuser.compile(name, tune=False)
    inputs = example_inputs(name, n=64, rows=(2, 3), d=16)
    k(**inputs)
    (key, plan), = k._calls.items()
    written = []
    k._calls[key] = dataclasses.replace(plan, func=lambda *args: (written.extend(args),
                                                                   plan.func(*args)))
    k._recent = None  # the replaced plan is the one looked up
    out = k(**inputs)
    _check(out, redfuser.reference(name, inputs))
    arrays = [v for v in inputs.values() if isinstance(v, np.ndarray)]
    assert arrays and all(any(w is v for w in written) for v in arrays)
    assert all(any(w is v for w in written) for v in out.values())


def test_outputs_names_what_a_call_returns_and_the_rest_stays_inside():
    x = np.random.default_rng(6).normal(size=(5, 100)).astype(np.float32)
    ref = redfuser.reference("softmax", {"x": x})
    k = redfuser.compile("softmax", outputs=["y"], tune=False)
    out = k(x=x)
    assert list(out) == ["y"] and len(k.primfunc.params) == 2  # x and y: m, d are inside
    _check(out, {"y": ref["y"]})
    y = np.empty_like(x)
    assert k(x=x, out={"y": y})["y"] is y
    _check({"y": y}, {"y": ref["y"]})
    with pytest.raises(ValueError, match=r"out names \['m'\]"):
        k(x=x, out={"m": np.empty(5, np.float32)})
    dynamic = redfuser.compile("softmax", outputs=["y", "d"], dynamic=True)
    for rows in ((5,), (2, 7)):
        xs = np.random.default_rng(7).normal(size=(*rows, 33)).astype(np.float32)
        got, want = dynamic(x=xs), redfuser.reference("softmax", {"x": xs})
        assert sorted(got) == ["d", "y"]
        _check(got, {n: want[n] for n in got})
    staged = redfuser.compile("threshold_mass", outputs=["mass"])
    inputs = example_inputs("threshold_mass", n=300, rows=(4,))
    got = staged(**inputs)
    assert list(got) == ["mass"]
    _check(got, {"mass": redfuser.reference("threshold_mass", inputs)["mass"]})


@pytest.mark.parametrize("outputs,error,match", [
    ("y", TypeError, "a list of output names"),
    (["q"], ValueError, r"outputs names \['q'\]; this kernel's outputs are \['m', 'd', 'y'\]"),
    ([], ValueError, "outputs names nothing"),
    (["m", "d"], ValueError, r"leaves out the per-element output\(s\) \['y'\]"),
])
def test_bad_outputs_are_named(outputs, error, match):
    with pytest.raises(error, match=match):
        redfuser.compile("softmax", outputs=outputs)
