"""`rollout-ledger report --out DIR [--run R]` (issue 17): a static HTML report of one run.

Projects first (as `metrics` does; `--no-project` only reads), then writes `DIR/index.html` and
its figures beside it (see docs/report.md). Nothing heavy is imported until the verb runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sessions.cli.arguments import integer, text

__all__ = ["check", "register", "run"]


def register(verbs: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the `report` parser (the `report` extra, matplotlib, is needed only to run it)."""
    report = verbs.add_parser(
        "report",
        parents=[common],
        help="write a static HTML report with figures (needs the report extra)",
    )
    report.add_argument(
        "--out",
        required=True,
        type=text("a folder path"),
        metavar="DIR",
        help="folder for index.html and its PNG figures: a new or empty folder, or an earlier "
        "report, which is replaced whole",
    )
    report.add_argument(
        "--force",
        action="store_true",
        help="replace a folder of only index.html and PNGs that this verb did not write",
    )
    report.add_argument(
        "--run", type=text("a run name"), default=None, help="default: the most recent run"
    )
    report.add_argument(
        "--max-points",
        type=integer(1, 100_000),
        default=None,
        metavar="N",
        help="at most N points per line; longer runs are bucketed (default: 200)",
    )
    report.add_argument(
        "--failures",
        type=integer(1, 100_000),
        default=None,
        metavar="N",
        help="failed sessions listed, newest first (default: 50)",
    )
    report.add_argument(
        "--dpi",
        type=integer(20, 600),
        default=None,
        help="resolution of the PNGs (default: 100)",
    )
    report.add_argument(
        "--no-project",
        action="store_true",
        help="only read: do not project the log first (the page says how far it is projected)",
    )


def check(args: argparse.Namespace) -> None:
    """Refuse a bad --out, or a missing matplotlib, before the database is opened."""
    from sessions.report.drawing import require_matplotlib
    from sessions.report.write import check_out

    check_out(Path(args.out), databases=[args.db], force=args.force)
    require_matplotlib()


async def run(args: argparse.Namespace) -> int:
    from sessions.ledger import Ledger
    from sessions.report.data import FAILURE_ROWS, gather, resolve_run
    from sessions.report.downsample import MAX_POINTS
    from sessions.report.write import DEFAULT_DPI, write_report

    failures = args.failures or FAILURE_ROWS
    reading = {"read_only": True} if args.no_project else {}  # only reads: keeps the journal mode
    async with Ledger.open(args.db, migrate=False, engine_options=reading) as ledger:
        if not args.no_project:
            await ledger.project()
        run_name = await resolve_run(ledger.engine, args.run)
        data = await gather(ledger.engine, run_name, failures=failures)
    files = write_report(
        data,
        Path(args.out),
        dpi=args.dpi or DEFAULT_DPI,
        max_points=args.max_points or MAX_POINTS,
        failure_limit=failures,
        force=args.force,
    )
    p = data.positions
    lag = f" ({data.behind:,} event(s) not projected)" if data.behind else ""
    what = "nothing projected yet" if data.empty else f"{len(files.figures)} figures"
    print(
        f"wrote {files.index} ({what}) for run {run_name!r} in {files.seconds:.1f}s; "
        f"projected up to position {p['projected']:,} of {p['log_end']:,}{lag}"
    )
    return 0
