"""Lifting TensorIR (TOPI, te, TVMScript) into cascades and rewriting them with fused kernels.

Every fused case is built for the CPU and run against the original PrimFunc on the same
random float32 inputs.  Tolerance: 1e-5 relative to the largest output value: the fused
kernel reassociates the reductions (float32 sums over N <= 8192 elements) and uses a
polynomial exp (8.5e-8 relative error), where the original sums left to right with expf.
CUDA: each rewritten function is compiled for sm_90 (nvcc, no GPU needed).
"""


import numpy as np
import pytest
from tvm import IRModule, te, tirx, topi
from tvm.script import tirx as T

from redfuser.tensorir import rewrite as rewrite_module
from redfuser.tensorir.axes import Frame
from redfuser.tensorir.emit import splice
from redfuser.tensorir.groups import LiftError, lift
from redfuser.tensorir.rewrite import check_numeric, fuse, random_params, run_cpu
from redfuser.tvm.ir import structural_equal
from redfuser.tvm.runtime import build
from redfuser.tvm.target import cuda_target
from tests.support import needs_nvcc

RTOL = 1e-5


def topi_case(name: str, shape=(16, 128)):
    x = te.placeholder(shape, "float32", name="x")
    g = te.placeholder(shape[-1:], "float32", name="g")
    b = te.placeholder(shape[-1:], "float32", name="b")
    build_op = {
        "softmax": lambda: [x, topi.nn.softmax(x)],
        "log_softmax": lambda: [x, topi.nn.log_softmax(x)],
        "layer_norm": lambda: [x, g, b, topi.nn.layer_norm(x, g, b, axis=[-1])],
        "rms_norm": lambda: [x, g, topi.nn.rms_norm(x, g, axis=[-1])],
        "softmax_axis1": lambda: [x, topi.nn.softmax(x, axis=1)],
    }[name]
    return te.create_prim_func(build_op())


def assert_same_outputs(original, fused, seed: int = 0):
    """Both built for the CPU, called on the same random inputs: every buffer must agree."""
    arrays = random_params(original, seed)
    before, after = run_cpu(original, arrays), run_cpu(fused, arrays)
    worst = 0.0
    for a, b in zip(before, after, strict=True):
        err = float(np.max(np.abs(a.astype(np.float64) - b)))
        scale = float(np.max(np.abs(a)))
        assert err <= RTOL * scale, f"max error {err} vs largest value {scale}"
        worst = max(worst, err / scale)
    return worst


def block_names(func) -> list[str]:
    body = func.body.block.body
    stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    names = []
    for s in stmts:
        while isinstance(s, tirx.For):
            s = s.body
        names.append(s.block.name_hint)
    return names


# -- lifting ----------------------------------------------------------------------------------

SPECS = {
    "softmax": ["T_softmax_maxelem = max(x[i])",
                "T_softmax_expsum = sum(exp(x[i] - T_softmax_maxelem))",
                "T_softmax_norm[i] = exp(x[i] - T_softmax_maxelem)/T_softmax_expsum"],
    "log_softmax": ["T_softmax_maxelem = max(x[i])",
                    "compute = sum(exp(x[i] - T_softmax_maxelem))",
                    "compute_2[i] = x[i] - T_softmax_maxelem - log(compute)"],
    "layer_norm": ["x_sum = sum(x[i])", "x_var_sum = sum((x[i] - x_sum/128)**2)",
                   "T_layer_norm[i] = g[i]*(x[i] - x_sum/128)/sqrt(x_var_sum/128 + 1/100000)"
                   " + b[i]"],
    "rms_norm": ["T_multiply_red = sum(x[i]**2)",
                 "T_cast[i] = x[i]*g[i]/sqrt(T_multiply_red/128 + 1/100000)"],
}


@pytest.mark.parametrize("name", list(SPECS))
def test_topi_ops_lift_to_their_cascade(name):
    [group] = lift(topi_case(name))
    assert group.spec.splitlines() == SPECS[name]
    assert group.fusable, group.reason
    assert group.frame.rows == (16,) and group.frame.n == 128 and group.frame.d is None


def test_reduction_axis_in_the_middle_leaves_a_feature_axis_after_it():
    [group] = lift(topi_case("softmax_axis1", (2, 8, 16)))
    assert group.frame == Frame(rows=(2,), n=8, d=16)
    assert group.spec.splitlines()[0] == "T_softmax_maxelem = max(x[i, :])"
    x = next(a for a in group.accesses if a.name == "x")
    assert x.dims == (("row", 0), ("n",), ("d",))


# -- fusing: numbers, structure, CUDA ---------------------------------------------------------

@pytest.mark.parametrize("name", [*SPECS, "softmax_axis1"])
def test_topi_ops_fuse_and_match_the_original(name):
    func = topi_case(name, (2, 64, 48) if name == "softmax_axis1" else (16, 128))
    fused, rep = fuse(func, report=True)
    assert [g.fused for g in rep.groups] == [True], str(rep)
    assert all(n.startswith("redfuser_") for n in block_names(fused))  # producers and casts gone
    assert not fused.body.block.alloc_buffers  # every intermediate went with its blocks
    assert_same_outputs(func, fused)


def test_split_variant_inside_a_function():
    func = topi_case("softmax", (1, 8192))
    fused = fuse(func)
    assert_same_outputs(func, fused)


@needs_nvcc
@pytest.mark.parametrize("name", [*SPECS, "softmax_axis1"])
def test_fused_topi_ops_build_for_cuda(name):
    fused, rep = fuse(topi_case(name, (4, 64)), target="cuda", report=True)
    assert rep.groups[0].fused and "block per row" in rep.groups[0].reason
    build(fused, cuda_target())


@T.prim_func(s_tir=True)
def biased_softmax(x: T.Buffer((2, 3, 96), "float32"), bias: T.Buffer((2,), "float32"),
                   y: T.Buffer((2, 3, 96), "float32")):
    m = T.sblock_alloc_buffer((2, 3))
    e = T.sblock_alloc_buffer((2, 3, 96))
    s = T.sblock_alloc_buffer((2, 3))
    for b, h, k in T.grid(2, 3, 96):
        with T.sblock("row_max"):
            vb, vh, vk = T.axis.remap("SSR", [b, h, k])
            with T.init():
                m[vb, vh] = T.float32("-inf")
            m[vb, vh] = T.max(m[vb, vh], x[vb, vh, vk] + bias[vb])
    for b, h, k in T.grid(2, 3, 96):
        with T.sblock("exp"):
            vb, vh, vk = T.axis.remap("SSS", [b, h, k])
            e[vb, vh, vk] = T.exp(x[vb, vh, vk] + bias[vb] - m[vb, vh])
    for b, h, k in T.grid(2, 3, 96):
        with T.sblock("row_sum"):
            vb, vh, vk = T.axis.remap("SSR", [b, h, k])
            with T.init():
                s[vb, vh] = T.float32(0)
            s[vb, vh] = s[vb, vh] + e[vb, vh, vk]
    for b, h, k in T.grid(2, 3, 96):
        with T.sblock("normalize"):
            vb, vh, vk = T.axis.remap("SSS", [b, h, k])
            y[vb, vh, vk] = e[vb, vh, vk] / s[vb, vh]


@needs_nvcc
def test_tvmscript_softmax_with_a_materialised_exp_block():
    [group] = lift(biased_softmax)
    assert group.spec.splitlines() == [
        "m = max(x[i] + bias)", "s = sum(exp(x[i] + bias - m))",
        "y[i] = exp(x[i] + bias - m)/s"]
    assert group.consumers == ("exp", "normalize") and group.frame.rows == (2, 3)
    bias = next(a for a in group.accesses if a.name == "bias")
    assert bias.kind == "param" and bias.dims == (("row", 0),)  # broadcast over rows 1
    fused = fuse(biased_softmax)
    assert_same_outputs(biased_softmax, fused)
    build(fuse(biased_softmax, target="cuda"), cuda_target())


def attention_case(probabilities_out: bool):
    s = te.placeholder((8, 64), "float32", name="s")
    v = te.placeholder((64, 32), "float32", name="v")
    p = topi.nn.softmax(s)
    o = topi.nn.matmul(p, v)
    return te.create_prim_func([s, v, p, o] if probabilities_out else [s, v, o])


@needs_nvcc
@pytest.mark.parametrize("probabilities_out", [False, True])
def test_matmul_after_softmax_joins_the_chain_as_attention(probabilities_out):
    func = attention_case(probabilities_out)
    [group] = lift(func)
    assert group.spec.splitlines()[2] == \
        "T_matmul_NN = sum(v[i, :]*exp(s[i] - T_softmax_maxelem)/T_softmax_expsum)"
    assert group.frame.d == 32 and ("T_softmax_norm[i]" in group.spec) == probabilities_out
    fused = fuse(func)
    assert_same_outputs(func, fused)
    build(fuse(func, target="cuda"), cuda_target())


def test_matmul_before_softmax_stays_and_the_softmax_reads_its_result():
    q = te.placeholder((8, 16), "float32", name="q")
    k = te.placeholder((64, 16), "float32", name="k")
    func = te.create_prim_func([q, k, topi.nn.softmax(topi.nn.matmul(q, k, transpose_b=True))])
    fused, rep = fuse(func, report=True)
    assert [(g.values[0], g.fused) for g in rep.groups] == [
        ("T_matmul_NT", False), ("T_softmax_maxelem", True)]
    assert "single reduction" in rep.groups[0].reason
    assert block_names(fused) == ["T_matmul_NT", "redfuser_T_softmax_maxelem"]
    assert_same_outputs(func, fused)


def test_a_refused_reduction_splits_the_chain():
    a = te.placeholder((4, 32), "float32", name="a")
    func = te.create_prim_func([a, topi.nn.softmax(topi.nn.softmax(a) * 2.0)])
    fused, rep = fuse(func, report=True)
    assert [g.fused for g in rep.groups] == [True, True]
    assert "are left: NotFusable" in rep.groups[0].reason
    assert_same_outputs(func, fused)


def test_results_read_by_a_block_left_outside_are_still_written():
    x = te.placeholder((4, 64), "float32", name="x")
    w = te.placeholder((10,), "float32", name="w")
    k, k2 = te.reduce_axis((0, 64), name="k"), te.reduce_axis((0, 64), name="k2")
    m = te.compute((4,), lambda r: te.max(x[r, k], axis=k), name="m")
    d = te.compute((4,), lambda r: te.sum(te.exp(x[r, k2] - m[r]), axis=k2), name="d")
    z = te.compute((4, 10), lambda r, j: te.log(d[r]) + m[r] * w[j], name="z")  # no N axis
    func = te.create_prim_func([x, w, z])
    [group] = lift(func)
    assert group.consumers == () and all(a.needed for a in group.accesses)
    fused = fuse(func)
    assert block_names(fused) == ["redfuser_m", "z"] and len(fused.body.block.alloc_buffers) == 2
    assert_same_outputs(func, fused)


def test_keepdims_axis_is_a_constant_index():
    x = te.placeholder((4, 64), "float32", name="x")
    func = te.create_prim_func([x, x / topi.sum(x, axis=1, keepdims=True)])
    fused, rep = fuse(func, report=True)
    assert rep.groups[0].spec == "x_red = sum(x[i])\nT_divide[i] = x[i]/x_red"
    assert_same_outputs(func, fused)


# -- left unchanged, with the reason --------------------------------------------------------

def relu_chain():
    x = te.placeholder((4, 64), "float32", name="x")
    k, k2 = te.reduce_axis((0, 64), name="k"), te.reduce_axis((0, 64), name="k2")
    m = te.compute((4,), lambda r: te.max(x[r, k], axis=k), name="m")
    zero = tirx.const(0.0, "float32")
    r = te.compute((4,), lambda i: te.sum(te.max(x[i, k2] - m[i], zero), axis=k2), name="r")
    return te.create_prim_func([x, r])


def test_not_fusable_chain_is_reported_and_left_untouched():
    func = relu_chain()
    fused, rep = fuse(func, report=True)
    [entry] = rep.groups
    assert not entry.fused and entry.values == ("m", "r")
    assert entry.reason.startswith("NotFusable: reduction 'r' cannot be fused")
    assert structural_equal(fused, func)


def test_symbolic_sequence_length_is_skipped_with_the_reason():
    n = te.var("n")
    x = te.placeholder((4, n), "float32", name="x")
    func = te.create_prim_func([x, topi.nn.softmax(x)])
    fused, rep = fuse(func, report=True)
    assert "symbolic shape" in rep.groups[0].reason and "specialize" in rep.groups[0].reason
    assert structural_equal(fused, func)
    specialized = func.specialize({func.params[0]: tirx.decl_buffer((4, 64), "float32", "x")})
    assert fuse(specialized, report=True)[1].groups[0].fused


def test_irmodule_with_several_functions():
    funcs = {"softmax": topi_case("softmax", (4, 64)), "norm": topi_case("layer_norm", (4, 64)),
             "relu_chain": relu_chain()}
    mod = IRModule({k: f.with_attr("global_symbol", k) for k, f in funcs.items()})
    fused, rep = fuse(mod, report=True)
    assert isinstance(fused, IRModule)
    assert {(g.function, g.fused) for g in rep.groups} == {
        ("softmax", True), ("norm", True), ("relu_chain", False)}
    for name in funcs:  # the input module is not modified
        assert structural_equal(mod[name], funcs[name].with_attr("global_symbol", name))
    assert structural_equal(fused["relu_chain"], mod["relu_chain"])
    assert_same_outputs(mod["norm"], fused["norm"])


@T.prim_func
def no_blocks(x: T.Buffer((4,), "float32")):  # TIR without SBlocks: nothing to lift
    for i in range(4):
        x[i] = x[i] * T.float32(2)


def test_bad_input_gets_a_clear_error_or_a_report_entry():
    with pytest.raises(TypeError, match="PrimFunc or a tvm.IRModule"):
        fuse(42)
    with pytest.raises(ValueError, match="target must be"):
        fuse(topi_case("softmax"), target="metal")
    with pytest.raises(LiftError, match="expected a tvm.tirx.PrimFunc"):
        lift("m = max(x[i])")
    same, rep = fuse(no_blocks, report=True)
    assert same.same_as(no_blocks) and "no root SBlock" in rep.groups[0].reason


def test_float16_blocks_are_reported():
    x = te.placeholder((4, 64), "float16", name="x")
    func = te.create_prim_func([x, topi.nn.softmax(x)])
    fused, rep = fuse(func, report=True)
    assert fused.same_as(func) and len(rep.groups) == 2
    assert all("computes in float16" in g.reason for g in rep.groups)


def test_unsupported_expression_is_reported():
    x = te.placeholder((4, 64), "float32", name="x")
    y = te.compute((4, 64), lambda i, j: tirx.Select(x[i, j] > 0, x[i, j], x[i, j] * 2),
                   name="y")
    func = te.create_prim_func([x, topi.nn.softmax(y)])
    [group] = lift(func)
    assert group.blocks == ("T_softmax_maxelem", "T_softmax_expsum")
    assert not group.fusable and "unsupported TIR expression" in group.reason
    assert fuse(func).same_as(func)


def test_a_rewrite_that_computes_something_else_is_rejected(monkeypatch):
    """verify=True runs both versions: a fused block that writes nothing must be refused."""
    func = topi_case("softmax", (4, 64))
    assert check_numeric(func, fuse(func)) == ""
    monkeypatch.setattr(rewrite_module, "rewrite_group", lambda f, g, *a: (
        splice(f, g, tirx.Evaluate(tirx.const(0, "int32"))), "empty"))
    fused, rep = fuse(func, report=True, verify=True)
    assert fused.same_as(func) and "parameter 1 differs" in rep.groups[0].reason
