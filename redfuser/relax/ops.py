"""How each Relax op lifts into the spec language: one table entry per op.

``OPS`` maps a Relax op name to its handler.  Elementwise ops are two templates tables;
statistics ops (softmax, layer_norm, ...) are step tables; matmul, topk, where, gather and
the shape ops have small handlers.  A reduction reads its data as rows x stream
(``axes.py``: any set of axes, the trailing ones in place, others through a permutation).
"""

from __future__ import annotations

import dataclasses
from string import Formatter

from .attention import attention
from .axes import VIEWS, View, axes_view, read_data, read_weight, weight_shape
from .frag import Unliftable, computed, fit, merge
from .idioms import safe_softmax
from .products import matmul
from .values import MAX_TERMS, Ext, Lifting, Node, Operand, literal, static_shape

UNARY = {  # Relax op -> spec template of its operand {0}
    "relax.exp": "exp({0})",
    "relax.log": "log({0})",
    "relax.sqrt": "sqrt({0})",
    "relax.rsqrt": "rsqrt({0})",
    "relax.tanh": "tanh({0})",
    "relax.sigmoid": "sigmoid({0})",
    "relax.abs": "abs({0})",
    "relax.erf": "erf({0})",
    "relax.sin": "sin({0})",
    "relax.cos": "cos({0})",
    "relax.sign": "sign({0})",
    "relax.floor": "floor({0})",
    "relax.ceil": "ceil({0})",
    "relax.square": "({0})**2",
    "relax.negative": "(-{0})",
    "relax.nn.relu": "relu({0})",
    "relax.nn.silu": "({0} * sigmoid({0}))",  # x * sigmoid(x)
    "relax.nn.gelu": "(0.5 * {0} * (1 + erf({0} * 0.7071067811865476)))",  # exact (erf) GELU
    "relax.nn.gelu_tanh": "(0.5 * {0} * (1 + tanh(0.7978845608028654 * "
                          "({0} + 0.044715 * ({0})**3))))",  # GELU, tanh approximation
}

BINARY = {  # Relax op -> spec template of its operands {0}, {1} (numpy broadcasting)
    "relax.add": "({0} + {1})",
    "relax.subtract": "({0} - {1})",
    "relax.multiply": "({0} * {1})",
    "relax.divide": "({0} / {1})",
    "relax.power": "({0})**({1})",
    "relax.maximum": "maximum({0}, {1})",
    "relax.minimum": "minimum({0}, {1})",
}

STATS = {  # Relax op -> (steps, kind of the value, additive terms of the value).
    # A step is (statement kind, template): red holds a reduction, epi is arithmetic on
    # per-row results, let is per element.  {E} is the operand, {0}, {1}... the earlier
    # steps, {eps} the op's epsilon; the value is the last step.
    "relax.sum": ((("red", "sum({E})"),), "row", ()),
    "relax.mean": ((("red", "sum({E}) / N"),), "row", ()),
    "relax.max": ((("red", "max({E})"),), "row", ()),
    "relax.min": ((("red", "min({E})"),), "row", ()),
    "relax.variance": ((("red", "sum({E}) / N"), ("red", "sum(({E} - {0})**2) / N")), "row",
                       ()),
    "relax.std": ((("red", "sum({E}) / N"), ("red", "sqrt(sum(({E} - {0})**2) / N)")), "row",
                  ()),  # the population standard deviation, as TOPI's std
    "relax.prod": ((("red", "prod({E})"),), "row", ()),
    "relax.argmax": ((("red", "argmax({E})"),), "index", ()),
    "relax.argmin": ((("red", "argmin({E})"),), "index", ()),
    # safe softmax: max, rescaled sum, normalised values
    "relax.nn.softmax": ((("red", "max({E})"), ("red", "sum(exp({E} - {0}))"),
                          ("let", "exp({E} - {0}) / {1}")), "elem", ()),
    # log-softmax: x - logsumexp(x); the two terms stay apart for a later gather/sum
    "relax.nn.log_softmax": ((("red", "max({E})"), ("red", "log(sum(exp({E} - {0}))) + {0}"),
                              ("let", "{E} - {1}")), "elem", ("{E}", "(-{1})")),
    # LayerNorm statistics and normalisation (gamma and beta follow as multiply and add)
    "relax.nn.layer_norm": ((("red", "sum({E}) / N"), ("red", "sum(({E} - {0})**2) / N"),
                             ("let", "({E} - {0}) / sqrt({1} + {eps})")), "elem", ()),
    "relax.nn.group_norm": None,  # LayerNorm's steps over each group (views below)
    "relax.nn.instance_norm": None,  # and over each channel's spatial (or batch) axes
    "relax.nn.batch_norm": None,  # and over every axis but the channel's (training)
    # RMSNorm (the weight follows as a multiply)
    "relax.nn.rms_norm": ((("red", "sqrt(sum({E}**2) / N + {eps})"), ("let", "{E} / {0}")),
                          "elem", ()),
}

for _norm in ("relax.nn.group_norm", "relax.nn.instance_norm", "relax.nn.batch_norm"):
    STATS[_norm] = STATS["relax.nn.layer_norm"]
NORMS = ("relax.nn.layer_norm", "relax.nn.rms_norm", "relax.nn.group_norm",
         "relax.nn.instance_norm", "relax.nn.batch_norm")  # a weight (and a bias) after them

SEEDS = {*STATS, "relax.topk", "relax.gather_elements", "relax.nn.attention",
         "relax.nn.attention_bias"}  # ops that start a cascade

# Reductions the pass meets but cannot lift: op -> why (or call -> why, None where the call
# does not reduce).  The report names each one skipped with its reason, never silently.
UNLIFTED = {
    "relax.nn.attention_var_len": "attention over packed sequences of symbolic lengths: "
                                  "no lifting",
    "relax.nn.cross_entropy_with_logits": "cross_entropy_with_logits reduces over the batch "
                                          "too: no lifting (log_softmax and a sum of "
                                          "target * logp lift)",
    "relax.nn.nll_loss": "nll_loss gathers and averages over the batch: no lifting",
    **dict.fromkeys(["relax.cumsum", "relax.cumprod"], "a scan: every prefix is an output, "
                                                       "no one-pass rule to derive"),
    **dict.fromkeys(["relax.sort", "relax.argsort"], "a sort: no lifting"),
    **{f"relax.nn.{kind}_pool{d}d": f"{kind} pooling reduces over windows of the spatial "
                                    "axes: no lifting"
       for kind in ("avg", "max", "adaptive_avg") for d in (1, 2, 3)},
}


def unlifted_reason(op: str, call) -> str | None:
    """Why a reduction op with no lifting is skipped (None: not such an op, or this call
    does not reduce)."""
    reason = UNLIFTED.get(op)
    return reason(call) if callable(reason) else reason


def _fields(template: str) -> set[str]:
    return {f for _, f, _, _ in Formatter().parse(template) if f is not None}


def _new(lf: Lifting, template: str, ops: list[Operand], kind: str, op: str, frag):
    """A statement from a template over operands; returns (statement, fragment)."""
    stmt = lf.stmt(template.format(*[o.text for o in ops]), kind,
                   frozenset().union(*(o.deps for o in ops)), op)
    return stmt, frag.with_stmt(stmt)


def _terms(op: str, ops: list[Operand]) -> tuple:
    neg = tuple((f"(-{t})", d) for t, d in ops[-1].term_list())
    terms = {"relax.add": lambda: ops[0].term_list() + ops[1].term_list(),
             "relax.subtract": lambda: ops[0].term_list() + neg,
             "relax.negative": lambda: neg}.get(op, lambda: ())()
    return terms if len(terms) <= MAX_TERMS else ()


def _context(lf: Lifting, args, out: tuple) -> str:
    """Row arithmetic when every lifted operand is a per-row value of the output's shape;
    an epilogue on feature vectors when one is a matmul's result of that shape (a bias, an
    activation, a residual after it); per-element otherwise (row values then broadcast
    along the stream)."""
    nodes = [lf.nodes[a] for a in args if a in lf.nodes]
    if nodes and all(n.kind == "row" and len(n.shape) <= len(out)
                     and (1,) * (len(out) - len(n.shape)) + n.shape == tuple(out)
                     for n in nodes):
        return "row"
    if any(n.kind == "vec" and n.shape == tuple(out) for n in nodes):
        return "vec"
    if out and out[-1] > 1:
        return "elem"
    raise Unliftable(f"elementwise op of shape {out} on values that are not lifted")


def elementwise(lf: Lifting, call, ty) -> Node:
    op, out = call.op.name, static_shape(ty)
    computed(str(ty.dtype))
    template = UNARY.get(op) or BINARY[op]
    if not any(a in lf.nodes for a in call.args) and \
            any(lf.producer(a) == "relax.matmul" for a in call.args):
        # arithmetic on a matmul that stays in Relax (GPT-2's bias after its Conv1D): TVM
        # fuses it into that matmul, whose kernel it schedules better with it (a symbolic
        # (2s, 256) x (256, 64): 252 us with the add, 544 us without), and the cascade reads
        # one input either way
        raise Unliftable("arithmetic on a matmul left in Relax: fused there")
    context = _context(lf, call.args, out)
    if context == "vec":  # folded into the kernel's finalize, per feature
        ops = [lf.feature(a, out) for a in call.args]
        stmt, frag = _new(lf, template, ops, "epi", op, lf.combine(ops, out[:-1]))
        return Node("vec", frag, stmt.name, frozenset({stmt.name}), out)
    if context == "row":
        keepdims = bool(out) and out[-1] == 1
        ops = [lf.row(a, out, keepdims) for a in call.args]
        frame = out[:-1] if keepdims else out
        stmt, frag = _new(lf, template, ops, "epi", op, lf.combine(ops, frame))
        return Node("row", frag, stmt.name, frozenset({stmt.name}), out)
    ops = [lf.elem(a, out) for a in call.args]
    stmt, frag = _new(lf, template, ops, "let", op, lf.combine(ops, out[:-1]))
    return Node("elem", frag, stmt.name, frozenset({stmt.name}), out, _terms(op, ops),
                frozenset().union(*(o.dots for o in ops)))


def _last_axis(axis, rank: int):
    axes = [axis] if isinstance(axis, int) else list(axis) if axis is not None else None
    if axes is None or len(axes) != 1 or int(axes[0]) % max(rank, 1) != rank - 1:
        raise Unliftable(f"reduces over axes {axes} of a rank-{rank} tensor, not the last one")


def statistics(lf: Lifting, call, ty) -> Node:
    computed(str(ty.dtype))  # in float32 on low-precision tensors, as torch's norms are
    value, _, view = _statistics(lf, call)
    if value.kind != "elem":
        return dataclasses.replace(value, shape=static_shape(ty))
    return dataclasses.replace(value, shape=static_shape(ty), perm=view.perm)


def batch_norm(lf: Lifting, call, ty) -> Node:
    """batch_norm in training: LayerNorm's steps over every axis but the channel's, the
    weight and bias, and the running statistics updated from the batch's as TOPI does
    (``(1 - momentum) * moving + momentum * batch``, the variance biased): the op's tuple of
    three.  In inference it reduces nothing: left as it is, and not reported."""
    if not bool(call.attrs.training):
        lf.quiet.add(lf.current)
        raise Unliftable("batch_norm in inference: no reduction")
    value, names, view = _statistics(lf, call)
    mean, var = names[:2]  # LayerNorm's steps: the mean, the variance, the normalised value
    rows, m = view.out[:-1], literal(float(call.attrs.momentum))
    fields = [dataclasses.replace(value, shape=static_shape(ty.fields[0]), perm=view.perm)]
    for moving, batch, field_ty in zip(call.args[3:5], (mean, var), ty.fields[1:], strict=True):
        old = lf.row(moving, rows, False)
        stmt = lf.stmt(f"(1 - {m}) * {old.text} + {m} * {batch}", "epi", old.deps | {batch},
                       call.op.name)
        frag = merge([value.frag, old.frag], rows, value.frag.n).with_stmt(stmt)
        fields.append(Node("row", frag, stmt.name, frozenset({stmt.name}),
                           static_shape(field_ty)))
    frag = merge([f.frag for f in fields], rows, value.frag.n)
    fields = [dataclasses.replace(f, frag=frag) for f in fields]
    return Node("tuple", frag, "", frozenset(), fields[0].shape, fields=tuple(fields))


def _statistics(lf: Lifting, call) -> tuple[Node, list[str], View]:
    """A statistics op's value over its view (a norm's weight and bias applied), the names
    of its steps, and the view."""
    op, data, attrs = call.op.name, call.args[0], call.attrs
    shape = static_shape(data.ty)
    view = VIEWS[op](call, shape) if op in VIEWS else axes_view(
        shape, getattr(attrs, "axis", getattr(attrs, "axes", None)))
    if view.perm and op == "relax.nn.group_norm":
        raise Unliftable("group_norm with the channel axis after a spatial axis")
    steps, kind, term_templates = STATS[op]
    e = read_data(lf, data, view)
    frag, names = e.frag, []
    eps = literal(float(attrs.epsilon)) if hasattr(attrs, "epsilon") else ""
    for step_kind, template in steps:
        deps = set(e.deps) | {names[int(f)] for f in _fields(template) if f.isdigit()}
        stmt = lf.stmt(template.format(*names, E=e.text, eps=eps), step_kind, deps, op)
        frag, names = frag.with_stmt(stmt), [*names, stmt.name]
    terms = tuple((t.format(*names, E=e.text), frozenset(
        {names[int(f)] for f in _fields(t) if f.isdigit()}) | (e.deps if "E" in _fields(t)
                                                              else frozenset()))
                  for t in term_templates)
    value = Node(kind, frag, names[-1], frozenset({names[-1]}), view.out, terms,
                 e.dots if kind == "elem" else frozenset())
    if op in NORMS:
        value = _affine(lf, call, value, view)
    return value, names, view


def _affine(lf: Lifting, call, value: Node, view: View) -> Node:
    """A norm's weight (gamma) and bias (beta): a multiply, then an add."""
    attrs, out = call.attrs, view.out
    steps = [("relax.multiply", call.args[1])] if getattr(attrs, "scale", True) else []
    if getattr(attrs, "center", False):
        steps.append(("relax.add", call.args[2]))
    for op, arg in steps:
        ops = [Operand(value.text, value.deps, value.frag, value.terms, value.dots),
               read_weight(lf, arg, view, weight_shape(call, view))]
        stmt, frag = _new(lf, BINARY[op], ops, "let", call.op.name,
                          lf.combine(ops, out[:-1]))
        value = Node("elem", frag, stmt.name, frozenset({stmt.name}), out, _terms(op, ops),
                     value.dots)
    return value


def topk(lf: Lifting, call, ty) -> Node:
    data, attrs = call.args[0], call.attrs
    shape, k = static_shape(data.ty), int(attrs.k)
    view = axes_view(shape, int(attrs.axis))
    if not attrs.largest or str(attrs.dtype) != "int64":
        raise Unliftable("topk needs largest=True and int64 indices")
    if k > 1 and view.perm:
        raise Unliftable(f"topk of {k} over axis {int(attrs.axis)}, not the last one")
    e = read_data(lf, data, view)
    # k = 1 is torch's max(dim)/min(dim): a per-row maximum and its index
    ops = ("max", "argmax", "row") if k == 1 else ("topk", "argtopk", "topk")
    values = lf.stmt(f"{ops[0]}({e.text}{'' if k == 1 else f', {k}'})", "red", e.deps,
                     "relax.topk")
    indices = lf.stmt(f"{ops[1]}({e.text}{'' if k == 1 else f', {k}'})", "red", e.deps,
                      "relax.topk")
    frag = e.frag.with_stmt(values).with_stmt(indices)
    out = tuple(k if a in view.reduced else size for a, size in enumerate(shape))
    pair = (Node(ops[2], frag, values.name, frozenset({values.name}), out),
            Node("index", frag, indices.name, frozenset({indices.name}), out))
    ret = str(attrs.ret_type)
    return Node("tuple", frag, "", frozenset(), out, fields=pair) if ret == "both" else \
        pair[0 if ret == "values" else 1]


def make_tuple(lf: Lifting, value, ty) -> Node:
    """topk's pair packed again (torch's max(dim) does): a tuple of one topk's fields."""
    fields = tuple(lf.nodes.get(f) for f in value.fields)
    if len(fields) != 2 or any(f is None or f.frag is not fields[0].frag for f in fields) \
            or fields[1].kind != "index":
        raise Unliftable("a tuple of values that are not one topk's fields")
    fields = tuple(lf.node(f) for f in value.fields)
    return Node("tuple", fields[0].frag, "", frozenset(), fields[0].shape, fields=fields)


def tuple_item(lf: Lifting, item, ty) -> Node:
    node = lf.node(item.tuple_value)
    if node is None or node.kind != "tuple":
        raise Unliftable("not a lifted tuple")
    return node.fields[int(item.index)]


def where(lf: Lifting, call, ty) -> Node:
    """where(c, a, b) as the spec's select (np.where semantics: the unselected branch never
    reaches the result, so inf or NaN in masked slots stays out).  The boolean condition
    becomes a 0/1 float input read as ``c > 0.5``."""
    safe = safe_softmax(lf, call)
    if safe is not None:
        return safe
    cond, a, b = call.args
    out = static_shape(ty)
    if str(cond.ty.dtype) != "bool" or not out:
        raise Unliftable("where() needs a boolean condition over the stream")
    flag = Ext(cond, static_shape(cond.ty), "float32", ("float",))
    ops = [lf.elem(flag, out), lf.elem(a, out), lf.elem(b, out)]
    stmt, frag = _new(lf, "where({0} > 0.5, {1}, {2})", ops, "let", "relax.where",
                      lf.combine(ops, out[:-1]))
    return Node("elem", frag, stmt.name, frozenset({stmt.name}), out, (),
                ops[1].dots | ops[2].dots)


def gather(lf: Lifting, call, ty) -> Node:
    """gather_elements(y, t) along the stream (cross-entropy's pick of the target's
    log-probability): sum(y[i] * (1 - sign(abs(i - t)))), an exact indicator for integer i, t."""
    data, index = call.args
    shape, out = static_shape(data.ty), static_shape(ty)
    _last_axis(call.attrs.axis, len(shape))
    node = lf.nodes.get(data)
    if node is None or node.kind != "elem" or out[-1] != 1 or shape[-1] >= 2 ** 24:
        raise Unliftable("gather of a value that is not lifted, or of more than one column")
    e = lf.elem(data, shape)
    ref, ifrag = lf.input(Ext(index, out, "float32", ("float",)), "param", False, out[:-1],
                          shape[:-1], shape[-1])
    frag = merge([e.frag, ifrag], shape[:-1], shape[-1])
    terms = e.term_list()
    text = " + ".join(f"sum(({t}) * (1 - sign(abs(i - {ref}))))" for t, _ in terms)
    stmt = lf.stmt(text, "red", frozenset().union(*(d for _, d in terms)),
                   "relax.gather_elements")
    return Node("row", frag.with_stmt(stmt), stmt.name, frozenset({stmt.name}), out)


def reshape(lf: Lifting, call, ty) -> Node:
    """Shape ops on a lifted value: the stream axis stays, the rows move (frag.fit)."""
    node = lf.node(call.args[0])
    if node is None or node.kind == "tuple":
        raise Unliftable("not a lifted value")
    out = static_shape(ty)
    if call.op.name == "relax.astype":
        computed(str(ty.dtype))  # between float dtypes: the identity inside the kernel
    if node.perm:
        raise Unliftable("a reshape of a value held with its axes permuted")
    if call.op.name == "relax.permute_dims" and out != node.shape:
        raise Unliftable("a transpose of a lifted value")
    if out == node.shape:
        return node
    if node.kind == "row":
        keepdims = bool(out) and out[-1] == 1 and len(out) > 1
        frame = out[:-1] if keepdims else out
    elif out and out[-1] == (node.frag.n if node.kind == "elem" else node.shape[-1]):
        frame = out[:-1]
    else:
        raise Unliftable(f"a reshape {node.shape} -> {out} that moves the stream axis")
    return dataclasses.replace(node, frag=fit(node.frag, frame), shape=out)


OPS = {
    **dict.fromkeys([*UNARY, *BINARY], elementwise),
    **dict.fromkeys(STATS, statistics),
    "relax.nn.batch_norm": batch_norm,
    "relax.matmul": matmul,
    "relax.topk": topk,
    "TupleGetItem": tuple_item,
    "Tuple": make_tuple,
    "relax.where": where,
    "relax.gather_elements": gather,
    "relax.nn.attention": attention,
    "relax.nn.attention_bias": attention,
    **dict.fromkeys(["relax.reshape", "relax.expand_dims", "relax.squeeze",
                     "relax.broadcast_to", "relax.astype", "relax.permute_dims"], reshape),
}
