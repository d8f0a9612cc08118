"""Command line: ``redfuser derive "<spec>" | NAME | -f FILE [--latex | --json]``."""

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
    args = parser.parse_args(argv)
    return {"derive": _derive_cmd}[args.command](args)
