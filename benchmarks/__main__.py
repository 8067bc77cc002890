"""Throughput benchmarks against named baselines: ``python -m benchmarks --quick|--full [--json OUT]``.

Each workload runs its subject and its baselines side by side in a process of its own (a fresh
interpreter, started once the machine's 1-minute load has settled: `--in-process` runs them all
in this one, as before issue 44), repeated (>= 3 times) with the median reported beside the min and max of the repetitions, and prints
absolute figures, ratios, peak memory and the targets (goals, not assertions) beside them; a
summary first (the train_step workload's ledger share of a training step, then every target):

1. append        ledger public API vs eventsourcing and raw sqlite3 executemany (SQLite file)
2. projection    Projector + ledger.batch, and build_padded vs a per-row baseline and the
                 memory-bandwidth bound
3. replay/audit  sessions.audit.replay.replay and sessions.audit.auditing.audit over a recorded log
4. pg append     1, 4, 8 writer processes via benchmarks/pg_append.py (if present and the server answers)
5. overhead      recorder wall time per session in a loop of 1,000 concurrent simulated sessions
6. batch_ready   one step of sessions recorded with a projector following the log: last terminal
                 append -> ledger.batch returned, vs build_padded alone on the same rows
7. export        export_dataset to Parquet vs pyarrow's own write of the same table (the floor)
8. train_step    examples/train_grpo.py's loop: the ledger's share of each step's wall time (needs verl)
9. scale         cost curves as one log grows 10^4 -> 10^6 events, with their log-log slopes
10. startup      each read verb's wall time in a fresh interpreter, beside the interpreter alone
                 and the import of the database stack (the floor)
11. gateway      a call's latency through the gateway (its own process, SQLite) vs straight to
                 the stand-in inference server, the gateway's CPU per call and memory per round
12. memory       per workload: RSS high-water growth and tracemalloc peak (see benchmarks/common.py)

``--quick`` a first look (about a minute on 2 cores), ``--full`` the size of the figures in
docs/benchmarks.md, ``--tiny`` a few seconds (a check that the suite still runs; CI's smoke run,
tests/benchmarks/test_smoke.py). Size flags override a
preset; ``--only append,overhead`` runs a subset.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import math
import sys
import time
from pathlib import Path

from benchmarks.common import (
    Report,
    load_average,
    log,
    machine_info,
    machine_lines,
    preset,
    run_isolated,
    settle,
    summary,
    table,
)

WORKLOADS = (
    "append",
    "projection",
    "replay",
    "pg",
    "overhead",
    "batch_ready",
    "export",
    "train_step",
    "scale",
    "startup",
    "gateway",
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        dest="mode",
        action="store_const",
        const="quick",
        help="a first look, about a minute (default)",
    )
    size.add_argument(
        "--full", dest="mode", action="store_const", const="full", help="the documented figures"
    )
    size.add_argument(
        "--tiny", dest="mode", action="store_const", const="tiny", help="a few seconds (tests)"
    )
    parser.add_argument(
        "--json", dest="json_out", metavar="OUT", help="also write the results as JSON"
    )
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    parser.add_argument(
        "--reps", type=int, help="repetitions per workload (>= 3 for the median to mean much)"
    )
    parser.add_argument("--append-sessions", type=int)
    parser.add_argument("--append-concurrency", type=int)
    parser.add_argument("--projection-steps", type=int)
    parser.add_argument(
        "--projection-uids", type=int, help="groups per step (x group size = sessions per batch)"
    )
    parser.add_argument("--replay-sessions", type=int)
    parser.add_argument("--pg-writers", help="comma-separated writer process counts, e.g. 1,4,8")
    parser.add_argument("--pg-sessions-per-writer", type=int)
    parser.add_argument("--overhead-sessions", type=int)
    parser.add_argument(
        "--batch-ready-sessions", type=int, help="sessions in the batch-ready workload's step"
    )
    parser.add_argument(
        "--no-tracemalloc", action="store_true", help="skip the extra traced repetitions"
    )
    parser.add_argument(
        "--workdir", help="folder for the scratch databases (default: the system temp folder)"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every workload in this process, one after another, without waiting for the load"
        " to settle (default with --tiny; otherwise each runs in a fresh interpreter of its own)",
    )
    parser.set_defaults(mode="quick")
    args = parser.parse_args(argv)
    if args.only:
        unknown = set(args.only.split(",")) - set(WORKLOADS)
        if unknown:
            parser.error(
                f"--only: unknown workload(s) {sorted(unknown)}; choose from {', '.join(WORKLOADS)}"
            )
    if args.reps is not None and args.reps < 1:
        parser.error("--reps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = preset(
        args.mode,
        reps=args.reps,
        append_sessions=args.append_sessions,
        append_concurrency=args.append_concurrency,
        projection_steps=args.projection_steps,
        projection_uids=args.projection_uids,
        replay_sessions=args.replay_sessions,
        pg_writers=tuple(int(w) for w in args.pg_writers.split(",")) if args.pg_writers else None,
        pg_sessions_per_writer=args.pg_sessions_per_writer,
        overhead_sessions=args.overhead_sessions,
        batch_ready_sessions=args.batch_ready_sessions,
        tracemalloc=False if args.no_tracemalloc else None,
        only=tuple(args.only.split(",")) if args.only else None,
        workdir=args.workdir,
    )
    started = time.perf_counter()
    when = dt.datetime.now(dt.timezone.utc)
    info = machine_info()
    print(
        f"rollout-ledger benchmarks, --{cfg.mode}, {cfg.reps} repetitions (median), {when:%Y-%m-%d %H:%M} UTC"
    )
    for line in machine_lines(info):
        print(line)
    print(flush=True)

    modules = {
        "append": "benchmarks.append",
        "projection": "benchmarks.projection",
        "replay": "benchmarks.replay_audit",
        "pg": "benchmarks.pg",
        "overhead": "benchmarks.overhead",
        "batch_ready": "benchmarks.batch_ready",
        "export": "benchmarks.export",
        "train_step": "benchmarks.train_step",
        "scale": "benchmarks.scale",
        "startup": "benchmarks.startup",
        "gateway": "benchmarks.gateway",
    }
    isolate = not args.in_process and cfg.mode != "tiny"
    report = Report()
    for name in WORKLOADS:
        if not cfg.wants(name):
            continue
        if isolate:
            load, waited = settle()
            log(f"{name} ... (own process; load {load} after {waited:.0f}s settling)")
        else:
            log(f"{name} ...")
        before = load_average()
        t0 = time.perf_counter()
        if isolate:
            child = run_isolated(modules[name], cfg)
            report.figures += child.figures
            report.notes += child.notes
        else:
            importlib.import_module(modules[name]).run(cfg, report)
        report.seconds[name] = time.perf_counter() - t0
        report.loads[name] = (before, load_average())
        log(f"{name} done in {report.seconds[name]:.1f}s")
    wall = time.perf_counter() - started

    load_end = load_average()
    for line in summary(report, info["load_average"], load_end):
        print(line)
    print(
        "\nvalue: the median of the repetitions (a peak: their max), with their min and max (a"
        " ratio's are the per-repetition ratios; reps 1: one figure, no spread; reps with *: two"
        " sample sets of different sizes combined every way)"
    )
    print(table(report.figures))
    for note in report.notes:
        print(f"note: {note}")
    print(f"\nload average at end (1/5/15 min): {load_end}")
    print(
        f"wall time {wall:.1f}s ("
        + ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items())
        + ")"
    )

    if args.json_out:
        result = {
            "command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
            "mode": cfg.mode,
            "date": when.isoformat(timespec="seconds"),
            "machine": info,
            "config": {k: v for k, v in vars(cfg).items() if k != "workdir"},
            "figures": [f.as_dict() for f in report.figures],
            "notes": report.notes,
            "seconds": report.seconds,
            "wall_seconds": wall,
            "load_average_end": load_end,
            "load_average_per_workload": {
                name: {"before": before, "after": after}
                for name, (before, after) in report.loads.items()
            },
        }
        Path(args.json_out).write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    bad = [f for f in report.figures if not math.isfinite(f.value)]
    if bad:
        print(f"error: non-finite figures: {[f.name for f in bad]}", file=sys.stderr)
        return 1
    return 0


def _json_default(value: object) -> object:
    if isinstance(value, tuple):
        return list(value)
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
