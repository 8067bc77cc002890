"""Copy the `events` table between databases at driver level, never decoding `data` or payloads.

Replay copies a whole log; through SQLAlchemy Core every row would be turned into a
dict, its JSON decoded and re-encoded and its bind parameters processed (~60 µs a row). Here:

* SQLite file into SQLite: the target ATTACHes the source and runs one `INSERT INTO events
  SELECT …`, so the rows never leave SQLite.
* Anything else (PostgreSQL on either side, an in-memory SQLite source): keyset pages of plain
  tuples read with the source's driver (`data` as JSON text), written with `executemany`
  (SQLite) or `COPY` (`asyncpg.copy_records_to_table`, PostgreSQL). Only `recorded_at` is
  converted between backends, with SQLAlchemy's own type processors.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timezone
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from store import driver
from store.tables import events

COLUMNS = tuple(c.name for c in events.c)
_ALIAS = "replay_source"
PAGE = 20_000


async def copy_events(
    source: AsyncEngine,
    target: AsyncEngine,
    *,
    up_to: int | None = None,
    page_size: int = PAGE,
    on_page: Callable[[int], None] | None = None,
) -> int:
    """Copy `events` (positions <= `up_to`, or all) verbatim into the target's empty `events` table.

    Returns the number of rows copied. The caller checks that the target is empty.
    """
    attach = _attachable(source, target)
    if attach is not None:
        copied = await _copy_attached(target, attach, up_to)
        if on_page is not None and copied:
            on_page(copied)
        return copied
    return await _copy_paged(source, target, up_to, max(1, page_size), on_page)


def _attachable(source: AsyncEngine, target: AsyncEngine) -> str | None:
    """The source's file name if the target can ATTACH it: both SQLite, the source a plain file."""
    if source.dialect.name != "sqlite" or target.dialect.name != "sqlite":
        return None
    url = source.url
    database = url.database
    if not database or database == ":memory:" or url.query.get("mode") == "memory":
        return None
    if str(url.query.get("uri", "")).lower() in ("true", "1"):
        return None  # a `file:` URI (read-only, immutable…): ATTACH would take it for a file name
    return database


async def _copy_attached(target: AsyncEngine, path: str, up_to: int | None) -> int:
    names = ", ".join(COLUMNS)
    where = "" if up_to is None else " WHERE position <= ?"
    params: tuple[Any, ...] = () if up_to is None else (up_to,)
    async with driver.driver_connection(target) as db:
        await db.execute(f"ATTACH DATABASE ? AS {_ALIAS}", (path,))  # outside a transaction, as SQLite needs
        wal = await _leave_wal(db)
        try:
            await db.execute("BEGIN IMMEDIATE")
            try:
                cursor = await db.execute(
                    f"INSERT INTO main.events ({names}) SELECT {names} FROM {_ALIAS}.events{where} ORDER BY position", params
                )
                copied = cursor.rowcount
                await cursor.close()
                await db.execute("COMMIT")
            except BaseException:
                await db.execute("ROLLBACK")
                raise
        finally:
            await db.execute(f"DETACH DATABASE {_ALIAS}")
            if wal:
                await _pragma(db, "PRAGMA main.journal_mode = WAL")
    return int(copied)


async def _leave_wal(db: Any) -> bool:
    """Switch a WAL target to a rollback journal for the copy, if no other connection has it open.

    In WAL mode every page of the log would be written twice — to the WAL, then by the checkpoint
    into the file — and the copy takes about twice as long. A fresh file's new pages need no
    journal. Returns whether it switched (the caller switches back); with other connections open
    SQLite refuses, and the copy goes through the WAL as usual.
    """
    if await _pragma(db, "PRAGMA main.journal_mode") != "wal":
        return False
    return await _pragma(db, "PRAGMA main.journal_mode = DELETE") == "delete"


async def _pragma(db: Any, sql: str) -> Any:
    cursor = await db.execute(sql)
    try:
        row = await cursor.fetchone()
    finally:
        await cursor.close()
    return None if row is None else row[0]


async def _copy_paged(
    source: AsyncEngine, target: AsyncEngine, up_to: int | None, page_size: int,
    on_page: Callable[[int], None] | None,
) -> int:
    convert = recorded_at_converter(source, target)
    index = COLUMNS.index("recorded_at")
    copied, last = 0, 0
    async with driver.reader(source) as read, driver.writer(target) as write:
        while True:
            rows = await read.events_page(COLUMNS, after=last, up_to=up_to, limit=page_size)
            if not rows:
                break
            last = rows[-1][0]
            if convert is not None:
                rows = [(*row[:index], convert(row[index]), *row[index + 1:]) for row in rows]
            await write.insert("events", COLUMNS, rows)
            copied += len(rows)
            if on_page is not None:
                on_page(len(rows))
        if copied:
            await write.after_explicit_positions("events", "position", last)
        await write.commit()
    return copied


def recorded_at_converter(source: AsyncEngine, target: AsyncEngine) -> Callable[[Any], Any] | None:
    """SQLite keeps `recorded_at` as text, PostgreSQL as timestamptz: convert only across backends."""
    if source.dialect.name == target.dialect.name:
        return None
    column = events.c.recorded_at.type
    read = column.dialect_impl(source.dialect).result_processor(source.dialect, None)
    write = column.dialect_impl(target.dialect).bind_processor(target.dialect)

    def convert(value: Any) -> Any:
        if read is not None:
            value = read(value)
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)  # SQLite stores UTC without its zone
        return write(value) if write is not None else value

    return convert
