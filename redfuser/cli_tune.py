"""``redfuser tune``: search the schedule of one spec, or of every cascade of a model, here
or on a pool of devices through TVM's RPC tracker.

``redfuser tune "<spec>" | NAME --shape x=4096x4096``: the spec at those shapes.
``redfuser tune --model NAME_OR_FILE``: every cascade the Relax pass would fuse in a model
of ``redfuser.examples.models`` (by name) or a Relax module saved as JSON
(``tvm.ir.save_json``, file name ending ``.json``) or TVMScript (``mod.script()``).
``--rpc HOST:PORT --key KEY [--target TARGET]``: measure on the tracker's free devices of
that key instead of here; results are stored under the devices' identity.

Its modules load when it runs (TVM takes seconds to load; a model import needs torch), so
``redfuser derive`` stays a sympy-only command (``cli.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from algebra import NotFusable, SpecError, derive

from .cli_args import UsageError, positive, row_axes, shape


def add_parser(sub) -> None:
    t = sub.add_parser("tune", help="search the schedule of a spec (or of a whole model) and "
                                    "remember it")
    t.add_argument("spec", nargs="?", help="spec text or a library name")
    t.add_argument("--model", metavar="NAME_OR_FILE", help="tune every cascade of a model: "
                   "an example's name (python -m redfuser.examples.models) or a saved "
                   "Relax module (.json: tvm.ir.save_json; else TVMScript)")
    t.add_argument("--shape", action="append", default=[], metavar="NAME=AxB", type=shape,
                   help="an input's shape (repeat per input); others from --rows/--n/--d")
    t.add_argument("--rows", type=row_axes, default=(1024,),
                   help="row axes of the other inputs, e.g. 8x1024 (default 1024)")
    t.add_argument("--n", type=positive, default=4096, help="stream length N (default 4096)")
    t.add_argument("--d", type=positive, default=64, help="feature length D (default 64)")
    t.add_argument("--target", default="cpu", help="cpu or cuda; with --rpc also a TVM target "
                   "as JSON, e.g. '{\"kind\": \"llvm\", \"mcpu\": \"cortex-a72\", \"mtriple\": "
                   "\"aarch64-linux-gnu\"}' (default: what the devices report)")
    t.add_argument("--rpc", metavar="HOST:PORT", help="measure on the devices of a TVM RPC "
                                                      "tracker (python -m tvm.exec.rpc_tracker)")
    t.add_argument("--key", help="with --rpc: the device key the servers registered with")
    t.add_argument("--timeout", type=float, default=None, help="with --rpc: seconds one "
                   "measurement may take before its device counts as hung (default 60)")
    t.add_argument("--cross-cc", metavar="CC", help="with --rpc and a target of another "
                   "architecture: link here with this compiler (default: the devices link)")
    t.add_argument("--variant", action="append", choices=("rolling", "split", "unfused"),
                   help="search only these variants (repeatable)")
    t.add_argument("--top", type=positive, default=4, help="candidates measured (default 4, plus "
                                                      "the hand-written plan)")
    t.add_argument("--repeat", type=positive, default=5, help="timed runs per measurement")
    t.add_argument("--rounds", type=positive, default=2, help="measurements per candidate")
    t.add_argument("--no-store", action="store_true", help="do not write the database")


def run(args: argparse.Namespace) -> int:
    from .tune import TuningDB  # lazily (module doc)
    from .tune.pool import PoolError  # lazily (module doc)

    try:
        backend, tvm_target = _target(args)
        job = _load_model(args.model) if args.model else _spec(args)
    except UsageError as e:
        print(f"redfuser tune: {e}", file=sys.stderr)
        return 2
    except (SpecError, NotFusable, ValueError, OSError) as e:
        print(f"redfuser tune: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    db = None if args.no_store else TuningDB()
    unusable = db.problem() if db is not None else None
    if unusable is not None:  # say so before minutes of measuring
        print(f"redfuser tune: the tuning database {db.path} {unusable}; it is left "
              "untouched (--no-store tunes without storing)", file=sys.stderr)
        return 1
    try:
        pool = _pool(args, tvm_target) if args.rpc else None
    except PoolError as e:
        print(f"redfuser tune: {e}", file=sys.stderr)
        return 1
    try:
        tune = _tune_model if args.model else _tune_spec
        return tune(args, job, backend, pool, db)
    finally:
        if pool is not None:
            pool.close()


def _target(args: argparse.Namespace) -> tuple[str, dict | None]:
    """(backend, TVM target for the pool or None) from --target, checked against the rest
    of the command line."""
    from .lowering.backends import BACKENDS, backend_of_kind, build_kinds  # lazily (module doc)

    if args.model and (args.spec or args.shape):
        raise UsageError("give a spec (with --shape) or --model, not both: a model's cascades "
                     "have the model's shapes")
    if not args.model and not args.spec:
        raise UsageError("give a spec or library name, or --model NAME_OR_FILE")
    if bool(args.rpc) != bool(args.key):
        raise UsageError("--rpc HOST:PORT and --key KEY go together (the tracker, and the key "
                     "its servers registered with)")
    if not args.rpc and (args.timeout is not None or args.cross_cc):
        raise UsageError("--timeout and --cross-cc apply to --rpc tuning only")
    if args.target in BACKENDS:
        return args.target, None
    try:
        target = json.loads(args.target)
    except json.JSONDecodeError:
        target = None
    kind = target.get("kind") if isinstance(target, dict) else None
    found = backend_of_kind(kind) if isinstance(kind, str) and kind else None
    if found is None:
        raise UsageError(f"--target must be cpu, cuda or a TVM target as JSON with a kind of "
                     f"{', '.join(build_kinds())}, not {args.target!r}")
    if not args.rpc:
        raise UsageError("a TVM target description needs --rpc: tuning here builds for this "
                     "machine")
    if args.model and found is not backend_of_kind(None):  # the host's, as Relax emits
        raise UsageError("--model tunes CPU kernels (the Relax pass emits llvm kernels only)")
    return found.name, target


def _spec(args: argparse.Namespace):
    from .tune import shape_geometry  # lazily (module doc)

    rule = derive(args.spec)
    return rule, shape_geometry(rule, dict(args.shape), rows=args.rows, n=args.n, d=args.d)


def _load_model(name_or_file: str):
    """The Relax module of a saved file, else of the example model of that name."""
    from .tvm.graph import import_torch, load_ir_module  # lazily (module doc)

    if os.path.exists(name_or_file):
        return load_ir_module(name_or_file)
    from .examples.models import examples  # lazily: it loads torch

    models = {e.name: e for e in examples()}
    if name_or_file not in models:
        raise UsageError(f"--model {name_or_file!r} is neither a file nor an example model "
                     f"({', '.join(models)})")
    return import_torch(models[name_or_file].model, models[name_or_file].inputs)


def _pool(args: argparse.Namespace, tvm_target: dict | None):
    from .lowering.backends import BACKENDS  # lazily (module doc)
    from .tune.pool import MEASURE_TIMEOUT_S, DevicePool  # lazily (module doc)

    if tvm_target is None and args.target in BACKENDS and \
            not BACKENDS[args.target].host_memory:
        tvm_target = BACKENDS[args.target].tvm_target()  # a GPU cannot be asked its arch over RPC
    pool = DevicePool(args.rpc, args.key, tvm_target, timeout=args.timeout or
                      MEASURE_TIMEOUT_S, cross_cc=args.cross_cc)
    print(f"pool: {len(pool.devices)} device(s) of key {args.key!r} at {args.rpc}: "
          f"{', '.join(pool.devices)}")
    print(f"identity: {pool.identity}")
    return pool


def _figures(backend: str, pool):
    from .tune import machine  # lazily (module doc)

    figures = machine(backend)
    print(f"cost model: {figures.name}'s figures" +
          (f" at the devices' {pool.threads} thread(s)" if pool is not None else ""))
    return figures


def _tune_spec(args: argparse.Namespace, job, backend: str, pool, db) -> int:
    from .tune import describe, space, tune  # lazily (module doc)

    rule, geo = job
    variants = tuple(args.variant) if args.variant else None
    where = pool.measurer(rule) if pool is not None else None
    print(space(rule, geo, backend, variants=variants,
                threads=where.threads if where else None))
    figures = _figures(backend, pool)
    result = tune(rule, geo, backend, top=args.top, repeat=args.repeat, rounds=args.rounds,
                  variants=variants, db=False, figures=figures, where=where)
    print(result.report())
    if pool is not None:
        print(pool_summary(pool))
    print(f"best: {describe(result.best)}  ({result.best.reason})")
    return _store(db, [result], pool)


def _tune_model(args: argparse.Namespace, mod, backend: str, pool, db) -> int:
    from .relax.tuning import cascades, tune_model  # lazily (module doc)
    from .tune import describe  # lazily (module doc)

    found = cascades(mod)
    print(f"{len(found)} distinct cascade(s) to tune")
    if not found:
        return 0
    figures = _figures(backend, pool)
    done = tune_model(mod, where=pool.measurer if pool is not None else None, db=False,
                      top=args.top, repeat=args.repeat, rounds=args.rounds, figures=figures,
                      variants=tuple(args.variant) if args.variant else None)
    for k, d in enumerate(done, 1):
        c, r = d.cascade, d.result
        what = (f"{describe(r.best)}: {r.record['measured_ms']:.4f} ms, {len(r.measured)} "
                f"of {r.candidates} timed" if r else f"FAILED: {d.error}")
        print(f"{k}. {c.function} {', '.join(c.values)}: rows {c.geo.r}, N {c.geo.n}, "
              f"D {c.geo.d}\n   {c.spec.replace(chr(10), '; ')[:160]}\n   {what}")
    if pool is not None:
        print(pool_summary(pool))
    code = _store(db, [d.result for d in done if d.result], pool)
    print("later builds of this model (redfuser.relax.build, or FuseCascadedReductions in a "
          "pipeline) read these plans")
    return code if all(d.result for d in done) else 1


def pool_summary(pool) -> str:
    """Measurements per device, and the devices lost with the reason."""
    counts = ", ".join(f"{a} {pool.counts[a]}" for a in pool.devices)
    lost = "".join(f"\n  lost {a}: {why}" for a, why in pool.lost.items())
    return f"measurements per device: {counts}{lost}"


def _store(db, results: list, pool) -> int:
    from .tune.search import DatabaseError, store  # lazily (module doc)

    if db is None:
        return 0
    try:
        for result in results:
            print(store(db, result))
    except (DatabaseError, ValueError) as e:
        print(f"redfuser tune: not stored: {e}", file=sys.stderr)
        return 1
    if pool is not None:
        print(f"under machine {pool.identity}: compile() on such a device reads it with "
              f"REDFUSER_MACHINE='{pool.identity}'")
    return 0
