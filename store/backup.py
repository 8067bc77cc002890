"""Online backup of a live SQLite ledger through SQLite's backup API (docs/operations.md).

The dialect's `copy_live` (SQLite's online backup API) copies the database a slice of pages at a
time; between slices the copy runs in one read transaction of the source, which in WAL mode
(every ledger file) is a snapshot: the recorder's appends go on meanwhile and do not restart the
copy, and the copy is that snapshot, every transaction committed before it began and none after.
`pause` seconds between slices leave the disk to the writers.

A backend without `online_backup` has its own tools (PostgreSQL: `pg_dump -Fc` and
`pg_restore`); `sqlite_file` refuses its URL naming them (`Dialect.backup_tools`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from store.dialects import SQLITE, dialect_of
from store.engine import local_database_file, normalize_url
from store.errors import StoreInputError

#: Pages copied per slice: 256 pages of 4 KiB is 1 MiB a slice, a few milliseconds of lock.
_PAGES_PER_SLICE = 256


@dataclass(frozen=True)
class _BackupReport:
    """What one backup copied: the pages of the finished snapshot, the slices it took, how long."""

    pages: int
    slices: int
    seconds: float
    bytes: int


def sqlite_file(url: str | os.PathLike[str] | None) -> Path:
    """The SQLite file behind `url`, or `StoreInputError` naming the backend's own tools."""
    dialect = dialect_of(normalize_url(url))
    if not dialect.online_backup:
        raise StoreInputError(f"backup copies SQLite files only; {dialect.backup_tools}")
    path = local_database_file(url)
    if path is None:
        raise StoreInputError("an in-memory SQLite database has no file to back up")
    return Path(path)


def backup_sqlite(
    source: Path,
    target: Path,
    *,
    pages: int = _PAGES_PER_SLICE,
    pause: float = 0.005,
    on_progress: Callable[[int, int], None] | None = None,
) -> _BackupReport:
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

    SQLITE.copy_live(source, target, pages=pages, progress=progress)
    return _BackupReport(
        pages=remaining_total[1],
        slices=slices,
        seconds=time.perf_counter() - started,
        bytes=target.stat().st_size,
    )
