"""Read whole logs and write whole read models at driver level: the rebuild's I/O (replay, audit).

A rebuild folds the log in memory and writes each read-model table once, into empty tables; per
row, SQLAlchemy's result and bind processing would cost more than the database does. Rows come
in as dicts keyed by column name and go out as tuples in the table's column order.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from store import driver
from store.bulk_copy import recorded_at_converter
from store.dialects import dialect_of
from store.read_models import PROJECTOR
from store.tables import checkpoints, groups, metric_counts, projection_errors, queue_rows, sessions

SESSION_COLUMNS = tuple(c.name for c in sessions.c)
GROUP_COLUMNS = tuple(c.name for c in groups.c)
METRIC_COLUMNS = tuple(c.name for c in metric_counts.c)
QUEUE_COLUMNS = tuple(c.name for c in queue_rows.c)
ERROR_COLUMNS = tuple(c.name for c in projection_errors.c)

#: What a rebuild selects of `events`, in the projection decoder's column order; `recorded_at`
#: only where a session row takes it (created, terminal): it is stored after the payload, so
#: reading it for a trajectory walks that row's whole payload.
_REBUILD_SELECT = (
    "position", "session_id", "version", "type", "schema_version", "data",
    "CASE WHEN type IN ('SessionCreated', 'SessionSucceeded', 'SessionFailed', 'SessionCancelled') THEN recorded_at END",
)


async def event_pages(engine: AsyncEngine, *, up_to: int | None = None, page_size: int) -> AsyncIterator[list[tuple[Any, ...]]]:
    """The log (positions <= `up_to`, or all) in pages of decoder tuples (`data` as JSON text)."""
    async with driver.reader(engine) as read:
        last = 0
        while True:
            rows = await read.events_page(_REBUILD_SELECT, after=last, up_to=up_to, limit=max(1, page_size))
            if not rows:
                return
            yield rows
            last = rows[-1][0]


@dataclass
class Prepared:
    """Rebuilt rows as the target's driver takes them: JSON as text, timestamps in its storage form."""

    sessions: list[tuple[Any, ...]]
    groups: list[tuple[Any, ...]]
    metrics: list[tuple[Any, ...]]
    queue: list[tuple[Any, ...]]
    errors: list[tuple[Any, ...]]
    last_position: int
    events: int


def prepare(
    tables: Mapping[str, Sequence[Mapping[str, Any]]], *, last_position: int, events: int,
    source: AsyncEngine, target: AsyncEngine,
) -> Prepared:
    """Serialise JSON columns (as SQLAlchemy's JSON type does: `json.dumps`) and, across backends,
    convert the session timestamps the rebuild took from the source's events."""
    dumps = json.dumps
    convert = recorded_at_converter(source, target)
    out_sessions = []
    for row in tables["sessions"]:
        values = [row[c] for c in SESSION_COLUMNS]
        values[_REWARD_INFO] = dumps(values[_REWARD_INFO])
        if convert is not None:
            values[_CREATED] = convert(values[_CREATED])
            if values[_TERMINAL] is not None:
                values[_TERMINAL] = convert(values[_TERMINAL])
        out_sessions.append(tuple(values))
    out_groups = []
    for row in tables["groups"]:
        values = [row[c] for c in GROUP_COLUMNS]
        values[_MEMBERS] = dumps(values[_MEMBERS])
        out_groups.append(tuple(values))
    out_queue = []
    for row in tables["queue"]:
        values = [row[c] for c in QUEUE_COLUMNS]
        values[_TAGS] = dumps(values[_TAGS])
        out_queue.append(tuple(values))
    return Prepared(
        out_sessions,
        out_groups,
        [tuple(row[c] for c in METRIC_COLUMNS) for row in tables["metrics"]],
        out_queue,
        [tuple(row[c] for c in ERROR_COLUMNS) for row in tables.get("errors", ())],
        last_position,
        events,
    )


_REWARD_INFO = SESSION_COLUMNS.index("reward_info")
_CREATED, _TERMINAL = SESSION_COLUMNS.index("created_at"), SESSION_COLUMNS.index("terminal_at")
_TAGS = QUEUE_COLUMNS.index("tags")
_MEMBERS = GROUP_COLUMNS.index("members")


async def insert_read_models(target: AsyncEngine, rows: Prepared) -> None:
    """Insert the rows and the checkpoint in one transaction (empty read models expected)."""
    if not rows.events:
        return  # as the projector: no events, no checkpoint
    stamp = checkpoints.c.updated_at.type.dialect_impl(target.dialect).bind_processor(target.dialect)
    now = datetime.now(timezone.utc)
    dialect = dialect_of(target)
    async with driver.writer(target) as write:
        if dialect.page_lock_sql is not None:  # as a projector page: one writer of read models at a time
            await write.execute(dialect.page_lock_sql)
        if await write.fetch(f"SELECT position FROM checkpoints WHERE name = {dialect.mark(1)}", (PROJECTOR,)):
            raise ValueError("the target database already has a projector checkpoint; replay needs empty read models")
        await write.insert("sessions", SESSION_COLUMNS, rows.sessions)
        await write.insert("groups", GROUP_COLUMNS, rows.groups)
        await write.insert("metric_counts", METRIC_COLUMNS, rows.metrics)
        await write.insert("queue_rows", QUEUE_COLUMNS, rows.queue)
        await write.insert("projection_errors", ERROR_COLUMNS, rows.errors)
        if rows.queue:
            await write.after_explicit_positions("queue_rows", "id", rows.queue[-1][0])
        await write.insert("checkpoints", ("name", "position", "updated_at"),
                           [(PROJECTOR, rows.last_position, stamp(now) if stamp else now)])
        await write.commit()


async def has_events(engine: AsyncEngine) -> bool:
    async with driver.reader(engine) as read:
        return bool((await read.fetch("SELECT count(*) FROM events"))[0][0])
