"""Generated specs and cascades, re-exported by ``tests.support``: the spec-language fuzzer's
strategies (tests/algebra/test_fuzz.py) and cascades nobody wrote with their inputs and the
float32 sensitivity they are held to (tests/lowering/, tests/algebra/test_backward.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import redfuser

# -- generated specs (the spec-language fuzzer) ---------------------------------------------

_STREAMS = ("x[i]", "y[i]")
_PARAMS = ("a", "b")
_RESULTS = ("r0", "r1", "r2")  # statement k assigns _RESULTS[k]
_CONSTANTS = ("2", "3", "0.5", "1", "-1", "N", "i", "pi")
_UNARY = ("exp", "log", "sqrt", "abs", "tanh", "sigmoid", "relu")
_BINARY_FUNCTIONS = ("pow", "maximum", "dot")
_UNKNOWN = ("foo", "softmax", "expp", "mean", "Exp")
_REDUCTIONS = ("sum", "sum", "max", "min", "prod", "argmax")
_K_REDUCTIONS = ("topk", "argtopk")
_GARBAGE = "$?!@`{}[]()#:;,=.'\"\\\n\t x"
# Any text but NUL and lone surrogates: each is an engine bug with its own test in
# tests/algebra/test_fuzz.py (test_unreadable_characters_are_positioned_spec_errors) that would
# otherwise be all the text fuzzers ever report (hypothesis shrinks strings towards exactly
# these characters).
TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
               max_size=60)


_ANCHORED = ("exp(x[i] - {r})", "(x[i] - {r})**2", "x[i] * {r}", "exp({r} - x[i])",
            "x[i] / {r}", "exp(x[i] - {r}) * y[i]", "(x[i] - {r})**3", "exp((x[i] - {r}) / a)")


@st.composite
def expressions(draw, depth: int, n_results: int) -> str:
    """A random expression over streams, parameters, constants and the first ``n_results``
    of _RESULTS (the earlier statements' results)."""
    defined = _RESULTS[:n_results]
    if draw(st.integers(0, 49)) == 0:  # now and then: a result not defined yet, or a cycle
        leaf = st.sampled_from(_RESULTS)
    else:
        leaf = st.sampled_from(["x[i]"] * 4 + ["y[i]", *_PARAMS, *_CONSTANTS] + list(defined) * 3)
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(leaf)
    sub = expressions(depth - 1, n_results)
    kinds = ["unary"] * 3 + ["op"] * 4 + ["power", "binary", "binary", "neg"] + \
        ["anchored"] * (4 if defined else 0)
    rare = draw(st.integers(0, 39))  # 1 in 40 nodes: an unknown function, 1 in 40 a reduction
    kind = "unknown" if rare == 0 else "reduction" if rare == 1 else draw(st.sampled_from(kinds))
    if kind == "anchored":  # an earlier result inside a stream expression: re-anchoring
        return draw(st.sampled_from(_ANCHORED)).format(r=draw(st.sampled_from(defined)))
    if kind == "unary":
        return f"{draw(st.sampled_from(_UNARY))}({draw(sub)})"
    if kind == "op":
        return f"({draw(sub)} {draw(st.sampled_from('+-*/'))} {draw(sub)})"
    if kind == "power":
        return f"{draw(sub)}**{draw(st.sampled_from(['2', '3', '0.5', '-1']))}"
    if kind == "binary":
        fn = draw(st.sampled_from(_BINARY_FUNCTIONS))
        if fn == "dot":  # feature-axis operands: streams x[i, :] or parameters
            args = draw(st.lists(st.sampled_from(["x[i, :]", "y[i, :]", "a[:]", "a", "x[i]"]),
                                 min_size=2, max_size=2))
            return f"dot({args[0]}, {args[1]})"
        return f"{fn}({draw(sub)}, {draw(sub)})"
    if kind == "neg":
        return f"-{draw(sub)}"
    if kind == "reduction":  # nested in a body: a SpecError; in an epilogue: a hidden result
        return f"{draw(st.sampled_from(_REDUCTIONS))}({draw(sub)})"
    return f"{draw(st.sampled_from(_UNKNOWN))}({draw(sub)})"


@st.composite
def statements(draw, k: int) -> str:
    target = _RESULTS[k]
    body = draw(expressions(draw(st.integers(1, 3)), k))
    kind = draw(st.sampled_from(["reduce", "reduce", "reduce", "reduce_k", "let", "element"]))
    if kind == "reduce":
        return f"{target} = {draw(st.sampled_from(_REDUCTIONS))}({body})"
    if kind == "reduce_k":
        k_arg = draw(st.sampled_from(["1", "2", "3", "0", "a"]))
        return f"{target} = {draw(st.sampled_from(_K_REDUCTIONS))}({body}, {k_arg})"
    if kind == "let":
        return f"{target} = {body}"
    return f"{target}[i] = {body}"


@st.composite
def specs(draw) -> str:
    """Random cascades (1-3 statements), sometimes mangled into invalid syntax or garbage."""
    n = draw(st.integers(1, 3))
    text = draw(st.sampled_from(["\n", "; "])).join(draw(statements(k)) for k in range(n))
    mangle = draw(st.sampled_from(["none"] * 20 + ["insert", "delete", "truncate", "text"]))
    if mangle == "insert":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.text(_GARBAGE, min_size=1, max_size=3)) + text[at:]
    elif mangle == "delete" and text:
        at = draw(st.integers(0, len(text) - 1))
        text = text[:at] + text[at + 1:]
    elif mangle == "truncate":
        text = text[:draw(st.integers(0, len(text)))]
    elif mangle == "text":
        text = draw(TEXT)
    return text


def make_inputs(rule, rng: np.random.Generator, rows: int = 2, n: int = 5, d: int = 3):
    """float64 inputs in [0.5, 1.5] (positive, so that most bodies stay inside their functions'
    domains; where one leaves it, fused and reference must agree on the NaN); streams (rows, N)
    or (rows, N, D), parameters (rows,) or (rows, D).  N = 5, D = 3 and rows = 2 differ, so no
    input can be read two ways."""
    cascade = rule.cascade
    inputs = {}
    for s in cascade.streams:
        vec = s.name in cascade.vector_inputs
        inputs[s.name] = rng.uniform(0.5, 1.5, (rows, n, d) if vec else (rows, n))
    for p in cascade.params:
        vec = p.name in cascade.vector_inputs
        inputs[p.name] = rng.uniform(0.5, 1.5, (rows, d) if vec else (rows,))
    return inputs


# -- generated cascades (kernels for cascades nobody wrote: tests/lowering/) ------------------

# First-level reductions, each tagged with what its result bounds: "max" results bound x
# from above, "min" from below, "any" neither.
_FIRST = (("max(x[i])", "max"), ("min(x[i])", "min"), ("sum(x[i]) / N", "any"),
         ("sum(exp(x[i]))", "any"), ("sum(x[i]**2)", "any"), ("max(abs(x[i]))", "any"),
         ("sum(tanh(x[i]) * y[i])", "any"), ("min(sigmoid(x[i]))", "any"),
         ("sum(x[i] * y[i])", "any"), ("sum(exp(x[i] / a))", "any"))
# Bodies anchored at an earlier result r, by the bound r must give.  An exponential is only
# re-anchored at a result that bounds its exponent (the online-softmax condition): at any other
# anchor the one-pass state under- or overflows float32 where the multi-pass form does not
# (``sum(exp(x - min(exp(x))))`` loses every term folded before the minimum arrives).
_ANCHORED_BY_BOUND = {
    "any": ("(x[i] - {r})**2", "x[i] * {r}", "(x[i] - {r})**3", "y[i] * (x[i] - {r})",
            "x[i] - {r}", "abs(x[i]) * {r}", "sin(x[i] - {r})", "cos(x[i] - {r}) * y[i]"),
    "max": ("exp(x[i] - {r})", "exp(x[i] - {r}) * y[i]", "exp((x[i] - {r}) / a)",
            "exp(x[i] - {r}) * x[i]", "pow(2, x[i] - {r})"),
    "min": ("exp({r} - x[i])", "exp({r} - x[i]) * y[i]")}
_VECTOR = {"any": ("(x[i] - {r}) * v[i, :]", "v[i, :] * {r}"),
          "max": ("exp(x[i] - {r}) * v[i, :]",), "min": ("exp({r} - x[i]) * v[i, :]",)}
_SUM_LIKE = ("sum", "sum", "sum", "max", "min")
_EPILOGUES = ("{s}", "{s} / {r}", "{s} * {r}")
# log only of sums of positive terms: the log of a sum that cancels to about 0 is NaN or not
# by the sign of a rounding error, in float32 and float64 alike
_LOG_EPILOGUE = "log({s}) + {r}"
_POSITIVE = ("exp(x[i] - @", "exp((x[i] - @", "exp(@")
_ELEMENTWISE = ("exp(x[i] - {r})", "(x[i] - {r}) * {s}", "x[i] / {r}")
_SELECTIONS = ("max(exp(x[i] - {r}))", "argmax(x[i] - {r})", "topk(x[i] * 2 - {r}, 2)",
              "argmin(x[i])")
_SENSITIVITY_ULPS = 4
SAFETY = 50


@st.composite
def anchored(draw, table: dict, results: list) -> str:
    """A body from ``table`` anchored at one of ``results`` [(name, bound)]."""
    name, bound = draw(st.sampled_from(results))
    options = table["any"] + (table[bound] if bound != "any" else ())
    return draw(st.sampled_from(options)).format(r=_use(name))


def _use(name: str) -> str:
    """A use of result ``name`` (rK), rendered by ``_render``."""
    return f"@{name[1:]}"


def _render(text: str, twin: bool) -> str:
    """The spec, or its twin where each use of rK is rK * (1 + uK) (uK: a per-row input)."""
    for k in range(4):
        text = text.replace(f"@{k}", f"(r{k} * (1 + u{k}))" if twin else f"r{k}")
    return text


@st.composite
def cascades(draw) -> tuple[str, str]:
    """A random chain: r0 from the streams, r1.. anchored at earlier results, maybe an
    epilogue, a vector sum, a selection or a per-element output at the end.  Returns the
    spec and its twin (see ``_render``)."""
    first, bound = draw(st.sampled_from(_FIRST))
    lines, results = [f"r0 = {first}"], [("r0", bound)]
    for k in range(1, draw(st.integers(1, 3))):
        op = draw(st.sampled_from(_SUM_LIKE))
        red = f"{op}({draw(anchored(_ANCHORED_BY_BOUND, results))})"
        if op == "sum":
            positive = red.startswith(tuple(f"sum({p}" for p in _POSITIVE)) and \
                ") * x[i]" not in red
            form = draw(st.sampled_from(_EPILOGUES + ((_LOG_EPILOGUE,) if positive else ())))
            red = form.format(s=red, r=_use(draw(st.sampled_from([n for n, _ in results]))))
        lines.append(f"r{k} = {red}")
        results.append((f"r{k}", "any"))
    last, first_bound = results[-1][0], results[0][1]
    extra = draw(st.sampled_from(["none", "vector", "selection", "element"]))
    if extra == "vector":
        lines.append(f"o = sum({draw(anchored(_VECTOR, results))})")
    elif extra == "selection":
        lines.append(f"p = {draw(st.sampled_from(_SELECTIONS)).format(r=_use('r0'))}")
    elif extra == "element" and first_bound == "max":
        lines.append("e[i] = " + draw(st.sampled_from(_ELEMENTWISE)).format(r=_use("r0"),
                                                                            s=_use(last)))
    text = "\n".join(lines)
    return _render(text, False), _render(text, True)



def cascade_inputs(rule, rng: np.random.Generator, rows: tuple, n: int, d: int) -> dict:
    """float32 inputs: x ~ N(0, 1.5) (signs both ways), y and a in [0.5, 1.5] (positive, so
    ``exp(x / a)`` stays finite), v ~ N(0, 1) rows of D features."""
    cascade, inputs = rule.cascade, {}
    for s in cascade.streams:
        shape = (*rows, n, d) if s.name in cascade.vector_inputs else (*rows, n)
        inputs[s.name] = (rng.normal(0, 1.5, shape) if s.name == "x" else
                          rng.uniform(0.5, 1.5, shape)).astype(np.float32)
    for p in cascade.params:
        inputs[p.name] = rng.uniform(0.5, 1.5, rows).astype(np.float32)
    return inputs


def sensitivity(spec: str, twin: str, inputs: dict, rows: tuple,
                rng: np.random.Generator) -> dict:
    """|twin(inputs * (1 + delta), u = +-delta) - ref(inputs)| with |delta| about
    _SENSITIVITY_ULPS float32 ulps: the error any float32 computation of this cascade, which
    rounds its inputs and every intermediate result, can be expected to have."""
    eps = _SENSITIVITY_ULPS * float(np.finfo(np.float32).eps)
    moved = {k: np.asarray(v, np.float64) * (1 + eps * rng.choice([-1.0, 1.0], np.shape(v)))
             for k, v in inputs.items()}
    moved.update({f"u{k}": eps * rng.choice([-1.0, 1.0], rows) for k in range(4)
                  if f"u{k}" in twin})
    base = redfuser.reference(spec, inputs)
    other = redfuser.reference(twin, moved)
    out, shaky = {}, np.zeros(rows, bool)  # rows where an earlier result has no stable digit
    with np.errstate(invalid="ignore"):
        for k in base:
            diff = np.abs(other[k] - base[k])
            same = (np.isnan(other[k]) == np.isnan(base[k])) & (np.isinf(other[k]) ==
                                                                  np.isinf(base[k]))
            # inf where a few ulps flip the reference itself to or from NaN/inf (the log of
            # a sum that cancels to about 0), or move it by half its own size or more (a
            # ratio over such a sum: no digit, sign or finiteness of it survives float32):
            # no float32 computation can be held to it there
            kept = same & ~(diff > 0.5 * np.abs(base[k]))
            # a later result reading an unstable one is unstable too, even where the twin,
            # which perturbs both alike, keeps it (sum(x - mean) / sum(x - mean))
            kept = kept & ~shaky.reshape(shaky.shape + (1,) * (kept.ndim - shaky.ndim))
            shaky = shaky | ~kept.reshape(rows + (-1,)).all(axis=-1)
            out[k] = np.where(kept, np.nan_to_num(diff, nan=0.0, posinf=0.0), np.inf)
    return out
