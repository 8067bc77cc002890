"""SQLite's answers: one file on one host, aiosqlite for the async engine.

Writers take the file's write lock up front (`BEGIN IMMEDIATE` under `WRITE_LOCK`), so no lock
statement serialises appends, projector pages or migrators; a follower needs no election. The
connection settings (WAL, busy timeout, our own BEGIN) are `sqlite_engine.py`'s, what its errors
look like `sqlite_errors.py`'s; a live file is copied with sqlite3's online backup API.
"""

from __future__ import annotations

import shlex
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store.dialects.base import Dialect, DriverCalls, Row
from store.dialects.sqlite_engine import in_memory, sqlite_engine, sqlite_file, writer_twin
from store.dialects.sqlite_errors import (
    DISK_FULL_TEXTS,
    FILE_PROBLEM_TEXTS,
    HINTS,
    LOCK_TIMEOUT_TEXTS,
    describe,
)
from store.errors import StoreInputError

__all__ = ["SqliteDialect"]


class _AiosqliteCalls(DriverCalls):
    """aiosqlite's API: `?` marks, `executemany`, transactions as plain statements."""

    async def fetch(self, conn: Any, sql: str, params: Sequence[Any]) -> list[Row]:
        cursor = await conn.execute(sql, tuple(params))
        try:
            return list(await cursor.fetchall())
        finally:
            await cursor.close()

    async def stream(
        self, conn: Any, sql: str, params: Sequence[Any], chunk: int
    ) -> AsyncIterator[list[Row]]:
        cursor = await conn.execute(sql, tuple(params))
        try:
            while rows := await cursor.fetchmany(chunk):
                yield list(rows)
        finally:
            await cursor.close()

    async def execute(self, conn: Any, sql: str, params: Sequence[Any]) -> None:
        cursor = await conn.execute(sql, tuple(params))
        await cursor.close()

    async def begin(self, conn: Any) -> None:
        await conn.execute("BEGIN IMMEDIATE")  # the write lock up front, as the projector takes it

    async def commit(self, conn: Any, transaction: Any) -> None:
        await conn.execute("COMMIT")

    async def rollback(self, conn: Any, transaction: Any) -> None:
        await conn.execute("ROLLBACK")

    async def insert(
        self, conn: Any, table: str, columns: Sequence[str], rows: Sequence[Row]
    ) -> None:
        marks = ", ".join("?" * len(columns))
        await conn.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})", rows)


class SqliteDialect(Dialect):
    name = "sqlite"
    async_driver = "sqlite+aiosqlite"
    alembic_batch = True  # SQLite alters few things in place: Alembic copies the table instead
    online_backup = True
    driver = _AiosqliteCalls()
    driver_modules = ("sqlite3", "aiosqlite")  # aiosqlite raises sqlite3's errors
    lock_timeout_texts = LOCK_TIMEOUT_TEXTS
    disk_full_texts = DISK_FULL_TEXTS
    hint_texts = tuple(fragment for fragment, _ in HINTS) + FILE_PROBLEM_TEXTS

    def owns(self, error: BaseException) -> bool:
        return isinstance(error, sqlite3.Error)

    def describe_error(
        self, error: BaseException | None, message: str, where: str, urls: Sequence[URL]
    ) -> str | None:
        return describe(message, where, urls, self.local_file)

    def mark(self, index: int) -> str:
        return "?"

    def upsert(self, table: Any) -> Any:
        return sqlite.insert(table)

    def timestamp_param(self, value: datetime) -> Any:
        # SQLAlchemy's SQLite DateTime text form; reads parse it back (as UTC: we only write UTC).
        t = value.astimezone(timezone.utc) if value.utcoffset() else value
        return f"{t.year:04d}-{t.month:02d}-{t.day:02d} {t.hour:02d}:{t.minute:02d}:{t.second:02d}.{t.microsecond:06d}"

    async def lease_now(self, conn: AsyncConnection) -> datetime:
        return datetime.now(timezone.utc)  # one file on one host: this process's clock

    async def start_read_only(self, conn: AsyncConnection, timeout: float | None) -> None:
        await conn.exec_driver_sql("PRAGMA query_only = ON")
        if timeout:
            await _deadline(conn, timeout)

    async def end_read_only(self, conn: AsyncConnection, timeout: float | None) -> None:
        if timeout:
            await _deadline(conn, None)
        await conn.exec_driver_sql("PRAGMA query_only = OFF")

    def create_engine(
        self,
        url: str,
        parsed: URL,
        *,
        sqlite_busy_timeout: float | None,
        read_only: bool = False,
        **kwargs: Any,
    ) -> AsyncEngine:
        return sqlite_engine(
            url, parsed, busy_timeout=sqlite_busy_timeout, read_only=read_only, **kwargs
        )

    def local_file(self, parsed: URL) -> str | None:
        return None if in_memory(parsed) else sqlite_file(parsed)

    def describe(self, parsed: URL) -> tuple[str, str]:
        path = sqlite_file(parsed) or ":memory:"
        return f"SQLite file {path}", shlex.quote(path)

    async def bytes_in_use(self, conn: AsyncConnection) -> int:
        count = (await conn.exec_driver_sql("PRAGMA page_count")).scalar_one()
        free = (await conn.exec_driver_sql("PRAGMA freelist_count")).scalar_one()
        size = (await conn.exec_driver_sql("PRAGMA page_size")).scalar_one()
        return int(count - free) * int(size)

    async def auto_vacuum_mode(self, conn: AsyncConnection) -> str | None:
        mode = (await conn.exec_driver_sql("PRAGMA auto_vacuum")).scalar_one()
        return {0: "none", 1: "full", 2: "incremental"}.get(int(mode), str(mode))

    def append_thread_engine(self, engine: AsyncEngine) -> sqlalchemy.Engine | None:
        return writer_twin(engine)

    def copy_live(
        self,
        source: Path,
        target: Path,
        *,
        pages: int,
        progress: Callable[[int, int, int], None],
    ) -> None:
        # sqlite3's backup API copies `pages` at a time; between slices the copy runs in one read
        # transaction of the source, which in WAL mode (every ledger file) is a snapshot.
        src = sqlite3.connect(
            f"file:{source}?mode=ro", uri=True, timeout=30.0, isolation_level=None
        )
        try:
            # One read transaction held for the whole copy: in WAL mode it is a snapshot that
            # writers do not disturb, so the copy never restarts however fast the recorder appends.
            src.execute("BEGIN")
            src.execute("SELECT count(*) FROM sqlite_master").fetchone()
            dst = sqlite3.connect(target)
            try:
                src.backup(dst, pages=pages, progress=progress)
                dst.execute("PRAGMA journal_mode=DELETE")
                (check,) = dst.execute("PRAGMA quick_check").fetchone()
                if check != "ok":
                    raise StoreInputError(
                        f"the backup of {source} failed its integrity check: {check}"
                    )
            finally:
                dst.close()
        finally:
            src.close()

    def attachable_file(self, url: URL) -> str | None:
        database = url.database
        if not database or database == ":memory:" or url.query.get("mode") == "memory":
            return None
        if str(url.query.get("uri", "")).lower() in ("true", "1"):
            return (
                None  # a `file:` URI (read-only, immutable…): ATTACH would take it for a file name
            )
        return database


async def _deadline(conn: AsyncConnection, seconds: float | None) -> None:
    """Interrupt the statement after `seconds` (None: remove the handler), checked every 1000 VM steps."""
    raw = (await conn.get_raw_connection()).driver_connection
    if seconds is None:
        await raw.set_progress_handler(None, 0)
        return
    deadline = time.monotonic() + seconds
    await raw.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
