"""Built-in cascades, one entry each: name -> (spec, what it is)."""

from __future__ import annotations

import difflib

import numpy as np

from .errors import SpecError

_SOFTMAX = "m = max(x[i])\nd = sum(exp(x[i] - m))\n"
_ATTENTION = "m = max(s)\nd = sum(exp(s - m))\no = sum(exp(s - m) * v[i, :]) / d"

LIBRARY: dict[str, tuple[str, str]] = {
    "softmax": (_SOFTMAX + "y[i] = exp(x[i] - m) / d",
                "safe softmax: running max, rescaled denominator, normalised values"),
    "logsumexp": ("m = max(x[i])\nc = where(isinf(m), 0, m)\nlse = log(sum(exp(x[i] - c))) + c",
                  "log-sum-exp with the max subtracted, clamped to 0 where it is infinite "
                  "(torch's convention: a row with +inf gives +inf, a row of -inf or an empty "
                  "row -inf)"),
    "log_softmax": ("m = max(x[i])\nlse = log(sum(exp(x[i] - m))) + m\ny[i] = x[i] - lse",
                    "log-softmax (cross-entropy's first half)"),
    "cross_entropy": ("m = max(x[i])\nlse = log(sum(exp(x[i] - m))) + m\n"
                      "loss = lse - sum(x[i] * t[i])",
                      "cross-entropy against a (soft or one-hot) target row t"),
    "attention": ("s = dot(q, k[i, :]) * scale\n" + _ATTENTION,
                  "one query row against keys and values: the online-softmax rule"),
    "causal_attention": ("s = where(i <= pos, dot(q, k[i, :]) * scale, -inf)\nm = max(s)\n"
                         "d = sum(where(i <= pos, exp(s - m), 0))\n"
                         "o = sum(where(i <= pos, exp(s - m) * v[i, :], 0)) / d",
                         "attention of the query at position pos: keys i > pos are masked by "
                         "selects, so inf/NaN in masked keys or values never reach the result "
                         "(as written, exp(-inf - m) * v would be 0 * v, NaN for a NaN v; "
                         "and a fully masked row gives d = 0, o = 0/0 = NaN)"),
    "variance": ("mean = sum(x[i]) / N\nvar = sum((x[i] - mean)**2) / N",
                 "mean and (population) variance, anchored at the running mean"),
    "layernorm": ("mean = sum(x[i]) / N\nvar = sum((x[i] - mean)**2) / N\n"
                  "y[i] = (x[i] - mean) / sqrt(var + eps) * g[i] + b[i]",
                  "LayerNorm over the stream: statistics in one pass, then normalise"),
    "rmsnorm": ("r = sqrt(sum(x[i]**2) / N + eps)\ny[i] = x[i] / r * g[i]",
                "RMSNorm"),
    "rmsnorm_gemm": ("r = sqrt(sum(x[i]**2) / N + eps)\ny = sum(x[i] / r * w[i, :])",
                     "RMSNorm followed by a GEMM: 1/r moves out of the dot product"),
    "moe_routing": (_SOFTMAX + "p = topk(exp(x[i] - m) / d, 8)\n"
                               "e = argtopk(exp(x[i] - m) / d, 8)",
                    "MoE router: softmax over experts, then the top-8 probabilities and ids"),
    "greedy_token": (_SOFTMAX + "p = max(exp(x[i] - m) / d)\ntoken = argmax(x[i])",
                     "greedy decoding: the most likely token and its probability"),
    "linear_cross_entropy": ("s = dot(h, w[i, :])\nm = max(s)\nlse = log(sum(exp(s - m))) + m\n"
                             "loss = lse - sum(where(i == label, s, 0))",
                             "the LM head and its loss against a label index, without the "
                             "rows x V logits: the vocabulary is the stream, the head's rows "
                             "w[i, :] its elements"),
    "softmax_entropy": ("m = max(x[i])\nd = sum(exp((x[i] - m) / T))\n"
                        "h = log(d) - sum((x[i] - m) / T * exp((x[i] - m) / T)) / d",
                        "temperature softmax and its entropy (a rank-2 re-anchoring)"),
    "softmin_average": ("m = min(x[i])\nd = sum(exp(m - x[i]))\n"
                        "y = sum(exp(m - x[i]) * v[i, :]) / d",
                        "soft-min weighted average of value rows"),
    "softmax_moments": (_SOFTMAX + "mu = sum(exp(x[i] - m) * x[i]) / d\n"
                                   "var = sum(exp(x[i] - m) / d * (x[i] - mu)**2)",
                        "three levels: softmax, its mean logit, the variance around it"),
    "l2_normalize": ("r = sqrt(sum(x[i]**2))\ny[i] = x[i] / r", "divide by the L2 norm"),
    "geometric_mean": ("m = max(x[i])\ng = prod(exp((x[i] - m) / N)) * exp(m)",
                       "geometric mean of exp(x) with the max factored out of the product"),
    # row-resident cascades: no one-pass rule exists, so they are derived in stages
    "mad": ("mu = sum(x[i]) / N\nmad = sum(abs(x[i] - mu)) / N",
            "mean absolute deviation (two passes: |x - mu| has a kink at the running mean)"),
    "relu_sum": ("m = max(x[i])\ns = sum(relu(x[i] - m + t))",
                 "how far the elements within t of the max reach above max - t (two passes: "
                 "the kink of relu moves with the running max)"),
    "threshold_mass": (_SOFTMAX + "mass = sum(where(exp(x[i] - m) / d >= t, exp(x[i] - m), 0))"
                                  " / d",
                       "softmax mass of the tokens of probability >= t (what min-p / "
                       "threshold sampling keeps; the exact top-p set needs a sort): two "
                       "passes, the threshold moves with the running max and denominator"),
}
STAGED = frozenset({"mad", "relu_sum", "threshold_mass"})  # derived with passes="auto"


def resolve_spec(spec: str) -> str:
    """A library name -> its spec text; anything else is taken as spec text, except a lone
    word, which can only have been meant as a library name.

    Examples
    --------
    >>> resolve_spec("logsumexp").splitlines()[0]
    'm = max(x[i])'
    >>> resolve_spec("softmx")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    algebra.errors.SpecError: line 1, column 1: 'softmx' is not a library cascade (did you mean...
    """
    if not isinstance(spec, str):
        return spec  # the parser names what it is instead
    word = spec.strip()
    if word in LIBRARY:
        return LIBRARY[word][0]
    if word.isidentifier():
        near = difflib.get_close_matches(word, LIBRARY, n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else " (see redfuser.LIBRARY)"
        raise SpecError(f"'{word}' is not a library cascade{hint}; a spec assigns, e.g. "
                        "'m = max(x[i])'", 1, spec.index(word[0]) + 1)
    return spec


def example_inputs(name: str, n: int = 64, rows: tuple = (4,), d: int = 16, seed: int = 0):
    """Random float32 inputs of the right shapes for a library cascade.

    Examples
    --------
    >>> {k: v.shape for k, v in example_inputs("attention", n=8, rows=(2, 3), d=4).items()
    ...  if hasattr(v, "shape")}
    {'q': (2, 3, 4), 'k': (2, 1, 8, 4), 'v': (2, 1, 8, 4)}
    >>> example_inputs("causal_attention", n=8, rows=(2, 3), d=4)["pos"]
    array([[0., 1., 2.]], dtype=float32)
    """
    g = np.random.default_rng(seed)

    def normal(*shape):
        return g.normal(size=shape).astype(np.float32)

    if name in ("attention", "causal_attention"):
        lead = rows[:-1] or (1,)
        out = {"q": normal(*rows, d), "k": normal(*lead, 1, n, d), "v": normal(*lead, 1, n, d),
               "scale": d ** -0.5}
        if name == "causal_attention":  # query l sits at position l (torch's is_causal)
            out["pos"] = np.arange(rows[-1], dtype=np.float32).reshape(1, rows[-1])
        return out
    if name == "linear_cross_entropy":  # label: an index into the vocabulary, as a float
        return {"h": normal(*rows, d), "w": normal(n, d) / d ** 0.5,
                "label": g.integers(0, max(n, 1), rows).astype(np.float32)}
    extra = {
        "layernorm": lambda: {"g": normal(*rows, n), "b": normal(*rows, n), "eps": 1e-5},
        "rmsnorm": lambda: {"g": normal(n), "eps": 1e-5},
        "rmsnorm_gemm": lambda: {"w": normal(n, d), "eps": 1e-5},
        "cross_entropy": lambda: {"t": np.eye(n, dtype=np.float32)[g.integers(0, max(n, 1),
                                                                             rows) % max(n, 1)]
                                  if n else np.zeros((*rows, 0), np.float32)},
        "softmax_entropy": lambda: {"T": 0.7},
        "softmin_average": lambda: {"v": normal(*rows, n, d)},
        "relu_sum": lambda: {"t": 1.0},
        "threshold_mass": lambda: {"t": 0.5 / max(n, 1)},
    }
    return {"x": normal(*rows, n), **extra.get(name, dict)()}
