"""`rollout-ledger backup`: an online copy of a live SQLite ledger (docs/operations.md).

The copy is made with SQLite's backup API a slice of pages at a time (`store.backup`), so the
recorder keeps appending meanwhile; it is written beside `--out` and renamed into place. `--out`
follows `sessions/export/outputs.py`: never the ledger itself nor any file holding a ledger (an
earlier backup included: remove it first), another existing file only with `--force`. A
PostgreSQL `--db` is refused with the way to back it up (`pg_dump` / `pg_restore`).
"""

from __future__ import annotations

import argparse

from sessions.cli.arguments import integer, number, text


def register(verbs: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = verbs.add_parser(
        "backup",
        parents=[common],
        help="an online copy of a live SQLite ledger (SQLite's backup API)",
        description="Copy a SQLite ledger while it is written, a slice of pages at a time; the "
        "copy is one consistent snapshot. PostgreSQL: use pg_dump / pg_restore.",
    )
    parser.add_argument(
        "--out", required=True, type=text("a file path"), help="the new backup file to write"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace an existing file that is not a ledger"
    )
    parser.add_argument(
        "--pages",
        type=integer(1, 1_000_000, "a page count"),
        default=256,
        help="pages copied per slice (default 256)",
    )
    parser.add_argument(
        "--pause",
        type=number(0.0, 10.0, "seconds"),
        default=0.005,
        help="seconds between slices, when writers get the file (default 0.005)",
    )


def check(args: argparse.Namespace) -> None:
    """Refuse an `--out` that cannot or must not be written, before the database is opened: a
    missing folder or a directory is `--out`'s fault, not `--db`'s."""
    import os

    from sessions.errors import ConfigError
    from sessions.export.outputs import check_target
    from store import backup

    backup.sqlite_file(args.db)  # a PostgreSQL URL is refused here, naming pg_dump
    out = args.out
    if os.path.isdir(out):
        raise ConfigError(
            f"--out {out} is a directory: pass a file path such as {os.path.join(out, 'ledger-backup.db')}"
        )
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ConfigError(
            f"--out {out}: folder {os.path.dirname(out) or folder} does not exist; create it first "
            "(mkdir -p) or pass another path"
        )
    check_target(out, flag="--out", databases=[args.db], force=args.force)


async def run(args: argparse.Namespace) -> int:
    import asyncio

    from sessions.export.outputs import check_target, partial_file
    from store import backup

    source = backup.sqlite_file(args.db)
    target = check_target(args.out, flag="--out", databases=[args.db], force=args.force)
    with partial_file(target) as partial:
        report = await asyncio.to_thread(
            backup.backup_sqlite, source, partial, pages=args.pages, pause=args.pause
        )
    print(
        f"backed up {report.pages} pages ({report.bytes} bytes) to {args.out} in "
        f"{report.seconds:.2f}s ({report.slices} slices); check it with "
        f"`rollout-ledger audit --db {args.out}`"
    )
    return 0
