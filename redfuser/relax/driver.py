"""The pass: lift every dataflow block, form cascades, derive, and splice what proves out."""

from __future__ import annotations

import dataclasses

from ..lowering.backends import BACKENDS, backend_of_kind
from ..report import FuseReport, GroupReport
from ..tvm.graph import IRModule, module_pass, relax
from ..tvm.target import current_target_kind
from .bounds import tightened
from .group import BindingGroup, form_groups, skipped_entries
from .lift import Lifter
from .rewrite import check_kernel, derive_spec, kernel_for, splice_checked
from .symbolic import fuse_symbolic, symbolic_vars

ROUNDS = 4  # lift again with more matmuls kept outside, at most this often per block


def fuse_module(mod: IRModule, check_build: bool = True) -> tuple[IRModule, FuseReport]:
    """``mod`` with every provable cascade of its Relax functions fused, and the report.

    The input module is not changed.  Each group is spliced into a copy that is kept only
    when the kernel compiles (``check_build``) and the module stays well formed.

    Examples
    --------
    >>> from redfuser.tvm.graph import relax
    >>> bb = relax.BlockBuilder()
    >>> x = relax.Var("x", relax.TensorType((4, 32), "float32"))
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.softmax(x))
    ...     gv = bb.emit_func_output(y)
    >>> fused, report = fuse_module(bb.get())
    >>> report.found, report.fused
    (1, 1)
    """
    mod, entries = mod.clone(), []
    kind = current_target_kind()
    target = backend_of_kind(kind)
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function):
            continue
        before, symbolic = len(entries), bool(symbolic_vars(func))
        why = _refusal(kind, target, symbolic)
        if symbolic and not why:  # shapes the export's bounds decide, made exact
            func, why = _tightened(func)
            mod[gv] = func
        options = (check_build, why, target.name if target else "")
        for index, block in enumerate(func.body.blocks):
            if isinstance(block, relax.DataflowBlock):
                mod = _fuse_any_block(mod, gv, func, index, options, symbolic and not why,
                                      entries)
        if any(e.status == "fused" for e in entries[before:]):
            mod = _cleanup(mod, gv)
            entries[before:] = _called(mod, gv, entries[before:])
    return mod, FuseReport(tuple(entries))


def _tightened(func) -> tuple:
    """(``bounds.tightened(func)``, ""), or (``func``, why) when that fails: the function's
    blocks are then reported skipped with the reason, never fused on untightened shapes."""
    try:
        return tightened(func), ""
    except Exception as e:  # noqa: BLE001 - one function's failure must not stop the pass
        return func, f"symbolic shapes not tightened: {type(e).__name__}: {e}"


def _fuse_any_block(mod: IRModule, gv, func, index: int, options: tuple, symbolic: bool,
                    entries: list):
    """Fuse dataflow block ``index`` (through ``fuse_symbolic`` when its function has shape
    variables); an unexpected failure anywhere in it leaves the block as it was and goes in
    the report with its type and message (the pass never raises on a valid module)."""
    found: list = []
    try:
        if symbolic:
            check_build, _, target = options
            new, found = fuse_symbolic(mod, gv, func, index, function_name(gv),
                                       (plan_block, _fresh), check_build, target)
        else:
            new = _fuse_block(mod, gv, func, index, options, found)
    except Exception as e:  # noqa: BLE001 - reported below, the block left unchanged
        new, found = mod, [_not_analysed(gv, index, e)]
    entries += found
    return new


def _refusal(kind: str | None, target, symbolic: bool) -> str:
    """Why no group of a function is tried with TVM target ``kind`` in scope (``target``:
    its backend, None when none serves it), or ""."""
    if target is None:
        kinds = ", ".join(b.tvm_kind for b in BACKENDS.values())
        return f"target {kind} in scope: the pass emits kernels for {kinds} only"
    if symbolic and target.dynamic is None:
        return f"symbolic shapes: the {target.name} backend builds kernels for static " \
               "shapes only"
    return ""


def _fuse_block(mod: IRModule, gv, func, index: int, options: tuple, entries: list):
    try:
        lifter, groups = plan_block(func, func.body.blocks[index])
    except Exception as e:  # noqa: BLE001 - an analysis failure leaves the block alone
        entries.append(_not_analysed(gv, index, e))
        return mod
    entries += skipped_entries(function_name(gv), lifter, groups)
    for group in groups:
        mod, entry = apply_group(mod, gv, index, group, *options)
        entries.append(entry)
    return mod


def _not_analysed(gv, index: int, error: Exception) -> GroupReport:
    return GroupReport(function_name(gv), (), False,
                       f"block {index} not analysed: {type(error).__name__}: {error}")


def plan_block(func, block) -> tuple[Lifter, list[BindingGroup]]:
    """Lift and group; inlined matmuls that a per-element output would recompute, or that
    keep a group from being derived, are kept as matmuls, lifted values that a consumer
    would recompute from its own inputs' ancestors are read back (``recomputed_reads``),
    and the block is lifted again."""
    materialised, leaves = frozenset(), frozenset()
    for _ in range(ROUNDS):
        lifter = Lifter(func, block, materialised, leaves).run()
        groups, retry = form_groups(lifter), set()
        for g in groups:
            retry |= g.elem_dots
            if not g.elem_dots and derive_spec(g.spec)[0] is None:
                retry |= g.frag.dots
        reads = lifter.recomputed_reads()
        if retry <= materialised and reads <= leaves:
            break
        materialised, leaves = materialised | retry, leaves | reads
    return lifter, groups


def apply_group(mod: IRModule, gv, index: int, group: BindingGroup, check_build: bool = True,
                refuse: str = "", target: str = "cpu"):
    """Splice one group into a copy of ``mod``; the copy is returned only if it checks.
    ``refuse``: a reason to report the group skipped without trying (e.g. the target);
    ``target``: the backend that builds the kernel."""
    fname = function_name(gv)
    entry = dict(function=fname, values=group.values, ops=group.ops, spec=group.spec)
    rule, reason = (None, refuse) if refuse else derive_spec(group.spec)
    if rule is None:
        return mod, GroupReport(fused=False, reason=reason, **entry)
    name = _fresh(mod, f"redfuser_{fname}")
    return splice_checked(mod, gv, index, name, entry, lambda: (
        _checked_kernel(group, rule, name, check_build, target), group))


def _checked_kernel(group: BindingGroup, rule, name: str, check_build: bool, target: str):
    """The group's kernel on the tuning database's plan; one that does not build falls
    back to the hand-written plan (a stale record never costs a model its fusion)."""
    kernel = kernel_for(group, rule, name, target=target)
    if not check_build:
        return kernel
    try:
        check_kernel(kernel)
        return kernel
    except Exception:  # noqa: BLE001 - TVM's own error classes; the hand-written plan decides
        if not kernel.tuned:
            raise
    kernel = kernel_for(group, rule, name, tuned=False, target=target)
    check_kernel(kernel)
    return kernel


def _cleanup(mod: IRModule, gv) -> IRModule:
    """Drop the bindings the fused kernels made dead (kept as is if that fails a check)."""
    func = mod[gv]
    if not isinstance(func, relax.Function):
        return mod
    candidate = mod.clone()
    candidate[gv] = relax.analysis.remove_all_unused(func)
    try:
        relax.analysis.well_formed(candidate)
    except Exception:  # noqa: BLE001
        return mod
    return candidate


def _called(mod: IRModule, gv, entries: list) -> list:
    """The entries with a fused group whose kernel the function no longer calls (its
    output read by nothing) reported skipped: never a kernel reported fused that does not
    run."""
    called = {function_name(g) for g in relax.analysis.all_global_vars(mod[gv])}
    return [e if e.status != "fused" or e.kernel in called else dataclasses.replace(
        e, fused=False, reason="its kernel's output is read by nothing after the pass")
        for e in entries]


def function_name(gv) -> str:
    return getattr(gv, "name_hint", None) or str(gv).split(".")[-1].strip('"')


def _fresh(mod: IRModule, base: str) -> str:
    taken = {function_name(g) for g in mod.get_global_vars()}
    k = 0
    while f"{base}_{k}" in taken:
        k += 1
    return f"{base}_{k}"


@module_pass(opt_level=0, name="FuseCascadedReductions")
class FuseCascadedReductions:
    """A Relax module pass: every cascaded reduction that redfuser can prove becomes one
    fused TensorIR kernel called with ``R.call_tir``; the rest is left as it was.

    Run it on a high-level Relax module (before ``LegalizeOps``), e.g. first in a
    pipeline.  After a run, ``pass_obj.report`` is the ``FuseReport`` of the last module
    it transformed (cascades found, fused, skipped with reasons).

    Parameters
    ----------
    check_build : bool
        Compile each fused kernel alone before using it (default True).

    Examples
    --------
    >>> from redfuser.tvm.graph import relax
    >>> bb = relax.BlockBuilder()
    >>> x = relax.Var("x", relax.TensorType((8, 64), "float32"))
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.log_softmax(x))
    ...     gv = bb.emit_func_output(y)
    >>> fuse = FuseCascadedReductions()
    >>> fused = fuse(bb.get())
    >>> print(fuse.report.fused, fuse.report.groups[0].ops)
    1 ('log_softmax gv',)
    """

    def __init__(self, check_build: bool = True):
        self.check_build = check_build
        self.report = FuseReport()

    def transform_module(self, mod: IRModule, ctx) -> IRModule:
        mod, self.report = fuse_module(mod, self.check_build)
        return mod
