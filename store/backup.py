"""Online backup of a live SQLite ledger through SQLite's backup API (docs/operations.md).

`sqlite3.Connection.backup` copies the database a slice of pages at a time; between slices the
copy runs in one read transaction of the source, which in WAL mode (every ledger file) is a
snapshot: the recorder's appends go on meanwhile and do not restart the copy, and the copy is
that snapshot, every transaction committed before it began and none after. `pause` seconds
between slices leave the disk to the writers.

PostgreSQL has its own tools (`pg_dump -Fc` and `pg_restore`); `backup_sqlite` refuses a server
URL naming them.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from store.dialects import dialect_of
from store.engine import local_database_file, normalize_url
from store.errors import StoreInputError

#: Pages copied per slice: 256 pages of 4 KiB is 1 MiB a slice, a few milliseconds of lock.
PAGES_PER_SLICE = 256

POSTGRES_WAY = (
    "a PostgreSQL ledger is backed up with PostgreSQL's own tools: "
    "`pg_dump -Fc -f ledger.dump DBNAME` while it runs, and `createdb NEW && "
    "pg_restore -d NEW ledger.dump` to restore (docs/operations.md)"
)


@dataclass(frozen=True)
class BackupReport:
    """What one backup copied: the pages of the finished snapshot, the slices it took, how long."""

    pages: int
    slices: int
    seconds: float
    bytes: int


def sqlite_file(url: str | os.PathLike[str] | None) -> Path:
    """The SQLite file behind `url`, or `StoreInputError` naming the PostgreSQL way."""
    if not dialect_of(normalize_url(url)).online_backup:
        raise StoreInputError(f"backup copies SQLite files only; {POSTGRES_WAY}")
    path = local_database_file(url)
    if path is None:
        raise StoreInputError("an in-memory SQLite database has no file to back up")
    return Path(path)


def backup_sqlite(
    source: Path,
    target: Path,
    *,
    pages: int = PAGES_PER_SLICE,
    pause: float = 0.005,
    on_progress: Callable[[int, int], None] | None = None,
) -> BackupReport:
    """Copy the live SQLite database `source` into the new file `target`, `pages` at a time.

    `target` must not exist (the caller writes to a partial name and renames it into place). The
    source is opened read-only; the copy is switched out of WAL so it is one self-contained file.
    """
    if target.exists():
        raise StoreInputError(f"backup target {target} exists")
    started = time.perf_counter()
    slices = 0
    remaining_total = [0, 0]

    def progress(status: int, remaining: int, total: int) -> None:
        nonlocal slices
        slices += 1
        remaining_total[:] = [remaining, total]
        if on_progress is not None:
            on_progress(total - remaining, total)
        if remaining and pause:
            time.sleep(pause)  # the source's lock is free between slices: writers get in

    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=30.0, isolation_level=None)
    try:
        # One read transaction held for the whole copy: in WAL mode it is a snapshot that writers
        # do not disturb, so the copy never restarts however fast the recorder appends.
        src.execute("BEGIN")
        src.execute("SELECT count(*) FROM sqlite_master").fetchone()
        dst = sqlite3.connect(target)
        try:
            src.backup(dst, pages=pages, progress=progress)
            dst.execute("PRAGMA journal_mode=DELETE")
            (check,) = dst.execute("PRAGMA quick_check").fetchone()
            if check != "ok":
                raise StoreInputError(f"the backup of {source} failed its integrity check: {check}")
        finally:
            dst.close()
    finally:
        src.close()
    return BackupReport(
        pages=remaining_total[1],
        slices=slices,
        seconds=time.perf_counter() - started,
        bytes=target.stat().st_size,
    )
