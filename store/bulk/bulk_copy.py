"""Copy the `events` table between databases at driver level, never decoding `data` or payloads.

Replay copies a whole log; through SQLAlchemy Core every row would be turned into a
dict, its JSON decoded and re-encoded and its bind parameters processed (~60 µs a row). Here:

* SQLite file into SQLite: the target ATTACHes the source and runs one `INSERT INTO events
  SELECT …`, so the rows never leave SQLite. Where the two tables have the same columns and the
  whole log is copied, it is `INSERT INTO events SELECT * FROM …`, which SQLite runs as its
  transfer optimisation (as VACUUM does): records and index entries are copied as they are
  stored, in key order, instead of re-encoded and inserted into each index at random places
  (about twice as fast on the benchmark's log, whose event_id index is in random order).
* Anything else (PostgreSQL on either side, an in-memory SQLite source): keyset pages of plain
  tuples read with the source's driver (`data` as JSON text), written with `executemany`
  (SQLite) or `COPY` (`asyncpg.copy_records_to_table`, PostgreSQL). Only `recorded_at` is
  converted between backends, with SQLAlchemy's own type processors.

The copy is one transaction on the target. `before_commit` runs in it, after the rows are in,
so a caller (replay) commits its read models with the log or nothing at all: an interrupted
replay leaves an empty target, never a log without its read models or half a log.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from datetime import timezone
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from store.bulk import driver
from store.dialects import dialect_of
from store.faults import wraps_faults
from store.schema.tables import events

COLUMNS = tuple(c.name for c in events.c)
_ALIAS = "replay_source"
PAGE = 20_000


@wraps_faults()
async def copy_events(
    source: AsyncEngine,
    target: AsyncEngine,
    *,
    up_to: int | None = None,
    page_size: int = PAGE,
    on_page: Callable[[int], None] | None = None,
    on_end: Callable[[int], None] | None = None,
    before_commit: Callable[[driver.Writer], Awaitable[None]] | None = None,
) -> int:
    """Copy `events` (positions <= `up_to`, or all) verbatim into the target's empty `events` table.

    `on_end` is told, before any row is copied, the last position the copy goes to (0 for an
    empty log): a reader of the source that stops there sees exactly the copied rows, while the
    copy runs. `before_commit` runs in the copy's transaction, after its rows.
    Returns the number of rows copied. The caller checks that the target is empty.
    """
    tell = on_end if on_end is not None else (lambda _end: None)
    attach = _attachable(source, target)
    if attach is not None:
        copied = await _copy_attached(target, attach, up_to, tell, before_commit)
        if on_page is not None and copied:
            on_page(copied)
        return copied
    return await _copy_paged(source, target, up_to, max(1, page_size), on_page, tell, before_commit)


def _attachable(source: AsyncEngine, target: AsyncEngine) -> str | None:
    """The source's file name if the target can ATTACH it: both SQLite, the source a plain file."""
    dialect = dialect_of(source)
    return dialect.attachable_file(source.url) if dialect_of(target) is dialect else None


async def _copy_attached(
    target: AsyncEngine,
    path: str,
    up_to: int | None,
    tell: Callable[[int], None],
    before_commit: Callable[[driver.Writer], Awaitable[None]] | None,
) -> int:
    async with driver.driver_connection(target) as db:
        await db.execute(
            f"ATTACH DATABASE ? AS {_ALIAS}", (path,)
        )  # outside a transaction, as SQLite needs
        wal = await _leave_wal(db)
        write = driver.Writer(db, dialect_of(target))
        try:
            await write.begin()
            try:
                # The source's read snapshot starts here and lasts the transaction: the end told
                # is the end copied, however the source grows meanwhile.
                last = int(
                    (await write.fetch(f"SELECT coalesce(max(position), 0) FROM {_ALIAS}.events"))[
                        0
                    ][0]
                )
                end = last if up_to is None else min(up_to, last)
                tell(end)
                copied = await _insert_attached(db, end, whole=end == last)
                flushing = asyncio.ensure_future(asyncio.to_thread(_flush, target.url.database))
                try:
                    if before_commit is not None:
                        await before_commit(write)
                finally:
                    await flushing
                await write.commit()
            finally:
                await write.rollback()  # a no-op once committed
        finally:
            await db.execute(f"DETACH DATABASE {_ALIAS}")
            if wal:
                await _pragma(db, "PRAGMA main.journal_mode = WAL")
    return copied


async def _insert_attached(db: Any, end: int, *, whole: bool) -> int:
    """The INSERT … SELECT of the attached log up to `end` (`whole`: that is all of it)."""
    if whole and await _same_columns(db):
        sql = f"INSERT INTO main.events SELECT * FROM {_ALIAS}.events"  # SQLite's transfer optimisation
        params: tuple[Any, ...] = ()
    else:
        names = ", ".join(COLUMNS)
        sql = f"INSERT INTO main.events ({names}) SELECT {names} FROM {_ALIAS}.events WHERE position <= ? ORDER BY position"
        params = (end,)
    cursor = await db.execute(sql, params)
    try:
        return int(cursor.rowcount)
    finally:
        await cursor.close()


async def _same_columns(db: Any) -> bool:
    """Whether both `events` tables have the same columns in the same order (then `SELECT *`
    copies each value into its own column, as the named INSERT does)."""

    async def names(schema: str) -> list[tuple[Any, ...]]:
        cursor = await db.execute(f"PRAGMA {schema}.table_info(events)")
        try:
            return [
                tuple(row[1:]) for row in await cursor.fetchall()
            ]  # name, type, notnull, default, pk
        finally:
            await cursor.close()

    return await names("main") == await names(_ALIAS)


def _flush(path: str | None) -> None:
    """Hand the copied pages to the disk now, while the caller's work goes on, so that the commit's
    sync finds little left to write (the copy is most of the file: 400 MB for 100k events).
    Only an earlier start of the sync the commit does anyway; nothing relies on it."""
    if not path:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        getattr(os, "fdatasync", os.fsync)(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    source: AsyncEngine,
    target: AsyncEngine,
    up_to: int | None,
    page_size: int,
    on_page: Callable[[int], None] | None,
    tell: Callable[[int], None],
    before_commit: Callable[[driver.Writer], Awaitable[None]] | None,
) -> int:
    convert = recorded_at_converter(source, target)
    index = COLUMNS.index("recorded_at")
    copied, last = 0, 0
    async with driver.reader(source) as read, driver.writer(target) as write:
        # Appends commit in position order (docs/design.md §8), so every event up to the log's end now is
        # there to copy, and a reader that stops at it sees the same rows.
        end = int((await read.fetch("SELECT coalesce(max(position), 0) FROM events"))[0][0])
        end = end if up_to is None else min(up_to, end)
        tell(end)
        while True:
            rows = await read.events_page(COLUMNS, after=last, up_to=end, limit=page_size)
            if not rows:
                break
            last = rows[-1][0]
            if convert is not None:
                rows = [(*row[:index], convert(row[index]), *row[index + 1 :]) for row in rows]
            await write.insert("events", COLUMNS, rows)
            copied += len(rows)
            if on_page is not None:
                on_page(len(rows))
        if copied:
            await write.after_explicit_positions("events", "position", last)
        if before_commit is not None:
            await before_commit(write)
        await write.commit()
    return copied


def recorded_at_converter(source: AsyncEngine, target: AsyncEngine) -> Callable[[Any], Any] | None:
    """SQLite keeps `recorded_at` as text, PostgreSQL as timestamptz: convert only across backends."""
    if dialect_of(source) is dialect_of(target):
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
