"""``fuse``: every fusable cascade of a PrimFunc (or of each PrimFunc of an IRModule)
replaced by its fused kernel, everything else left as it was, and a report of why.

One group at a time: ``lift`` the function, rewrite the first fusable group not yet
tried (``emit.rewrite_group``), check the result (well-formedness always; with
``verify=True`` also a build, and for CPU a run against the original on random
inputs) and keep it only if every check passes, then lift again.  A group that
cannot be fused, or whose rewrite fails a check, leaves the function exactly as it
was and gets a report entry with the reason.
"""

from __future__ import annotations

import numpy as np

from ..lowering import BACKENDS, backend
from ..lowering.backends import backend_of_kind
from ..report import FuseReport, GroupReport
from ..tvm.graph import IRModule
from ..tvm.ir import tirx, verify_sblock_func
from ..tvm.runtime import TVM_ALIGNMENT, build, from_numpy
from ..tvm.target import host_target
from .emit import rewrite_group
from .groups import Group, LiftError, lift

MAX_GROUPS = 64  # per function: a bound on the lift-rewrite loop


def fuse(obj, target: str | dict = "cpu", *, report: bool = False, fast_math: bool = True,
         verify: bool = False):
    """Replace every fusable cascade of reductions with its one-pass fused kernel.

    Parameters
    ----------
    obj : tvm.tirx.PrimFunc or tvm.IRModule
        TensorIR with SBlocks (TVMScript, ``te.create_prim_func``, TOPI).  Functions of
        an IRModule that are not PrimFuncs are kept as they are.
    target : {"cpu", "cuda"} or dict
        What the fused kernels are written for (CPU: parallel rows and vector lanes;
        CUDA: a thread block per row).  A TVM target dict works too (kind llvm or cuda).
    report : bool
        Also return a ``FuseReport`` (every group found, fused or not, and why).
    fast_math : bool
        Polynomial exp/log in the kernels (see ``redfuser.lowering.fastmath``).
    verify : bool
        Besides well-formedness, build every rewritten function and, for the CPU, run it
        against the original on random inputs; a mismatch keeps the original.

    Returns
    -------
    PrimFunc or IRModule, or (that, FuseReport) with ``report=True``
        The same kind as ``obj``; ``obj`` itself is never modified.

    Examples
    --------
    >>> from tvm import te, topi
    >>> x = te.placeholder((8, 128), "float32", name="x")
    >>> func = te.create_prim_func([x, topi.nn.softmax(x)])
    >>> fused, rep = fuse(func, report=True)
    >>> print(rep.groups[0].spec)
    T_softmax_maxelem = max(x[i])
    T_softmax_expsum = sum(exp(x[i] - T_softmax_maxelem))
    T_softmax_norm[i] = exp(x[i] - T_softmax_maxelem)/T_softmax_expsum
    >>> rep.groups[0].fused, rep.fused
    (True, 1)
    """
    kind = _target_kind(target)
    if isinstance(obj, tirx.PrimFunc):
        out, entries = _fuse_func(obj, None, kind, fast_math, verify)
    elif isinstance(obj, IRModule):
        out, entries = obj.clone(), []
        for gv, func in obj.functions_items():
            if isinstance(func, tirx.PrimFunc):
                new, found = _fuse_func(func, gv.name_hint, kind, fast_math, verify)
                entries += found
                if new is not func:
                    out.update_func(gv, new)
    else:
        raise TypeError(f"fuse takes a tvm.tirx.PrimFunc or a tvm.IRModule, not "
                        f"{type(obj).__name__}")
    rep = FuseReport(tuple(entries))
    return (out, rep) if report else out


def _target_kind(target) -> str:
    kind = target.get("kind") if isinstance(target, dict) else target
    if kind in BACKENDS:  # a backend's own name
        return kind
    found = backend_of_kind(kind, rewrite=True) if isinstance(kind, str) and kind else None
    if found is None:
        raise ValueError(f"target must be 'cpu', 'cuda' or a dict with kind llvm or cuda, "
                         f"not {target!r}")
    return found.name


def _fuse_func(func, name, target, fast_math, verify) -> tuple:
    """(function, report entries): groups fused one by one, lifting again after each."""
    entries, tried, current = [], set(), func
    for _ in range(MAX_GROUPS):
        try:
            groups = lift(current, name)
        except Exception as e:  # noqa: BLE001 - LiftError, or a bug: reported, never raised
            why = str(e) if isinstance(e, LiftError) else \
                f"could not be analysed: {type(e).__name__}: {e}"
            return current, entries + [GroupReport(name or "main", (), False, why)]
        todo = [g for g in groups if g.blocks not in tried]
        if not todo:
            break
        group = todo[0]
        tried.add(group.blocks)
        new, why = _try(current, group, target, fast_math, verify)
        entries.append(GroupReport(group.function, group.blocks, new is not None, why,
                                   spec=group.spec or ""))
        current = new if new is not None else current
    return current, entries


def _try(func, group: Group, target, fast_math, verify) -> tuple:
    """(rewritten function or None, why): the plan when fused, else the reason."""
    if not group.fusable:
        return None, group.reason
    try:
        new, plan = rewrite_group(func, group, target, fast_math)
    except Exception as e:  # noqa: BLE001 - any failure keeps the original (reported)
        return None, f"the kernel could not be generated: {type(e).__name__}: {e}"
    problem = verify_sblock_func(new) or (_verify(func, new, target) if verify else "")
    if problem:
        return None, f"the rewritten function failed a check, kept the original: {problem}"
    notes = "".join(f"; {n}" for n in group.notes)
    return new, f"{plan}{notes}"


def _verify(func, new, target: str) -> str:
    """A build that fails only counts against the rewrite if the original builds (on a GPU,
    blocks left unscheduled fail either way: they need their own schedule, e.g. dlight)."""
    problem = check_build(new, target)
    if problem and check_build(func, target):
        return ""
    # numbers can be compared only where the kernel runs here (host memory: the CPU)
    return problem or (check_numeric(func, new) if backend(target).host_memory else "")


def check_build(func, target: str) -> str:
    """'' when ``func`` compiles for ``target`` ("cpu" or "cuda"), else the error."""
    try:
        build(func, backend(target).tvm_target())
    except Exception as e:  # noqa: BLE001 - TVM raises its own error classes
        return f"build for {target} failed: {type(e).__name__}: {str(e).strip()[-300:]}"
    return ""


def check_numeric(original, fused, rtol: float = 1e-4, seed: int = 0) -> str:
    """'' when ``fused`` computes what ``original`` does on random float32 inputs (every
    parameter compared after one call of each), else what differs.

    The tolerance is relative to each buffer's largest value: the fused kernel
    reassociates the reductions and uses a polynomial exp (8.5e-8 relative error)."""
    try:
        arrays = random_params(original, seed)
        before, after = run_cpu(original, arrays), run_cpu(fused, arrays)
    except Exception as e:  # noqa: BLE001 - unrunnable: say so instead of guessing
        return f"could not run both versions: {type(e).__name__}: {e}"
    for k, (a, b) in enumerate(zip(before, after, strict=True)):
        scale = float(np.max(np.abs(a), initial=0.0)) or 1.0
        err = float(np.max(np.abs(a.astype(np.float64) - b), initial=0.0))
        if not err <= rtol * scale:
            return f"parameter {k} differs by {err:.3g} (largest value {scale:.3g})"
    return ""


def random_params(func, seed: int = 0) -> list[np.ndarray]:
    """Standard-normal float32 arrays for every buffer parameter (static shapes only)."""
    rng = np.random.default_rng(seed)
    out = []
    for p in func.params:
        shape = [int(s) for s in p.shape]  # a symbolic extent raises here
        if p.dtype != "float32":
            raise TypeError(f"parameter '{p.name}' is {p.dtype}")
        out.append(rng.standard_normal(shape).astype(np.float32))
    return out


def run_cpu(func, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Build ``func`` for this CPU, call it on copies of ``arrays``, return them all."""
    name = str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs \
        else "main"
    # a function without a global symbol (Relax's legalized ones) gets no packed entry point
    executable = build(func.with_attr("global_symbol", name), host_target())
    tensors = [from_numpy(np.array(a), align=TVM_ALIGNMENT) for a in arrays]
    executable[name](*tensors)
    return [t.numpy() for t in tensors]
