"""`rollout-ledger export-dataset`: a run's terminal sessions as a Parquet or JSONL file.

The parser is added without importing anything heavy; `check` refuses bad arguments (steps, an
unwritable --out, a format the file name contradicts) before the database is opened; `run`
exports as of the projector's checkpoint, with a progress bar on stderr, and prints what was
written and what was left out (docs/export.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sessions.cli.arguments import integer, text
from sessions.errors import ConfigError


def register(verbs: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from sessions.vocabulary import PARTITIONS

    parser = verbs.add_parser(
        "export-dataset",
        parents=[common],
        help="a run's terminal sessions as a Parquet or JSONL dataset",
        description="Write a run's terminal sessions (as of the projector's checkpoint) to a Parquet or JSONL "
        "file, failures included unless --successes-only. Columns: docs/export.md.",
    )
    parser.add_argument(
        "--format",
        choices=("parquet", "jsonl"),
        default=None,
        help="default: jsonl for an --out ending in .jsonl, else parquet",
    )
    parser.add_argument(
        "--out",
        required=True,
        type=text("a file path"),
        metavar="PATH",
        help="the file to write (replaced whole if it is an earlier export)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace an existing file this verb did not write"
    )
    parser.add_argument(
        "--run", type=text("a run name"), default=None, help="default: the most recent run"
    )
    parser.add_argument("--partition", choices=PARTITIONS, default=None, help="default: both")
    parser.add_argument(
        "--steps",
        default=None,
        type=text("a step range such as 0:9"),
        metavar="A:B",
        help="global steps A to B, both included (also A:, :B or N); sessions without a step are then left out",
    )
    failures = parser.add_mutually_exclusive_group()
    failures.add_argument(
        "--include-failed",
        dest="include_failed",
        action="store_true",
        default=True,
        help="failed and cancelled sessions are rows too (the default)",
    )
    failures.add_argument(
        "--successes-only",
        dest="include_failed",
        action="store_false",
        help="succeeded sessions only",
    )
    parser.add_argument(
        "--per",
        choices=("session", "trajectory"),
        default="session",
        help="one row per session (default) or per recorded trajectory",
    )
    parser.add_argument(
        "--row-group-size",
        type=integer(1, 1_000_000),
        default=1000,
        metavar="N",
        help="sessions read and rows written per Parquet row group (default 1000)",
    )


def _format(args: argparse.Namespace) -> str:
    if args.format is not None:
        return str(args.format)
    return "jsonl" if Path(args.out).suffix.lower() == ".jsonl" else "parquet"


def check(args: argparse.Namespace) -> None:
    """Refuse bad arguments before the database is opened (each a one-line ValueError)."""
    from sessions.export.dataset import parse_steps
    from sessions.export.writers import ExportError, check_destination

    args.steps_range = parse_steps(args.steps)
    if args.row_group_size < 1:
        raise ConfigError(f"--row-group-size must be >= 1, got {args.row_group_size}")
    suffix = Path(args.out).suffix.lower()
    chosen = _format(args)
    if (suffix == ".jsonl" and chosen == "parquet") or (suffix == ".parquet" and chosen == "jsonl"):
        raise ConfigError(
            f"--format {chosen} contradicts --out {args.out}: name the file .{chosen}, or drop --format"
        )
    try:
        check_destination(Path(args.out))
    except ExportError as error:
        raise ConfigError(str(error).replace("the export to", "--out")) from None
    if chosen == "parquet":
        from sessions.export.writers import import_pyarrow

        import_pyarrow()
    from sessions.export.outputs import check_target
    from sessions.export.writers import made_by_export

    check_target(
        args.out, flag="--out", databases=[args.db], force=args.force, made_here=made_by_export
    )


async def run(args: argparse.Namespace) -> int:
    from sessions.cli.main import _resolve_run
    from sessions.cli.render import export_progress, print_summary
    from sessions.export import export_dataset
    from sessions.ledger import Ledger

    steps = getattr(args, "steps_range", None) or args.steps
    # reads only (as of the checkpoint): the file keeps its journal mode
    async with Ledger.open(args.db, migrate=False, engine_options={"read_only": True}) as ledger:
        run_name = await _resolve_run(ledger.engine, args.run)
        with export_progress() as advance:
            summary = await export_dataset(
                ledger,
                args.out,
                format=_format(args),
                run=run_name,
                partition=args.partition,
                steps=steps,
                include_failed=args.include_failed,
                per=args.per,
                row_group_size=args.row_group_size,
                on_progress=advance,
            )
    print_summary(summary.lines(), run_named=bool(args.run))
    return 0
