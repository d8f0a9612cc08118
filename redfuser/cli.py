"""Command line.

``redfuser derive "<spec>" | NAME | -f FILE | --all [--latex | --json]``: derive and prove.
``redfuser kernels [NAME ...]``: compile each library cascade (fused and unfused), check it
against the float64 oracle and time both (what ``make demo`` runs after ``derive --all``).
"""

from __future__ import annotations

import argparse
import sys
import time

from algebra import LIBRARY, NotFusable, SpecError, derive


def _derive_cmd(args: argparse.Namespace) -> int:
    if args.list:
        width = max(map(len, LIBRARY))
        for name, (_, what) in LIBRARY.items():
            print(f"{name:<{width}}  {what}")
        return 0
    if args.all:
        return _derive_all(args)
    if args.file:
        with open(args.file) as f:
            spec = f.read()
    elif args.spec:
        spec = args.spec
    else:
        print("redfuser derive: give a spec, a library name (--list), -f FILE or --all",
              file=sys.stderr)
        return 2
    try:
        rule = derive(spec)
    except (SpecError, NotFusable) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(rule.to_latex() if args.latex else rule.to_json() if args.json else rule)
    return 0


def _derive_all(args: argparse.Namespace) -> int:
    rows = []
    for name in LIBRARY:
        start = time.perf_counter()
        rule = derive(name)
        seconds = time.perf_counter() - start
        print(rule.to_latex() if args.latex else rule.to_json() if args.json else rule)
        print()
        rows.append((name, seconds, sum(rule.status), len(rule.status)))
    print(f"{'cascade':<18} {'derive':>9}  proof")
    for name, seconds, ok, total in rows:
        mark = "proven" if ok == total else "NOT PROVEN"
        print(f"{name:<18} {seconds * 1e3:7.1f} ms  {mark} ({ok}/{total} obligations)")
    return 0 if all(ok == total for _, _, ok, total in rows) else 1


def _kernels_cmd(args: argparse.Namespace) -> int:
    import numpy as np

    import redfuser
    from algebra.library import example_inputs

    names = args.names or list(LIBRARY)
    unknown = [n for n in names if n not in LIBRARY]
    if unknown:
        print(f"redfuser kernels: not in the library: {', '.join(unknown)}", file=sys.stderr)
        return 2
    print(f"{'cascade':<16} {'compile':>8} {'fused':>9} {'unfused':>9} {'speedup':>8} "
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
        t_f, t_u = fused.time(repeat=5, **inputs), unfused.time(repeat=5, **inputs)
        print(f"{name:<16} {compiled:7.2f}s {t_f:7.3f}ms {t_u:7.3f}ms {t_u / t_f:7.2f}x "
              f"{err:12.2e}  {fused.plan.variant}")
    print(f"worst relative error vs the float64 oracle: {worst:.2e} (float32 kernels)")
    return 0 if worst < 1e-3 else 1


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="redfuser", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("derive", help="derive and prove the one-pass rule of a cascade")
    d.add_argument("spec", nargs="?", help="spec text (';' separates statements) or a "
                                           "library name")
    d.add_argument("-f", "--file", help="read the spec from a file")
    d.add_argument("--list", action="store_true", help="list the built-in cascades")
    d.add_argument("--all", action="store_true", help="derive the whole built-in library")
    fmt = d.add_mutually_exclusive_group()
    fmt.add_argument("--latex", action="store_true", help="print LaTeX")
    fmt.add_argument("--json", action="store_true", help="print JSON")
    k = sub.add_parser("kernels", help="compile, check and time library kernels")
    k.add_argument("names", nargs="*", help="library cascades (default: all)")
    k.add_argument("--rows", type=int, default=512, help="rows (default 512)")
    k.add_argument("--n", type=int, default=2048, help="stream length N (default 2048)")
    k.add_argument("--d", type=int, default=64, help="feature length D (default 64)")
    args = parser.parse_args(argv)
    return {"derive": _derive_cmd, "kernels": _kernels_cmd}[args.command](args)
