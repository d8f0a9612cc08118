"""A per-row loss reduced over the rows, its gradients computed in its forward: an LM head
and its cross-entropy in three matrix products instead of four.

``reduced(spec, "loss", "mean")`` registers ``torch.ops.redfuser.<name>_<reduction>``: the
inputs of the cascade in, the mean (or sum) of its per-row output ``loss`` out, a 0-d
tensor.  Where the rule's backward runs through the scores (``algebra.backward_scores``:
``dot(h, w[i, :])`` over a vocabulary) and an input requires grad, the forward takes the
rows a chunk at a time and, on the chunk's scores (``h @ w.T``, the one product the
forward needs), runs the forward's reductions (``forward_on_scores``: lse and the loss,
from the scores already computed), the backward's block map with the upstream the
reduction gives each row (1 / rows for a mean, 1 for a sum), and the gradients' products
(``C @ w`` into dh, ``C.T @ h`` added into dw, chunk after chunk in a fixed order: two runs
give the same bits).  The backward multiplies them by the upstream of the reduced loss,
and hands them over as they are where that is exactly 1 (``loss.backward()``, eager).  The
op's backward, which knows only its per-row upstream, must instead multiply the scores out
again: four products.  Liger-Kernel's fused linear cross-entropy does the same by hand.

The forward pays for the gradients (two of its three products) wherever grad mode is on
and an input requires grad, whether or not a backward follows: evaluate under
``torch.no_grad()``, where it multiplies the scores out and reduces them alone.

Memory: a chunk's scores and coefficients hold as many elements as ``h`` each (the rows of
a chunk: ``h.numel() // vocabulary``), so the forward holds two of them besides the
gradients; the rows x vocabulary logits never exist.  Under ``torch.compile`` the backward
always multiplies (the check of the upstream is data-dependent): one more dw of memory.
bfloat16 and float16 inputs are computed in float32 (``h`` and ``w`` converted once a
call: a float32 copy of the head), their gradients rounded once to their dtype, the loss
float32.
"""

from __future__ import annotations

import re

import torch

from algebra import FusionRule, derive
from algebra.backward_scores import ThroughScores, forward_on_scores, through_scores

from .kernel import Kernel, compile
from .torch import NAMESPACE, _input_order
from .torch_shapes import output_specs

# reduction -> the upstream of each row's loss, given the number of rows (torch's mean of
# no rows is NaN)
REDUCTIONS = {"mean": lambda rows: 1.0 / rows if rows else float("nan"),
              "sum": lambda rows: 1.0}


def reduced(spec_or_rule: FusionRule | str, output: str = "loss", reduction: str = "mean",
            name: str | None = None, scalars: tuple[str, ...] = (), **options):
    """The cascade's per-row ``output`` reduced over the rows, as a differentiable torch op
    whose forward computes the gradients (module docstring).

    Parameters
    ----------
    spec_or_rule : FusionRule or str
        a library name, a spec, or a derived rule, whose backward of ``output`` runs
        through one score: a per-row vector against a stream the rows share.
    output : str
        the per-row result to reduce; the rows are every axis of the per-row vector but
        its last (a batch of sequences' tokens), and a value per row has their shape.
    reduction : str
        "mean" (over all rows) or "sum".
    name : str
        the op's name (default: the rule's, then ``_<reduction>``).
    scalars : tuple of str
        parameters given as Python floats.
    **options
        go to ``redfuser.compile`` for the kernels.

    Returns
    -------
    callable
        ``(*inputs) -> 0-d tensor``, inputs in the spec's order (``.inputs``).

    Examples
    --------
    >>> import math, torch
    >>> from redfuser.torch_loss import reduced
    >>> lce = reduced("linear_cross_entropy")
    >>> lce.inputs
    ('h', 'w', 'label')
    >>> h, w = torch.zeros(3, 4, requires_grad=True), torch.zeros(5, 4, requires_grad=True)
    >>> loss = lce(h, w, torch.tensor([0.0, 1.0, 4.0]))
    >>> abs(float(loss) - math.log(5)) < 1e-6
    True
    >>> loss.backward(); float(h.grad.abs().max()), tuple(w.grad.shape)
    (0.0, (5, 4))
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)}, not {reduction!r}")
    rule = spec_or_rule if isinstance(spec_or_rule, FusionRule) else derive(spec_or_rule)
    name = f"{name or rule.name}_{reduction}"
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"op name {name!r} must be a Python identifier")
    plan = _Plan.of(rule, output, options)
    return _ReducedLoss(plan, reduction, _input_order(rule), set(scalars), name)


class _Plan:
    """What the forward runs: the score's product, the forward on the scores and the
    backward's block map (kernels), and the gradients its terms give."""

    def __init__(self, t: ThroughScores, b, forward: str, output: str, options: dict):
        ((self.score, (self.vector, self.shared)),) = t.scores.items()
        self.t, self.output, self.upstream = t, output, b.upstream[output]
        self.gradients = {i: g for i, (g, _) in b.gradients.items()
                          if g in {x.gradient for x in t.terms}}  # input -> its gradient
        self.forward: Kernel = compile(forward, **{**options, "dynamic": True})
        self.block: Kernel = compile(t.block, **{**options, "dynamic": True})

    @staticmethod
    def of(rule: FusionRule, output: str, options: dict) -> _Plan:
        """The plan, or a ValueError saying why there is none."""
        if output not in rule.outputs:
            raise ValueError(f"{output!r} is not an output of the spec; its outputs are "
                             f"{list(rule.outputs)}")
        b = rule.backward((output,))
        t = through_scores(b)
        forward = why = None
        if t is None or len(t.scores) != 1:
            why = "its backward does not run through one score (redfuser derive --backward)"
        elif (forward := forward_on_scores(b, t)) is None:
            why = "its forward reads a vector outside the scores"
        elif output not in derive(forward).outputs:
            why = f"{output!r} is not a per-row result"
        if why is not None:
            raise ValueError(f"{rule.name or 'the spec'}: no reduced loss: {why}")
        return _Plan(t, b, forward, output, options)


class _ReducedLoss:
    """The registered op and its call (``reduced``): the inputs, then whether each one's
    gradient is wanted, in; the reduced loss, then each input's gradient (empty where not
    wanted), out."""

    def __init__(self, plan: _Plan, reduction: str, inputs: tuple, scalars: set, name: str):
        self.plan, self.reduction, self.inputs, self.name = plan, reduction, inputs, name
        args = ", ".join(f"{'float' if n in scalars else 'Tensor'} {n}" for n in inputs)
        wants = ", ".join(f"bool want_{n}" for n in inputs)
        outs = ", ".join("Tensor" for _ in range(len(inputs) + 1))
        self.op = torch.library.custom_op(f"{NAMESPACE}::{name}", self._real, mutates_args=(),
                                          schema=f"({args}, {wants}) -> ({outs})")
        self.op.register_fake(self._fake)
        self.op.register_autograd(self._backward, setup_context=self._save)

    def __call__(self, *args) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        wants = [grad and isinstance(v, torch.Tensor) and v.requires_grad for v in args]
        for n, w in zip(self.inputs, wants, strict=True):
            if w and n not in self.plan.gradients:
                raise ValueError(f"{self.name}: the gradient of {n} does not run through "
                                 "the scores; differentiate it with the cascade's op "
                                 "(redfuser.torch.op)")
        return self.op(*args, *wants)[0]

    def _real(self, *args):
        n = len(self.inputs)
        values = {k: v.detach() if isinstance(v, torch.Tensor) else v
                  for k, v in zip(self.inputs, args[:n], strict=True)}
        wanted = {k for k, w in zip(self.inputs, args[n:], strict=True) if w}
        run = _Forward(self, values)
        loss, grads = run.loss(wanted)
        return (loss, *(grads[k] if k in grads else run.h.new_empty(0) for k in self.inputs))

    def _fake(self, *args):
        n = len(self.inputs)
        h = args[self.inputs.index(self.plan.vector)]
        acc = torch.promote_types(h.dtype, torch.float32)
        return (h.new_empty((), dtype=acc),
                *(v.new_empty(v.shape) if w else h.new_empty(0, dtype=acc)
                  for v, w in zip(args[:n], args[n:], strict=True)))

    @staticmethod
    def _save(ctx, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(*output[1:])
        ctx.mark_non_differentiable(*output[1:])
        # the gradient outputs get no upstream: None, not zeros of dw's size
        ctx.set_materialize_grads(False)

    def _backward(self, ctx, g, *_) -> tuple:
        """The forward's gradients times the loss's upstream ``g``; as they are where ``g``
        is 1 (eager: torch's AccumulateGrad then takes them without a copy)."""
        grads = ctx.saved_tensors
        if torch.compiler.is_compiling() or not bool(g == 1):
            grads = tuple(x * g if x.numel() else x for x in grads)
        needs = ctx.needs_input_grad[:len(self.inputs)]
        return (*(x if need else None for x, need in zip(grads, needs, strict=True)),
                *(None for _ in self.inputs))


class _Forward:
    """One call's forward, a chunk of rows at a time (module docstring)."""

    def __init__(self, loss: _ReducedLoss, values: dict):
        self.reduction, self.plan, self.values = loss.reduction, loss.plan, values
        h, w = values[self.plan.vector], values[self.plan.shared]
        if h.dim() < 2 or w.dim() != 2 or h.shape[-1] != w.shape[1]:
            raise ValueError(f"{loss.name}: {self.plan.vector} must be (..., D) and "
                             f"{self.plan.shared} (positions, D) with one D, not "
                             f"{tuple(h.shape)} and {tuple(w.shape)}")
        self.acc = torch.promote_types(h.dtype, torch.float32)
        self.h, self.w = h.reshape(-1, h.shape[-1]).to(self.acc), w.to(self.acc)
        self.rows, self.positions = self.h.shape[0], w.shape[0]
        # a value per row (a batch x tokens label) laid out as h's rows are
        self.row_values = {n: v.reshape(-1) for n, v in values.items()
                           if isinstance(v, torch.Tensor) and v.shape == h.shape[:-1]}

    def loss(self, wanted: set[str]) -> tuple[torch.Tensor, dict]:
        """The reduced loss and the wanted gradients, in their inputs' dtypes."""
        chunk = max(1, self.h.numel() // max(1, self.positions))
        scale = REDUCTIONS[self.reduction](self.rows)
        grads = {n: torch.zeros(self._laid_shape(n), dtype=self.acc) for n in wanted}
        scores = torch.empty(min(chunk, self.rows) * self.positions, dtype=self.acc)
        total = torch.zeros((), dtype=torch.float64)
        for start in range(0, self.rows, chunk):
            rows = slice(start, min(self.rows, start + chunk))
            s = scores[:(rows.stop - start) * self.positions].view(-1, self.positions)
            torch.mm(self.h[rows], self.w.T, out=s)
            results = self._run(self.plan.forward, rows, {self.plan.score: s})
            total += results[self.plan.output].double().sum()
            if grads:
                self._add_gradients(s, rows, results, scale, grads)
        return (total * scale).to(self.acc), {n: self._as_input(n, g) for n, g in grads.items()}

    def _per_row(self, name: str) -> bool:
        """A gradient the terms give per row: a per-row scalar's (a learned softcap)."""
        return any(t.rows and not t.vector for t in self.plan.t.terms
                   if t.gradient == self.plan.gradients[name])

    def _laid_shape(self, name: str) -> tuple:
        """A gradient's shape as the chunks add to it: h's rows', a value per row's, or
        the input's own (w)."""
        if self._per_row(name):
            return (self.rows,)
        return tuple(self.h.shape) if name == self.plan.vector else \
            tuple(self.values[name].shape)

    def _as_input(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """The gradient in its input's shape and dtype: a per-row one summed over the rows
        the input is shared by."""
        v = self.values[name]
        if self._per_row(name) and name not in self.row_values:
            g = g.sum_to_size(v.shape) if v.dim() else g.sum()
        return g.to(v.dtype).reshape(v.shape)

    def _run(self, kernel: Kernel, rows: slice, given: dict) -> dict:
        """``kernel`` on these rows: ``given`` as they are, a value per row (``row_values``)
        sliced to the rows, any other input (a number, a tensor the rows share) as it is;
        outputs in tensors torch allocates."""
        c = kernel.rule.cascade
        args = {}
        for x in (*c.streams, *c.params):
            if x.name in given or x.name not in self.row_values:
                args[x.name] = given.get(x.name, self.values.get(x.name))
            else:
                args[x.name] = self.row_values[x.name][rows]
        out = {n: torch.empty(shape, dtype=dtype)
               for n, (shape, dtype) in output_specs(kernel.rule, args).items()}
        kernel(**args, out=out)
        return out

    def _add_gradients(self, s, rows: slice, results: dict, scale: float, grads: dict) -> None:
        """The block map on the chunk's scores, each row's upstream ``scale``; each wanted
        gradient's term: dh's rows (C @ w), dw (C.T @ h, added), a per-row scalar's sums."""
        t = self.plan.t
        given = {n: results[n] for n in t.reads if n in results}
        given |= {self.plan.upstream: scale, self.plan.score: s, t.first: 0.0,
                  t.length: float(self.positions)}
        coefficients = self._run(self.plan.block, rows, given)
        of = {g: n for n, g in self.plan.gradients.items()}
        for term in t.terms:
            n = of[term.gradient]
            if n not in grads:
                continue
            x = coefficients[term.coefficient]
            if term.rows and term.vector:
                grads[n][rows] += x @ self.w
            elif term.rows:
                grads[n][rows] += x.sum(-1)
            else:
                grads[n].addmm_(x.T, self.h[rows])
