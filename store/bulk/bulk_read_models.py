"""Read whole logs and write whole read models at driver level: the rebuild's I/O (replay, audit).

A rebuild folds the log in memory and writes each read-model table once, into empty tables; per
row, SQLAlchemy's result and bind processing would cost more than the database does. Rows come
in as dicts keyed by column name and go out as tuples in the table's column order.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import operator
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from store.bulk import driver
from store.bulk.bulk_copy import recorded_at_converter
from store.dialects import dialect_of
from store.errors import TargetNotEmpty
from store.faults import wrapped, wraps_faults
from store.read_models.keys import PROJECTOR
from store.schema.tables import (
    checkpoints,
    groups,
    metric_counts,
    projection_errors,
    queue_rows,
    sessions,
)

_SESSION_COLUMNS = tuple(c.name for c in sessions.c)
_GROUP_COLUMNS = tuple(c.name for c in groups.c)
METRIC_COLUMNS = tuple(c.name for c in metric_counts.c)
_QUEUE_COLUMNS = tuple(c.name for c in queue_rows.c)
_ERROR_COLUMNS = tuple(c.name for c in projection_errors.c)

#: What a rebuild selects of `events`, in the projection decoder's column order; `recorded_at`
#: only where a session row takes it (created, terminal): it is stored after the payload, so
#: reading it for a trajectory walks that row's whole payload.
_REBUILD_SELECT = (
    "position",
    "session_id",
    "version",
    "type",
    "schema_version",
    "data",
    "CASE WHEN type IN ('SessionCreated', 'SessionSucceeded', 'SessionFailed', 'SessionCancelled') THEN recorded_at END",
)


async def event_pages(
    engine: AsyncEngine, *, up_to: int | None = None, page_size: int
) -> AsyncIterator[list[tuple[Any, ...]]]:
    """The log (positions <= `up_to`, or all) in pages of decoder tuples (`data` as JSON text)."""
    with wrapped("reading the log"):
        async with driver.reader(engine) as read:
            async for rows in prefetched_pages(
                read, _REBUILD_SELECT, up_to=up_to, page_size=page_size
            ):
                yield rows


async def prefetched_pages(
    read: driver.Reader,
    columns: Sequence[str],
    *,
    page_size: int,
    up_to: int | None = None,
) -> AsyncIterator[list[Any]]:
    """`read.events_page` after `read.events_page`, the next one asked for before this one is
    handed out: the driver reads it while the caller works on this one (aiosqlite's thread,
    asyncpg's socket). `columns` start with `position`."""

    def page(after: int) -> asyncio.Future[list[Any]]:
        return asyncio.ensure_future(
            read.events_page(columns, after=after, up_to=up_to, limit=max(1, page_size))
        )

    pending = page(0)
    try:
        while True:
            with wrapped("reading a page of the log"):
                rows = await pending
            if not rows:
                return
            pending = page(rows[-1][0])
            yield rows
    finally:  # a caller that stops early: let the read in flight finish before the connection goes back
        with contextlib.suppress(Exception):
            await pending


@wraps_faults()
async def stream_order_page(
    read: driver.Reader, *, after: tuple[str, int] | None, limit: int
) -> list[Any]:
    """Up to `limit` events in (session_id, version) order after the key `after` (None: from the
    start), as (session_id, version, position, type, data as JSON text for a SessionFailed and
    NULL for any other type, schema_version): the audit's structure pass, one stream after
    another. The unique index on (session_id, version) serves the order without a sort, and the
    keyset key makes each page start where the last ended."""
    mark = read.dialect.mark
    sql = (
        "SELECT session_id, version, position, type, "
        f"CASE WHEN type = 'SessionFailed' THEN {read.dialect.json_text('data')} END, schema_version "
        "FROM events"
    )
    if after is None:
        return await read.fetch(f"{sql} ORDER BY session_id, version LIMIT {mark(1)}", (limit,))
    return await read.fetch(
        f"{sql} WHERE (session_id, version) > ({mark(1)}, {mark(2)}) "
        f"ORDER BY session_id, version LIMIT {mark(3)}",
        (*after, limit),
    )


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
    #: The last queue row's id, also when `queue` holds only the rows not written yet.
    last_queue_id: int | None = None


def prepare(
    tables: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    last_position: int,
    events: int,
    source: AsyncEngine,
    target: AsyncEngine,
    queue_from: int = 0,
) -> Prepared:
    """Serialise JSON columns (as SQLAlchemy's JSON type does: `json.dumps`) and, across backends,
    convert the session timestamps the rebuild took from the source's events. Queue rows before
    `queue_from` are left out (already written: `write_queue_rows`)."""
    out_sessions = _tuples(tables["sessions"], _SESSION_COLUMNS, _REWARD_INFO)
    convert = recorded_at_converter(source, target)
    if convert is not None:
        out_sessions = [_converted(values, convert) for values in out_sessions]
    return Prepared(
        out_sessions,
        _tuples(tables["groups"], _GROUP_COLUMNS, _MEMBERS),
        _tuples(tables["metrics"], METRIC_COLUMNS),
        queue_tuples(tables["queue"][queue_from:]),
        _tuples(tables.get("errors", ()), _ERROR_COLUMNS),
        last_position,
        events,
        tables["queue"][-1]["id"] if tables["queue"] else None,
    )


def queue_tuples(rows: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """Queue rows (final once made) as the target's driver takes them."""
    return _tuples(rows, _QUEUE_COLUMNS, _TAGS)


def _tuples(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str], json_at: int | None = None
) -> list[tuple[Any, ...]]:
    """Rows as tuples in column order, the value at `json_at` serialised."""
    pick = operator.itemgetter(*columns)
    if json_at is None:
        return [pick(row) for row in rows]
    dumps, after = _dumps, json_at + 1
    out = []
    for row in rows:
        values = pick(row)
        out.append((*values[:json_at], dumps(values[json_at]), *values[after:]))
    return out


def _converted(values: tuple[Any, ...], convert: Any) -> tuple[Any, ...]:
    """A session row with its timestamps in the target backend's form."""
    changed = list(values)
    changed[_CREATED] = convert(changed[_CREATED])
    if changed[_TERMINAL] is not None:
        changed[_TERMINAL] = convert(changed[_TERMINAL])
    return tuple(changed)


def _json_dumps() -> Any:
    """`json.dumps` with its default arguments, minus the encoder it builds on every call (most of
    its cost on small values): the same C encoder, made once, gives the same text."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return json.dumps  # pragma: no cover - CPython always has the C encoder
    encode = make(
        None,
        json.JSONEncoder().default,
        json.encoder.encode_basestring_ascii,
        None,
        ": ",
        ", ",
        False,
        False,
        True,
    )
    return lambda value: "".join(encode(value, 0))


_dumps = _json_dumps()


_REWARD_INFO = _SESSION_COLUMNS.index("reward_info")
_CREATED, _TERMINAL = _SESSION_COLUMNS.index("created_at"), _SESSION_COLUMNS.index("terminal_at")
_TAGS = _QUEUE_COLUMNS.index("tags")
_MEMBERS = _GROUP_COLUMNS.index("members")


@wraps_faults()
async def insert_read_models(target: AsyncEngine, rows: Prepared) -> None:
    """Insert the rows and the checkpoint in one transaction (empty read models expected)."""
    if not rows.events:
        return  # as the projector: no events, no checkpoint
    async with driver.writer(target) as write:
        await write_read_models(write, rows, target)
        await write.commit()


@wraps_faults()
async def claim_read_models(write: driver.Writer, target: AsyncEngine) -> None:
    """Take the projector's lock in `write`'s transaction and refuse a target already projected:
    before any read-model row is written."""
    dialect = dialect_of(target)
    if (
        dialect.page_lock_sql is not None
    ):  # as a projector page: one writer of read models at a time
        await write.execute(dialect.page_lock_sql)
    if await write.fetch(
        f"SELECT position FROM checkpoints WHERE name = {dialect.mark(1)}", (PROJECTOR,)
    ):
        raise TargetNotEmpty(
            "the target database already has a projector checkpoint; replay needs empty read "
            "models: replay into a new database, or drop the target's read models first"
        )


@wraps_faults()
async def write_queue_rows(write: driver.Writer, rows: Sequence[tuple[Any, ...]]) -> None:
    """Queue rows (`queue_tuples`) ahead of the rest, once `claim_read_models` has run."""
    await write.insert("queue_rows", _QUEUE_COLUMNS, rows)


@wraps_faults()
async def write_read_models(
    write: driver.Writer, rows: Prepared, target: AsyncEngine, *, claimed: bool = False
) -> None:
    """Insert the rows and the checkpoint in `write`'s open transaction (the caller commits);
    nothing for a log without events (as the projector: no events, no checkpoint). `claimed`:
    `claim_read_models` has run in this transaction."""
    if not rows.events:
        return
    stamp = checkpoints.c.updated_at.type.dialect_impl(target.dialect).bind_processor(
        target.dialect
    )
    now = datetime.now(timezone.utc)
    if not claimed:
        await claim_read_models(write, target)
    await add_read_model_rows(write, rows)
    if rows.last_queue_id is not None:
        await write.after_explicit_positions("queue_rows", "id", rows.last_queue_id)
    await write.insert(
        "checkpoints",
        ("name", "position", "updated_at"),
        [(PROJECTOR, rows.last_position, stamp(now) if stamp else now)],
    )


@wraps_faults()
async def add_read_model_rows(write: driver.Writer, rows: Prepared) -> None:
    """Insert rebuilt rows into `write`'s open transaction, no checkpoint and no claim: the rows
    of `write_read_models`, and a scratch database filled part by part (the audit's fold moves
    finished steps there as it goes)."""
    await write.insert("sessions", _SESSION_COLUMNS, rows.sessions)
    await write.insert("groups", _GROUP_COLUMNS, rows.groups)
    await write.insert("metric_counts", METRIC_COLUMNS, rows.metrics)
    await write_queue_rows(write, rows.queue)
    await write.insert("projection_errors", _ERROR_COLUMNS, rows.errors)


@wraps_faults()
async def drop_queue_rows_of_steps(
    write: driver.Writer, steps: Sequence[tuple[str, str, int]]
) -> None:
    """Delete the queue rows of some (run, partition, step): a prune dropped them."""
    mark = write.dialect.mark
    for run, partition, step in steps:
        await write.execute(
            f"DELETE FROM queue_rows WHERE run = {mark(1)} AND partition = {mark(2)} "
            f"AND global_step = {mark(3)}",
            (run, partition, step),
        )


@functools.cache
def sqlite_shape() -> AsyncEngine:
    """An engine that never connects, only for its dialect: `prepare` for it gives rows as a
    SQLite read model holds them (the audit compares its rebuilt rows in memory so, against
    either backend, as it would a SQLite copy of them)."""
    return create_async_engine("sqlite+aiosqlite://")


@wraps_faults()
async def has_events(engine: AsyncEngine) -> bool:
    async with driver.reader(engine) as read:
        return bool((await read.fetch("SELECT count(*) FROM events"))[0][0])
