"""Staged rules: a cascade with no one-pass rule cut into the fewest passes over the stream.

Each stage is a set of reductions fused into one pass (a proven ``FusionRule``); a stage
reads the final results of earlier stages as per-row parameters, so a reduction whose
body has no exact one-pass form at a *running* anchor (``relu(x - m)``, ``abs(x - mu)``)
is exact at the *final* one.  Reductions are placed greedily, each in the earliest stage
where a one-pass rule for it exists given the earlier stages' finals: for a chain of
reductions that is the fewest stages.  A stage after the first keeps the ``NotFusable``
that opened it (``Stage.boundary``): the sub-expression and the reason it could not join
the stage before.

A later stage that recomputes an earlier stage's costly basis value (threshold_mass's
``exp(x - m)``) can read it back instead (``RowStash``): the earlier pass writes the value
into a row buffer while the row is in cache, and the later stage's rule, derived again with
a stream standing for it, is proven equal to its own (``algebra.stash.row_rewrite``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from .cascade import Cascade, Reduction, carries_feature_axis
from .components import LinearComponent
from .derive import running_values
from .errors import NotFusable
from .interpret import run_staged
from .prove import Obligation
from .rule import FusionRule
from .stages_backward import StagedBackward, staged_backward
from .stash import row_rewrite, worth_stashing

DeriveCascade = Callable[[Cascade], FusionRule]


@dataclass(frozen=True)
class Stage:
    """One pass over the stream: its proven rule, the earlier results it reads as per-row
    parameters, and the ``NotFusable`` that kept it apart from the stage before (None for
    the first stage)."""

    rule: FusionRule
    reads: tuple[str, ...]
    boundary: NotFusable | None = None

    @property
    def results(self) -> tuple[str, ...]:
        """Every per-row value this pass computes (reductions, then epilogues)."""
        c = self.rule.cascade
        return tuple(r.name for r in c.reductions) + tuple(c.epilogues)


@dataclass(frozen=True)
class RowStash:
    """Stage ``reader`` reads basis ``column`` of component ``component`` of stage ``writer``
    from a row buffer the writer's pass fills: ``rule`` is the reader's rule with the stream
    ``stream`` standing for that value at the writer's final anchors (``obligations`` prove
    it equal to the reader's own).  It holds in a row whose values were all written at the
    final anchors; the lowering checks that per row and runs the reader's own rule elsewhere.
    """

    writer: int
    component: int
    column: int
    reader: int
    stream: str
    rule: FusionRule
    obligations: tuple[Obligation, ...]


@dataclass(frozen=True)
class StagedRule:
    """A cascade as consecutive one-pass stages (``Stage``), each proven as a ``FusionRule``.

    The public surface follows ``FusionRule``: ``verify``, ``evaluate``, ``backward``,
    ``str``, ``to_json``, ``to_latex``, ``outputs``, ``obligations``, ``status``.
    """

    cascade: Cascade
    stages: tuple[Stage, ...]
    name: str | None = None
    stashes: tuple[RowStash, ...] = ()  # later stages reading an earlier one's values
    # how each stage was derived (``staged``): the backward derives its forward and
    # backward specs the same way (``rederived``); each backward derived once (``_backwards``)
    derive_cascade: DeriveCascade | None = field(default=None, compare=False, repr=False)
    _backwards: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def passes(self) -> int:
        return len(self.stages)

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.cascade.outputs

    @property
    def obligations(self):
        return tuple(o for s in self.stages for o in s.rule.obligations)

    @property
    def status(self) -> tuple[bool, ...]:
        return tuple(ok for s in self.stages for ok in s.rule.status)

    def backward(self, outputs: tuple[str, ...] | None = None) -> StagedBackward:
        """The backward of the whole cascade for the gradients of ``outputs`` (default:
        the outputs no other value reads), derived and proven as a one-pass rule's, its
        forward and backward specs derived in stages where they need them
        (``algebra.stages_backward``).

        Examples
        --------
        >>> from algebra import derive
        >>> b = derive("relu_sum").backward()
        >>> b.saved, b.proven, sorted(b.gradients)
        (('m', 'm_at'), True, ['t', 'x'])
        """
        key = None if outputs is None else tuple(outputs)
        if key not in self._backwards:
            self._backwards[key] = staged_backward(self.cascade, key, self.rederived)
        return self._backwards[key]

    def rederived(self, cascade: Cascade) -> FusionRule | StagedRule:
        """Another cascade derived as this one was: its one-pass rule where it has one,
        else its stages.

        Examples
        --------
        >>> from algebra import derive, parse
        >>> rule = derive("mad")
        >>> type(rule.rederived(parse("r = sum(x[i])"))).__name__
        'FusionRule'
        >>> rule.rederived(parse("m = max(x[i]); r = sum(relu(x[i] - m))")).passes
        2
        """
        try:
            return self.derive_cascade(cascade)
        except NotFusable:
            return staged(cascade, self.derive_cascade)

    def verify(self) -> bool:
        """Re-check every stage's and every row stash's proof obligations with sympy; True
        only if all hold."""
        return all(s.rule.verify() for s in self.stages) and all(
            s.rule.verify() and all(o.check() for o in s.obligations) for s in self.stashes)

    def evaluate(self, inputs: dict, chunks=None, tree=None, per_stage=None) -> dict:
        """Run the stages in numpy, in the inputs' dtype: each stage one fused pass (folded in
        ``chunks``, merged along ``tree``, as ``FusionRule.evaluate``) reading the earlier
        stages' final values; ``per_stage``: a (chunks, tree) pair per stage instead.

        Examples
        --------
        >>> import algebra, numpy as np
        >>> rule = algebra.derive("m = max(x[i]); r = sum(relu(x[i] - m + 1))", passes="auto")
        >>> rule.evaluate({"x": np.array([[0.0, 0.5, 2.0]], np.float32)}, chunks=[2, 1])["r"]
        array([1.], dtype=float32)
        """
        plans = per_stage if per_stage is not None else [(chunks, tree)] * self.passes
        if len(plans) != self.passes:
            raise ValueError(f"per_stage has {len(plans)} (chunks, tree) pairs; the rule has "
                             f"{self.passes} stages")
        return run_staged(self, inputs, plans)

    # How to show it -------------------------------------------------------------------
    def __str__(self) -> str:
        proven = sum(self.status)
        head = f"StagedRule {self.name or ''}".rstrip()
        out = [f"{head}  [{self.passes} passes, {proven}/{len(self.obligations)} obligations "
               "proven]", "spec:"]
        out += [f"  {line.strip()}" for line in self.cascade.text.strip().splitlines()]
        for k, stage in enumerate(self.stages):
            reads = f"; reads {', '.join(stage.reads)} as per-row values" if stage.reads else ""
            out.append(f"stage {k + 1} of {self.passes} (one pass over the stream{reads}):")
            if stage.boundary is not None:
                out.append(f"  boundary: {stage.boundary}")
            out += ["  " + line for line in str(stage.rule).splitlines()]
        for st in self.stashes:
            out.append(f"row stash: stage {st.writer + 1} writes {self.stashed_value(st)} at "
                       f"its final anchors into a row buffer; stage {st.reader + 1} reads it "
                       f"as {st.stream} where every value of the row was written at them:")
            out += [f"  {line}" for line in st.rule.cascade.text.splitlines()]
            out += [f"  [proven] {o.name}: {o.statement()}" for o in st.obligations]
        return "\n".join(out)

    def stashed_value(self, stash: RowStash):
        """The basis value ``stash`` keeps, at the writer's anchors."""
        return self.stages[stash.writer].rule.components[stash.component].basis[stash.column]

    def to_json(self) -> str:
        return json.dumps({
            "name": self.name, "spec": self.cascade.text.strip(), "outputs": list(self.outputs),
            "passes": self.passes,
            "stages": [{"reads": list(s.reads),
                        "boundary": None if s.boundary is None else str(s.boundary),
                        "rule": json.loads(s.rule.to_json())} for s in self.stages],
            "stashes": [{"writer": s.writer, "reader": s.reader, "stream": s.stream,
                         "value": str(self.stashed_value(s)), "spec": s.rule.cascade.text,
                         "proof": [o.statement() for o in s.obligations]}
                        for s in self.stashes],
        }, indent=2)

    def to_latex(self) -> str:
        return "\n".join(rf"\text{{stage {k + 1}:}}" + "\n" + s.rule.to_latex()
                         for k, s in enumerate(self.stages))

    def lowered(self) -> StagedLowering:
        """The whole cascade in ``FusionRule``'s shape, for the lowering (``redfuser.compile``
        builds it as one row-resident kernel): every stage's components and results, with
        ``staged`` pointing back here."""
        rules = [s.rule for s in self.stages]
        running = {k: v for r in rules for k, v in r.running.items()}
        return StagedLowering(self.cascade, tuple(c for r in rules for c in r.components),
                              running, self.status, self.name, staged=self)


@dataclass(frozen=True)
class StagedLowering(FusionRule):
    """A ``StagedRule`` as the lowering reads a rule: the full cascade (inputs, outputs,
    shapes), every stage's components and running values.  Its components are not one pass
    (a later stage's read earlier finals), so ``update``/``merge`` refuse; ``evaluate`` runs
    the stages."""

    staged: StagedRule | None = None

    def update(self, state: dict, element: dict, params: dict) -> dict:
        raise TypeError("a staged rule has no one-pass update: fold each of .staged.stages")

    def merge(self, left: dict, right: dict, params: dict) -> dict:
        raise TypeError("a staged rule has no one-pass merge: merge within each stage")

    def evaluate(self, inputs: dict, chunks=None, tree=None) -> dict:
        return self.staged.evaluate(inputs, chunks, tree)


# Cutting a cascade into stages ------------------------------------------------------------
def stage_cascade(cascade: Cascade, members: list[Reduction], earlier: set[str],
                  last: bool) -> Cascade:
    """The sub-cascade of one stage: ``members`` (their anchors on earlier stages dropped),
    the epilogues that become computable with them, the earlier results it reads as
    per-row parameters, and (``last``) every per-element output."""
    results = cascade.results
    known = earlier | {r.name for r in members}
    epilogues = {}
    for name, expr in cascade.epilogues.items():  # spec order: what one reads comes first
        deps = {s.name for s in expr.free_symbols if s in results.values()}
        if name not in earlier and deps <= known:
            epilogues[name] = expr
            known.add(name)
    reductions = tuple(dataclasses.replace(r, anchors=tuple(a for a in r.anchors
                                                            if a.name not in earlier))
                       for r in members)
    elementwise = dict(cascade.elementwise) if last else {}
    exprs = [r.body for r in reductions] + list(epilogues.values()) + list(elementwise.values())
    free = set().union(*(e.free_symbols for e in exprs)) if exprs else set()
    reads = tuple(results[n] for n in results if n in earlier and results[n] in free)
    vec = _vector_results(cascade)
    vector = frozenset(v for v in cascade.vector_inputs if any(s.name == v for s in free)) | {
        s.name for s in reads if s.name in vec}
    mine = set(known - earlier) | set(elementwise)
    return dataclasses.replace(
        cascade, text=_text(reductions, epilogues, elementwise),
        streams=tuple(s for s in cascade.streams if s in free),
        params=tuple(p for p in cascade.params if p in free) + reads, vector_inputs=vector,
        reductions=reductions, epilogues=epilogues, elementwise=elementwise,
        outputs=tuple(n for n in (*results, *elementwise) if n in mine))


def _vector_results(cascade: Cascade) -> set[str]:
    vec = set(cascade.vector_inputs)
    for r in cascade.reductions:
        if carries_feature_axis(r.body, vec):
            vec.add(r.name)
    for name, expr in cascade.epilogues.items():
        if carries_feature_axis(expr, vec):
            vec.add(name)
    return vec


def _text(reductions, epilogues: dict, elementwise: dict) -> str:
    lines = [f"{r.name} = {r.op}({r.body}{f', {r.k}' if r.k else ''})" for r in reductions]
    lines += [f"{n} = {e}" for n, e in epilogues.items()]
    lines += [f"{n}[i] = {e}" for n, e in elementwise.items()]
    return "\n".join(lines)


def _stage_of(cascade: Cascade, placed: dict[str, int], name: str) -> int:
    """The stage a result is final in: its reduction's, or an epilogue's latest input's."""
    if name in placed:
        return placed[name]
    expr = cascade.epilogues[name]
    deps = [s.name for s in expr.free_symbols if s in cascade.results.values()]
    return max((_stage_of(cascade, placed, d) for d in deps), default=0)


def staged(cascade: Cascade, derive_cascade: DeriveCascade, name: str | None = None
           ) -> StagedRule:
    """Cut ``cascade`` into the fewest one-pass stages (each derived and proven by
    ``derive_cascade``); a reduction that cannot be fused even with every earlier result
    final raises its ``NotFusable``."""
    groups: list[list[Reduction]] = []
    bounds: list[NotFusable | None] = []
    rules: list[FusionRule] = []  # each group's rule as last derived
    placed: dict[str, int] = {}
    for r in cascade.reductions:
        k = max((_stage_of(cascade, placed, a.name) for a in r.anchors), default=0)
        k, rule, boundary = _place(cascade, groups, placed, r, k, derive_cascade)
        if k == len(groups):
            groups.append([])
            bounds.append(boundary)
            rules.append(rule)
        groups[k].append(r)
        rules[k] = rule
        placed[r.name] = k
    stages, earlier = [], set()
    for k, (members, boundary) in enumerate(zip(groups, bounds, strict=True)):
        sub = stage_cascade(cascade, members, earlier, k == len(groups) - 1)
        # the components depend only on the members and their anchors; the stage may have
        # gained epilogues (one reading a result placed in an earlier stage later) and the
        # per-element outputs since it was derived, so its running values are redone
        comps = rules[k].components
        rule = FusionRule(sub, comps, running_values(sub, comps), rules[k].status)
        stages.append(Stage(rule, tuple(p.name for p in sub.params if p.name in earlier),
                            boundary))
        earlier = _closure(cascade, earlier | {r.name for r in members})
    return StagedRule(cascade, tuple(stages), name, _stashes(stages, derive_cascade),
                      derive_cascade)


def _stashes(stages: list[Stage], derive_cascade: DeriveCascade) -> tuple[RowStash, ...]:
    """Per later stage, the first costly basis value of an earlier stage it can read back
    (``RowStash``), in stage order."""
    found = (_row_stash(stages, reader, derive_cascade) for reader in range(1, len(stages)))
    return tuple(s for s in found if s is not None)


def _row_stash(stages: list[Stage], reader: int, derive_cascade: DeriveCascade):
    """The first (writer, component, column) whose scalar basis value the reader's bodies
    hold up to a per-row factor, with the reader's rule derived again over it; None where
    there is none (or the rewritten stage is not fusable or not proven)."""
    cascade = stages[reader].rule.cascade
    for writer in range(reader):
        for index, comp in enumerate(stages[writer].rule.components):
            if not isinstance(comp, LinearComponent) or not comp.anchors:
                continue
            for column, psi in enumerate(comp.basis):
                if comp.counts(column) or not worth_stashing(psi) or \
                        carries_feature_axis(psi, cascade.vector_inputs):
                    continue
                rw = row_rewrite(cascade, psi)
                if rw is None or not all(o.check() for o in rw.obligations):
                    continue
                c = rw.cascade
                try:
                    rule = derive_cascade(dataclasses.replace(
                        c, text=_text(c.reductions, c.epilogues, c.elementwise)))
                except NotFusable:
                    continue
                return RowStash(writer, index, column, reader, rw.stream.name, rule,
                                rw.obligations)
    return None


def _place(cascade, groups, placed, r: Reduction, k: int, derive_cascade):
    """The earliest stage from ``k`` on that can fuse ``r``: (stage, its rule with ``r``, the
    ``NotFusable`` of the stage before when that refused it)."""
    boundary = None
    while True:
        earlier = _closure(cascade, {n for n, s in placed.items() if s < k})
        members = (groups[k] if k < len(groups) else []) + [r]
        try:
            return k, derive_cascade(stage_cascade(cascade, members, earlier, False)), boundary
        except NotFusable as why:
            if all(a.name in earlier for a in r.anchors):
                raise  # every result it reads is final already: no stage can hold it
            boundary, k = why, k + 1


def _closure(cascade: Cascade, names: set[str]) -> set[str]:
    """``names`` and every epilogue computable from them."""
    out = set(names)
    results = cascade.results
    for name, expr in cascade.epilogues.items():
        if {s.name for s in expr.free_symbols if s in results.values()} <= out:
            out.add(name)
    return out
