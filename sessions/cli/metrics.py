"""`rollout-ledger metrics`: a run's metric counts, as a table or JSON.

With the projector at the log's end the rows are read straight from `metric_counts`: a `Ledger`
would read the same rows, and not opening one keeps the recorder, the projector and numpy out of
the verb's start-up (issue 28). Behind the log, a `Ledger` projects first, then reads.
"""

from __future__ import annotations

import argparse
from typing import Any

from sessions.cli.arguments import step, text
from sessions.vocabulary import PARTITIONS


def register(verbs: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = verbs.add_parser("metrics", parents=[common], help="metric counts")
    parser.add_argument(
        "--run", type=text("a run name"), default=None, help="default: the most recent run"
    )
    parser.add_argument("--partition", choices=PARTITIONS)
    parser.add_argument(
        "--step",
        type=step,
        default=...,
        help="one step; 'none' for sessions without a step (default: all)",
    )
    parser.add_argument("--json", action="store_true")


def check(args: argparse.Namespace) -> None:
    from sessions import vocabulary

    if args.run is not None:
        vocabulary.check_run(args.run)


async def run(args: argparse.Namespace) -> int:
    from sessions.cli.render import metrics_table, print_json, show, visible

    found = await _rows_without_projecting(args)
    if found is None:  # events past the checkpoint: the projector brings the read models up first
        from sessions.cli.main import _resolve_run
        from sessions.ledger import Ledger

        async with Ledger.open(args.db, migrate=False) as ledger:
            run_name = await _resolve_run(ledger.engine, args.run)
            rows = await ledger.metrics(args.partition, args.step, run=run_name)
    else:
        rows, run_name = found
    if args.json:
        print_json([row.as_json() for row in rows])
        return 0
    chosen = "" if args.run else " (the most recent; --run NAME for another)"
    header = f"run '{visible(run_name)}'{chosen}"
    show(header, metrics_table(rows) if rows else "no metrics for this run with these filters")
    return 0


async def _rows_without_projecting(args: argparse.Namespace) -> tuple[list[Any], str] | None:
    """The rows and the run, when the checkpoint is at the log's end; None otherwise."""
    from sessions.cli.main import _resolve_run
    from sessions.projection.metrics import MetricRow
    from store import create_engine, normalize_url
    from store import read_models as rm

    engine = create_engine(normalize_url(args.db), read_only=True)
    try:
        async with engine.connect() as conn:
            if await rm.get_checkpoint(conn) < await rm.log_end(conn):
                return None
            run_name = await _resolve_run(engine, args.run, conn=conn)
            rows = await rm.metric_rows(
                conn, run=run_name, partition=args.partition, global_step=args.step
            )
        return [MetricRow.from_row(row) for row in rows], run_name
    finally:
        await engine.dispose()
