"""The SQL of retention: which steps may be pruned, their payloads page by page, a prune's record
written under the append lock only if its step is still what the prune read (every session
terminal, the same payloads, projected, no earlier prune), the prune's rewrite (payloads replaced
and marked `pruned_by`, the step's queue rows dropped) in one transaction, and giving the space
back (SQLite's incremental vacuum in small slices; PostgreSQL's own autovacuum does it there).

What a payload is replaced with, and the event that records a prune, are decided above
(`sessions.runs.retention`); this module stores bytes and rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, case, delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store.dialects import WRITE_LOCK, dialect_of
from store.log.append_sql import insert_events, lock_for_append, pruned_steps
from store.log.records import NewEvent
from store.read_models.keys import PROJECTOR
from store.schema.tables import checkpoints, events, queue_claims, queue_rows, sessions

__all__ = [
    "StepPayloads",
    "apply_prune",
    "auto_vacuum_mode",
    "convert_to_incremental",
    "database_bytes",
    "incremental_vacuum",
    "open_claims",
    "payload_page",
    "pruned_steps",
    "record_prune",
    "run_stream_events",
    "step_sizes",
    "leftover_steps",
    "rewritten_by",
]

#: What `record_prune` found instead of recording: the step was pruned by another prune (the
#: detail is its id), has sessions not terminal (how many), changed since the prune read its
#: payloads, or holds events the projector has not reached yet (its checkpoint).
ALREADY_PRUNED, OPEN_SESSIONS, CHANGED, NOT_PROJECTED = "pruned", "open", "changed", "behind"


@dataclass(frozen=True, slots=True)
class StepPayloads:
    """The payloads a prune read of one step: how many are not pruned, and the last position."""

    count: int
    last_position: int


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
    before: int | None = None,
) -> list[tuple[int, bytes]]:
    """(position, payload) of the steps' events that carry a payload no prune replaced, after
    `after` (and before `before`), by position."""
    query = (
        select(events.c.position, events.c.payload)
        .where(
            events.c.run == run,
            events.c.partition == partition,
            events.c.global_step.in_(list(steps)),
            events.c.payload.is_not(None),
            events.c.pruned_by.is_(None),
            events.c.position > after,
            *(() if before is None else (events.c.position < before,)),
        )
        .order_by(events.c.position)
        .limit(limit)
    )
    return [(int(p), bytes(b)) for p, b in await conn.execute(query)]


async def record_prune(
    engine: AsyncEngine,
    record: NewEvent,
    *,
    step: int,
    read: StepPayloads,
    terminal_types: Sequence[str],
) -> tuple[str, Any]:
    """Append a prune's record of one step (`record`: the event of the run's stream, carrying the
    step's partition and `global_step`; its version is set here) if the step is still what the
    prune read: no prune recorded for it, every session created in it terminal (read from the
    log, not the read models), the same unpruned payloads, every event of it projected. All is
    checked under the append lock in the record's own transaction, so a creation in the step
    either committed before (and is seen) or is refused after (`store.log.append_sql`), and two
    prunes of one step take turns: the second finds the first's record and writes nothing.

    Returns ("recorded", position), or the reason nothing was written and its detail
    (`ALREADY_PRUNED`, `OPEN_SESSIONS`, `CHANGED`, `NOT_PROJECTED`)."""
    run, partition = record.run, record.partition
    in_step = (events.c.run == run, events.c.partition == partition, events.c.global_step == step)
    async with engine.connect() as conn:
        conn = await conn.execution_options(**{WRITE_LOCK: True})
        async with conn.begin():
            await lock_for_append(conn)
            earlier = await pruned_steps(conn, run, partition, [step])
            if step in earlier:
                return ALREADY_PRUNED, earlier[step][1]
            created = func.sum(case((events.c.type == "SessionCreated", 1), else_=0))
            ended = func.sum(case((events.c.type.in_(list(terminal_types)), 1), else_=0))
            counts = (
                await conn.execute(
                    select(created, ended, func.max(events.c.position)).where(*in_step)
                )
            ).one()
            open_ = int(counts[0] or 0) - int(counts[1] or 0)
            if open_:
                return OPEN_SESSIONS, open_
            payloads = (
                await conn.execute(
                    select(func.count(), func.coalesce(func.max(events.c.position), 0)).where(
                        *in_step, events.c.payload.is_not(None), events.c.pruned_by.is_(None)
                    )
                )
            ).one()
            if StepPayloads(int(payloads[0]), int(payloads[1])) != read:
                return CHANGED, None
            projected = (
                await conn.execute(
                    select(checkpoints.c.position).where(checkpoints.c.name == PROJECTOR)
                )
            ).scalar()
            if int(counts[2] or 0) > int(projected or 0):
                return NOT_PROJECTED, projected
            version = (
                await conn.execute(
                    select(func.coalesce(func.max(events.c.version), 0)).where(
                        events.c.session_id == record.session_id
                    )
                )
            ).scalar_one()
            record.version = int(version) + 1
            await insert_events(conn, [record])
            position = (
                await conn.execute(
                    select(events.c.position).where(events.c.event_id == record.event_id)
                )
            ).scalar_one()
    return "recorded", int(position)


async def apply_prune(
    engine: AsyncEngine,
    run: str,
    partition: str,
    steps: Sequence[int],
    prune_id: str,
    replacements: Sequence[tuple[int, bytes]],
) -> int:
    """A recorded prune's rewrite: replace the payloads by their tombstones and mark them
    `pruned_by` the prune, drop the steps' queue rows (and their claims), in one transaction
    under the write lock; returns the queue rows dropped. A payload another prune process
    replaced meanwhile (finishing the same prune) is left as it is."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(**{WRITE_LOCK: True})
        async with conn.begin():
            for position, payload in replacements:
                await conn.execute(
                    update(events)
                    .where(events.c.position == position, events.c.pruned_by.is_(None))
                    .values(payload=payload, pruned_by=prune_id)
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


async def rewritten_by(
    conn: AsyncConnection, run: str, partition: str, step: int, prune_id: str
) -> int:
    """How many of the step's payloads the prune `prune_id` replaced."""
    query = select(func.count()).where(
        events.c.run == run,
        events.c.partition == partition,
        events.c.global_step == step,
        events.c.pruned_by == prune_id,
    )
    return int((await conn.execute(query)).scalar_one())


async def leftover_steps(
    conn: AsyncConnection, run: str, partition: str, steps: Sequence[int]
) -> set[int]:
    """The steps among `steps` (pruned ones) that still hold a payload no prune replaced or a
    queue row: a prune cut between its record and its rewrite leaves both."""
    found: set[int] = set()
    wanted = list(steps)
    for start in range(0, len(wanted), 500):
        chunk = wanted[start : start + 500]
        for table, extra in (
            (events, (events.c.payload.is_not(None), events.c.pruned_by.is_(None))),
            (queue_rows, ()),
        ):
            query = (
                select(table.c.global_step)
                .where(
                    table.c.run == run,
                    table.c.partition == partition,
                    table.c.global_step.in_(chunk),
                    *extra,
                )
                .distinct()
            )
            found.update(int(step) for (step,) in await conn.execute(query))
    return found


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
