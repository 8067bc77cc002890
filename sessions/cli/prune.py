"""`rollout-ledger prune`: drop the token payloads of a run's settled, consumed old steps.

Each pruned payload keeps its length and SHA-256 in a tombstone, each pruned step is recorded as
a `PayloadsPruned` event in the run's stream, the steps' queue rows are dropped, and on SQLite the
freed pages go back to the OS in small incremental-vacuum slices (`sessions.runs.retention`,
docs/decisions.md "Retention"). `audit` passes on the pruned log; a pruned step's batch is a
`BatchPruned` error naming the prune.
"""

from __future__ import annotations

import argparse

from sessions.cli.arguments import integer, text


def register(verbs: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from sessions.vocabulary import PARTITIONS

    parser = verbs.add_parser(
        "prune",
        parents=[common],
        help="drop old steps' token payloads, keeping their lengths and digests",
        description="Prune the token payloads of a run's settled steps that no consumer holds "
        "claimed, older than a bound; audit keeps passing, their batches become a BatchPruned "
        "error, metrics stay. Give --keep-last, --before-step, --max-payload-bytes or --policy.",
    )
    parser.add_argument(
        "--run", type=text("a run name"), default=None, help="default: the most recent run"
    )
    parser.add_argument("--partition", choices=PARTITIONS, default="train")
    parser.add_argument(
        "--keep-last",
        type=integer(0, 2**62, "a step count"),
        default=None,
        metavar="N",
        help="keep the payloads of the run's last N steps",
    )
    parser.add_argument(
        "--before-step",
        type=integer(0, 2**62, "a step"),
        default=None,
        metavar="S",
        help="prune the steps before S",
    )
    parser.add_argument(
        "--max-payload-bytes",
        type=integer(0, 2**62, "a byte count"),
        default=None,
        metavar="BYTES",
        help="keep the newest steps whose payloads fit in BYTES, prune older ones",
    )
    parser.add_argument(
        "--policy",
        action="store_true",
        help="apply the retention policy recorded in the run's configuration",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="say which steps would be pruned, change nothing"
    )
    parser.add_argument(
        "--no-vacuum",
        dest="vacuum",
        action="store_false",
        help="leave the freed pages in the file (SQLite); reuse them for new events",
    )
    parser.add_argument(
        "--convert-vacuum",
        action="store_true",
        help="SQLite: first convert a file made without incremental auto_vacuum (a one-time "
        "VACUUM that rewrites the file and holds its write lock meanwhile)",
    )


def check(args: argparse.Namespace) -> None:
    from sessions.errors import ConfigError

    if not args.policy and (args.keep_last, args.before_step, args.max_payload_bytes) == (
        None,
        None,
        None,
    ):
        raise ConfigError("prune needs --keep-last, --before-step, --max-payload-bytes or --policy")


async def run(args: argparse.Namespace) -> int:
    from sessions.cli.main import _resolve_run
    from sessions.ledger import Ledger
    from sessions.runs.pruning import prune
    from store import retention

    async with Ledger.open(args.db, migrate=False) as ledger:
        run_name = await _resolve_run(ledger.engine, args.run)
        if args.convert_vacuum and await retention.convert_to_incremental(ledger.engine):
            print("converted the file to incremental auto_vacuum (one-time VACUUM)")
        report = await prune(
            ledger,
            run=run_name,
            partition=args.partition,
            keep_last=args.keep_last,
            before_step=args.before_step,
            max_payload_bytes=args.max_payload_bytes,
            policy=args.policy,
            vacuum=args.vacuum,
            dry_run=args.dry_run,
        )
        mode = await retention.auto_vacuum_mode(ledger.engine)
    verb = "would prune" if args.dry_run else "pruned"
    steps = report.pruned_steps
    shown = "none" if not steps else f"{steps[0]}..{steps[-1]} ({len(steps)} steps)"
    print(f"run {run_name!r} {args.partition}: {verb} steps {shown}")
    if not args.dry_run:
        print(
            f"  {report.events} payloads ({report.payload_bytes} bytes) replaced by tombstones, "
            f"{report.queue_rows} queue rows dropped; database {report.bytes_before} -> "
            f"{report.bytes_after} bytes in use"
        )
    if report.finished_prune_ids:
        print(f"  finished prunes cut midway: {', '.join(report.finished_prune_ids)}")
    if report.skipped_claimed:
        print(f"  kept (claimed by a consumer, not acked): {report.skipped_claimed}")
    if report.skipped_open:
        print(
            f"  kept (a session not ended when the prune came to record it): {report.skipped_open}"
        )
    if report.skipped_pruned:
        print(f"  pruned by another prune meanwhile: {report.skipped_pruned}")
    if report.skipped_busy:
        print(f"  kept (still changing while read; prune again): {report.skipped_busy}")
    if mode == "none":
        print(
            "  the file was made without incremental auto_vacuum: freed pages stay in it for new "
            "events; --convert-vacuum once to give them back"
        )
    elif mode is None:
        print("  PostgreSQL: autovacuum reclaims the replaced rows' space")
    return 0
