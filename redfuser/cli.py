"""Command line.

``redfuser derive "<spec>" | NAME | -f FILE | --all [--latex | --json] [--passes auto]
[--backward]``: derive and prove (``--passes auto``: a cascade with no one-pass rule is cut
into stages; ``--backward``: the backward cascade of the gradients, proven, and its rule).
``redfuser kernels [NAME ...]``: compile each library cascade (fused and unfused), check it
against the float64 oracle and time both (what ``make demo`` runs after ``derive --all``).
``redfuser tune "<spec>" | NAME --shape x=4096x4096 | --model NAME_OR_FILE [--rpc HOST:PORT
--key KEY]``: search the schedule for those shapes (or of every cascade of a model), here or
on a device pool, print predicted vs measured time per candidate, store the best in the
tuning database (``cli_tune.py``).
``redfuser db show | export FILE | import FILE | merge FILE...``: list the tuning database,
write it to a portable file, merge other machines' databases in.
``redfuser bench [--tuned] ...``: the benchmark (``python -m redfuser.tools.bench``).

The commands that compile import their modules when they run (TVM takes about 0.6 s to
load), so ``redfuser derive`` stays a sympy-only command.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import stat
import sys
import time

from algebra import LIBRARY, NoBackward, NotFusable, SpecError, derive
from algebra.limits import MAX_SPEC_CHARS
from algebra.stages import StagedLowering

from . import cli_tune
from .cli_args import UsageError, positive

KERNEL_ROUNDS = 5  # `redfuser kernels`: alternating rounds timed per cascade (median)
# `derive -f`: bytes read at most.  UTF-8 spends at most 4 bytes a character, so no spec the
# parser accepts (MAX_SPEC_CHARS) is longer; /dev/zero is not read until memory runs out.
MAX_FILE_BYTES = 4 * MAX_SPEC_CHARS.value


def _read_spec_file(path: str) -> str:
    """The text of a spec file; a missing, unreadable, non-regular, binary or oversized one
    is a ``UsageError`` (a FIFO is refused before it is opened: opening it would wait for a
    writer)."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise UsageError(f"{path!r} is a directory, not a spec file")
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            raise UsageError(f"{path!r} is a FIFO or a socket, not a spec file (pass the spec "
                             "text as the argument instead)")
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise UsageError(f"cannot read {path!r}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"{path!r} is larger than {MAX_FILE_BYTES} bytes: not a spec (a spec "
                         f"has at most MAX_SPEC_CHARS = {MAX_SPEC_CHARS.value} characters)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path!r} is not UTF-8 text (byte {data[e.start]:#04x} at offset "
                         f"{e.start})") from None


def _derive_cmd(args: argparse.Namespace) -> int:
    if args.list:
        return _list(args)
    if args.all:
        return _derive_all(args)
    if args.file:
        spec = _read_spec_file(args.file)
    elif args.spec:
        spec = args.spec
    else:
        raise UsageError("give a spec, a library name (--list), -f FILE or --all")
    try:
        rule = derive(spec, passes=_passes(args.passes))
        if args.backward:
            return _backward(rule)
    except (SpecError, NotFusable, NoBackward) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(rule.to_latex() if args.latex else rule.to_json() if args.json else rule)
    return 0


def _backward(rule) -> int:
    """--backward: the backward cascade, its proof, then its own rule (in stages where it
    has no one-pass rule, as the torch op compiles it)."""
    b = rule.backward()
    print(b)
    print()
    print(derive(b.spec, passes="auto"))
    return 0 if b.proven else 1


def _passes(text: str) -> int | str:
    """--passes: "1" (one pass, refuse what has none) or "auto" (the fewest stages)."""
    return 1 if text == "1" else text


def _list(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({name: {"spec": spec, "description": what}
                          for name, (spec, what) in LIBRARY.items()}, indent=2))
        return 0
    width = max(map(len, LIBRARY))
    for name, (_, what) in LIBRARY.items():
        print(f"{name:<{width}}  {what}")
    return 0


def _derive_all(args: argparse.Namespace) -> int:
    """Every library rule, then a table of derive times and proofs; with --json one JSON
    document instead (name -> the rule's JSON plus its derive time)."""
    rows, docs = [], {}
    for name in LIBRARY:
        start = time.perf_counter()
        rule = derive(name)
        seconds = time.perf_counter() - start
        rows.append((name, seconds, sum(rule.status), len(rule.status)))
        if args.json:
            docs[name] = {**json.loads(rule.to_json()), "derive_ms": round(seconds * 1e3, 1)}
            continue
        print(rule.to_latex() if args.latex else rule)
        print()
    ok = all(proven == total for _, _, proven, total in rows)
    if args.json:
        print(json.dumps(docs, indent=2))
        return 0 if ok else 1
    print(f"{'cascade':<18} {'derive':>9}  proof")
    for name, seconds, proven, total in rows:
        mark = "proven" if proven == total else "NOT PROVEN"
        print(f"{name:<18} {seconds * 1e3:7.1f} ms  {mark} ({proven}/{total} obligations)")
    return 0 if ok else 1


def _kernels_cmd(args: argparse.Namespace) -> int:
    import numpy as np  # noqa: I001 - lazily, like every compiling command (module doc)

    import redfuser  # lazily (module doc)
    from algebra.library import example_inputs

    names = args.names or list(LIBRARY)
    unknown = [n for n in names if n not in LIBRARY]
    if unknown:
        raise UsageError("not in the library: " + ", ".join(_with_hint(n) for n in unknown))
    print(f"{'cascade':<16} {'compile':>8} {'fused':>9} {'unfused':>9} {'unf/fus':>8} "
          f"{'max rel err':>12}  plan")
    worst = 0.0
    for name in names:
        inputs = example_inputs(name, n=args.n, rows=(args.rows,), d=args.d)
        start = time.perf_counter()
        fused = redfuser.compile(name)
        out = fused(**inputs)
        compiled = time.perf_counter() - start
        unfused = redfuser.compile(name, variant="unfused")
        unfused(**inputs)
        err = _max_rel_err(out, redfuser.reference(name, inputs), np)
        worst = max(worst, err)
        if isinstance(fused.rule, StagedLowering):  # the baseline: one kernel per stage
            unfused = _StageKernels(fused.rule.staged, inputs, redfuser)
        t_f, t_u = _interleaved((fused, unfused), inputs, np)
        loses = "  <- fused slower than unfused" if t_u < t_f else ""
        print(f"{name:<16} {compiled:7.2f}s {t_f:7.3f}ms {t_u:7.3f}ms {t_u / t_f:7.2f}x "
              f"{err:12.2e}  {fused.plan.variant}{loses}")
    print(f"worst relative error vs the float64 oracle: {worst:.2e} (float32 kernels); a "
          "row-resident (staged) cascade's unfused column runs its stages as separate kernels")
    return 0 if worst < 1e-3 else 1


class _StageKernels:
    """A staged rule's stages as separate kernels, each reading the earlier ones' results
    (what running the cascade without row-resident passes costs); ``time`` is their sum."""

    def __init__(self, staged, inputs: dict, redfuser):
        self.kernels, self.inputs, known = [], [], dict(inputs)
        for stage in staged.stages:
            kernel = redfuser.compile(stage.rule)
            cascade = stage.rule.cascade
            mine = {v.name: known[v.name] for v in (*cascade.streams, *cascade.params)}
            known.update(kernel(**mine))
            self.kernels.append(kernel)
            self.inputs.append(mine)

    def time(self, repeat: int = 5, **_) -> float:
        return sum(k.time(repeat=repeat, **i) for k, i in zip(self.kernels, self.inputs,
                                                              strict=True))


def _with_hint(name: str) -> str:
    near = difflib.get_close_matches(name, LIBRARY, n=1)
    return f"{name} (did you mean {near[0]}?)" if near else name


def _interleaved(kernels, inputs: dict, np, rounds: int = KERNEL_ROUNDS) -> list[float]:
    """Median ms of each kernel over ``rounds`` rounds that alternate them: drifts of a shared
    machine's speed then hit every kernel alike, not whichever was timed first."""
    times = [[k.time(repeat=5, **inputs) for k in kernels] for _ in range(rounds)]
    return [float(np.median(t)) for t in zip(*times, strict=True)]


def _max_rel_err(out: dict, ref: dict, np) -> float:
    """Largest |kernel - reference| / (1 + |reference|) over every finite output."""
    worst = 0.0
    for k, r in ref.items():
        a, r = np.asarray(out[k], np.float64), np.asarray(r, np.float64)
        if not np.array_equal(np.isnan(a), np.isnan(r)):
            return float("inf")
        fin = np.isfinite(r)
        if fin.any():
            worst = max(worst, float(np.max(np.abs(a[fin] - r[fin]) / (1 + np.abs(r[fin])))))
    return worst


def _db_cmd(args: argparse.Namespace) -> int:
    from .tune import DatabaseError, TuningDB  # lazily (module doc)
    from .tune.share import merge_files, show  # lazily (module doc)

    db = TuningDB(args.db)
    try:
        if args.action == "show":
            print(show(db))
        elif args.action == "export":
            count = db.export(args.file)
            print(f"exported {count} {'entry' if count == 1 else 'entries'} of {db.path} to "
                  f"{args.file}")
        else:
            for path, summary in merge_files(db, args.files):
                print(f"{path} into {db.path}: {summary}")
    except DatabaseError as e:
        print(f"redfuser db {args.action}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="redfuser", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("derive", help="derive and prove the one-pass rule of a cascade")
    d.add_argument("spec", nargs="?", help="spec text (';' separates statements) or a "
                                           "library name")
    d.add_argument("-f", "--file", help="read the spec from a file")
    d.add_argument("--list", action="store_true", help="list the built-in cascades")
    d.add_argument("--all", action="store_true", help="derive the whole built-in library")
    d.add_argument("--passes", choices=("1", "auto"), default="1",
                   help="1: one pass or refuse (default); auto: the fewest one-pass stages")
    d.add_argument("--backward", action="store_true",
                   help="derive and prove the backward cascade (the gradients) instead")
    fmt = d.add_mutually_exclusive_group()
    fmt.add_argument("--latex", action="store_true", help="print LaTeX")
    fmt.add_argument("--json", action="store_true", help="print JSON")
    k = sub.add_parser("kernels", help="compile, check and time library kernels")
    k.add_argument("names", nargs="*", help="library cascades (default: all)")
    k.add_argument("--rows", type=positive, default=512, help="rows (default 512)")
    k.add_argument("--n", type=positive, default=2048, help="stream length N (default 2048)")
    k.add_argument("--d", type=positive, default=64, help="feature length D (default 64)")
    cli_tune.add_parser(sub)
    _db_parser(sub)
    sub.add_parser("bench", help="the benchmark (python -m redfuser.tools.bench: its options "
                                 "follow, e.g. --tuned)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after it belongs to the benchmark's own parser
        from .tools.bench import main as bench_main  # lazily, see the module doc

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    commands = {"derive": _derive_cmd, "kernels": _kernels_cmd, "tune": cli_tune.run,
                "db": _db_cmd}
    try:
        return commands[args.command](args)
    except UsageError as e:
        print(f"redfuser {args.command}: {e}", file=sys.stderr)
        return 2


def _db_parser(sub) -> None:
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--db", metavar="FILE", help="the database (default: tuning.json in "
                                                    "the cache directory)")
    d = sub.add_parser("db", help="show the tuning database, move it between machines")
    actions = d.add_subparsers(dest="action", required=True)
    actions.add_parser("show", parents=[where], help="list every entry")
    e = actions.add_parser("export", parents=[where], help="write every entry to a new file")
    e.add_argument("file", help="the file to create (an existing one is never replaced)")
    for name, what in (("import", "merge one database file in"),
                       ("merge", "merge several database files in")):
        m = actions.add_parser(name, parents=[where], help=what + " (the newer record of "
                                                              "a key wins)")
        m.add_argument("files", nargs=1 if name == "import" else "+", metavar="FILE")
