"""The SQL of retention: which steps may be pruned, their payloads page by page, the prune's
writes (payloads replaced, the steps' queue rows dropped) in one transaction, and giving the space
back (SQLite's incremental vacuum in small slices; PostgreSQL's own autovacuum does it there).

What a payload is replaced with, and the event that records a prune, are decided above
(`sessions.runs.retention`); this module stores bytes and rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store.dialects import WRITE_LOCK, dialect_of
from store.schema.tables import events, queue_claims, queue_rows, sessions

__all__ = [
    "apply_prune",
    "auto_vacuum_mode",
    "convert_to_incremental",
    "database_bytes",
    "incremental_vacuum",
    "open_claims",
    "payload_page",
    "run_stream_events",
    "step_sizes",
    "unpruned_count",
]


async def step_sizes(
    conn: AsyncConnection, run: str, partition: str, *, with_bytes: bool = True
) -> list[tuple[int, int, int]]:
    """(step, sessions not terminal, bytes of payloads) of every step (not null) of the run's
    partition, as projected; bytes 0 without `with_bytes` (that sum reads every event's row)."""
    open_ = func.sum(func.coalesce(sessions.c.terminal_position * 0, 1))
    query = (
        select(sessions.c.global_step, open_)
        .where(
            sessions.c.run == run,
            sessions.c.partition == partition,
            sessions.c.global_step.is_not(None),
        )
        .group_by(sessions.c.global_step)
    )
    counts = {int(step): int(n) for step, n in await conn.execute(query)}
    sizes: dict[int, int] = {}
    if with_bytes:
        query = (
            select(events.c.global_step, func.sum(func.length(events.c.payload)))
            .where(
                events.c.run == run,
                events.c.partition == partition,
                events.c.global_step.is_not(None),
                events.c.payload.is_not(None),
            )
            .group_by(events.c.global_step)
        )
        sizes = {int(step): int(n or 0) for step, n in await conn.execute(query)}
    return sorted((step, n, sizes.get(step, 0)) for step, n in counts.items())


async def unpruned_count(
    conn: AsyncConnection, run: str, partition: str, steps: Sequence[int], tombstone_size: int
) -> int:
    """Payloads of the steps whose size is not a tombstone's (a prune not yet applied)."""
    query = select(func.count()).where(
        events.c.run == run,
        events.c.partition == partition,
        events.c.global_step.in_(list(steps)),
        events.c.payload.is_not(None),
        func.length(events.c.payload) != tombstone_size,
    )
    return int((await conn.execute(query)).scalar_one())


async def open_claims(
    conn: AsyncConnection, run: str, partition: str, steps: Sequence[int]
) -> list[int]:
    """The steps among `steps` with a queue row claimed by a consumer and not acked."""
    if not steps:
        return []
    query = (
        select(queue_rows.c.global_step)
        .join(queue_claims, queue_claims.c.queue_row_id == queue_rows.c.id)
        .where(
            queue_rows.c.run == run,
            queue_rows.c.partition == partition,
            queue_rows.c.global_step.in_(list(steps)),
            queue_claims.c.acked_at.is_(None),
        )
        .distinct()
    )
    return sorted(int(step) for (step,) in await conn.execute(query))


async def payload_page(
    conn: AsyncConnection,
    run: str,
    partition: str,
    steps: Sequence[int],
    *,
    after: int,
    limit: int,
) -> list[tuple[int, bytes]]:
    """(position, payload) of the steps' events that carry one, after `after`, by position."""
    query = (
        select(events.c.position, events.c.payload)
        .where(
            events.c.run == run,
            events.c.partition == partition,
            events.c.global_step.in_(list(steps)),
            events.c.payload.is_not(None),
            events.c.position > after,
        )
        .order_by(events.c.position)
        .limit(limit)
    )
    return [(int(p), bytes(b)) for p, b in await conn.execute(query)]


async def apply_prune(
    engine: AsyncEngine,
    run: str,
    partition: str,
    steps: Sequence[int],
    replacements: Sequence[tuple[int, bytes]],
) -> int:
    """Replace the payloads, drop the steps' queue rows (and their claims), in one transaction
    under the write lock; returns the queue rows dropped."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(**{WRITE_LOCK: True})
        async with conn.begin():
            for position, payload in replacements:
                await conn.execute(
                    update(events).where(events.c.position == position).values(payload=payload)
                )
            step_rows = select(queue_rows.c.id).where(
                and_(
                    queue_rows.c.run == run,
                    queue_rows.c.partition == partition,
                    queue_rows.c.global_step.in_(list(steps)),
                )
            )
            await conn.execute(
                delete(queue_claims).where(queue_claims.c.queue_row_id.in_(step_rows))
            )
            dropped = await conn.execute(
                delete(queue_rows).where(
                    queue_rows.c.run == run,
                    queue_rows.c.partition == partition,
                    queue_rows.c.global_step.in_(list(steps)),
                )
            )
    return int(dropped.rowcount or 0)


async def run_stream_events(
    conn: AsyncConnection, stream: str, type_: str
) -> list[tuple[int, Any, Any]]:
    """(position, recorded_at, data) of a stream's events of one type, in order (a run's stream
    is small: its configurations and prunes)."""
    query = (
        select(events.c.position, events.c.recorded_at, events.c.data)
        .where(events.c.session_id == stream, events.c.type == type_)
        .order_by(events.c.version)
    )
    return [tuple(row) for row in await conn.execute(query)]  # type: ignore[misc]


async def database_bytes(engine: AsyncEngine) -> int:
    """The database's size: SQLite's pages in use times the page size, PostgreSQL's
    pg_database_size."""
    async with engine.connect() as conn:
        return await dialect_of(engine).bytes_in_use(conn)


async def auto_vacuum_mode(engine: AsyncEngine) -> str | None:
    """SQLite's auto_vacuum mode (none / full / incremental); None on PostgreSQL."""
    async with engine.connect() as conn:
        return await dialect_of(engine).auto_vacuum_mode(conn)


async def convert_to_incremental(engine: AsyncEngine) -> bool:
    """Make an existing SQLite file incremental-vacuum (a one-time VACUUM, which rewrites the
    whole file and holds the write lock while it does); False if it already is or on PostgreSQL."""
    if await auto_vacuum_mode(engine) in (None, "incremental"):
        return False
    async with engine.connect() as conn:
        await conn.exec_driver_sql("PRAGMA auto_vacuum = INCREMENTAL")
        await conn.exec_driver_sql("VACUUM")
    return True


async def incremental_vacuum(
    engine: AsyncEngine, *, pages: int = 256, pause: float = 0.01, max_slices: int | None = None
) -> int:
    """Give SQLite's free pages back to the OS, `pages` at a time, each slice its own short
    write transaction with a pause between so appends get in; returns the pages freed (0 on
    PostgreSQL, whose autovacuum reclaims dead rows, or on a file without incremental
    auto_vacuum)."""
    if await auto_vacuum_mode(engine) != "incremental":
        return 0
    freed, slices = 0, 0
    while max_slices is None or slices < max_slices:
        async with engine.connect() as conn:
            conn = await conn.execution_options(**{WRITE_LOCK: True})
            async with conn.begin():  # one short write transaction a slice
                before = (await conn.exec_driver_sql("PRAGMA freelist_count")).scalar_one()
                if not before:
                    break
                await conn.exec_driver_sql(f"PRAGMA incremental_vacuum({int(pages)})")
                after = (await conn.exec_driver_sql("PRAGMA freelist_count")).scalar_one()
        freed += int(before) - int(after)
        slices += 1
        if int(after) >= int(before):
            break
        await asyncio.sleep(pause)
    return freed
