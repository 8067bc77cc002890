"""The SQL of one group-commit batch: the append lock, deciding each request against the stored
log, and the driver-level multi-row insert. `store.event_store.EventStore` drives it."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timezone
from typing import Any

from sqlalchemy import String, any_, bindparam, func, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection

from store.errors import ConcurrencyError, StoreError
from store.records import NewEvent
from store.tables import events

#: Bound parameters per IN (...) list; well below SQLite's and asyncpg's limits.
CHUNK = 500
#: PostgreSQL: give up waiting for the append lock after this long rather than hang forever.
PG_LOCK_TIMEOUT = "10s"

Outcome = tuple[int, bool] | Exception


@dataclass(slots=True)
class AppendRequest:
    """One caller's append, waiting in the group-commit queue."""

    session_id: str
    expected_version: int
    events: Sequence[NewEvent]
    future: asyncio.Future[int] = field(repr=False)


async def lock_for_append(conn: AsyncConnection) -> None:
    """Serialise appends so positions become visible in commit order (no skipped events).

    EXCLUSIVE mode blocks other writers but not readers; the lock lives only for the insert
    transaction, and a lock timeout turns a stuck writer elsewhere into an error, not a hang.
    """
    await conn.execute(text(f"SET LOCAL lock_timeout = '{PG_LOCK_TIMEOUT}'"))
    await conn.execute(text("LOCK TABLE events IN EXCLUSIVE MODE"))


async def resolve(
    conn: AsyncConnection, batch: list[AppendRequest], *, check_ids: bool = True, cached: dict[str, int] | None = None
) -> tuple[list[Outcome], list[tuple[Any, ...]]]:
    """Decide each request's fate against the stored log; return outcomes and rows to insert.

    Outcome: (stream version, accepted) — accepted is False for an idempotent re-send — or an
    exception for that request alone.

    `cached` holds stream versions as of this process's own last commits. A request that expects
    exactly that version (or 0, a new stream) is not looked up: if another writer advanced the
    stream meanwhile, it took the next version and the insert breaks the (session_id, version)
    unique constraint, which sends the batch down the careful path.
    """
    versions: dict[str, int] = {}
    unknown: set[str] = set()
    for request in batch:
        sid = request.session_id
        if cached is not None and request.expected_version == cached.get(sid, 0) and sid not in unknown:
            versions.setdefault(sid, request.expected_version)
        else:
            unknown.add(sid)
            versions.pop(sid, None)
    if unknown:
        versions.update({sid: 0 for sid in unknown})
        versions.update(await _current_versions(conn, list(unknown)))
    # Event ids are fresh UUIDs in the normal case and looking them all up costs a query per batch:
    # the fast path looks up only the ids of requests whose version does not match (a re-send
    # always looks stale) and leaves the rest to the unique constraint (see EventStore._commit).
    event_ids = [
        event.event_id
        for request in batch
        if check_ids or request.expected_version != versions.get(request.session_id, 0)
        for event in request.events
    ]
    known: dict[str, str | None] = await _known_event_ids(conn, event_ids) if event_ids else {}
    outcomes: list[Outcome] = []
    rows: list[tuple[Any, ...]] = []
    row = _row_for(conn.dialect.name)
    for request in batch:
        current = versions.get(request.session_id, 0)
        if request.expected_version == current and (not known or not any(e.event_id in known for e in request.events)):
            versions[request.session_id] = current + len(request.events)  # the common case: accept
            for event in request.events:
                known[event.event_id] = request.session_id
                rows.append(row(event))
            outcomes.append((versions[request.session_id], True))
            continue
        ids = [event.event_id for event in request.events]
        seen = [known.get(event_id) for event_id in ids]
        if all(owner is not None for owner in seen):
            if any(owner != request.session_id for owner in seen):
                outcomes.append(_foreign_ids(request, seen))
            else:
                outcomes.append((current, False))
            continue
        if any(owner is not None for owner in seen):
            outcomes.append(
                StoreError(
                    f"session {request.session_id!r}: some but not all of the appended event ids are "
                    "already stored; re-send the original batch unchanged or use fresh event ids"
                )
            )
            continue
        outcomes.append(ConcurrencyError(request.session_id, request.expected_version, current))
    return outcomes, rows


def _foreign_ids(request: AppendRequest, owners: list[str | None]) -> StoreError:
    other = next(owner for owner in owners if owner != request.session_id)
    return StoreError(
        f"session {request.session_id!r}: event id already used by session {other!r}; event ids must be unique"
    )


def _member_of(column: Any, values: list[str], dialect: str) -> Any:
    """`column IN (…)`; on PostgreSQL `= ANY(array)`: one parameter, one cached plan, whatever the count."""
    if dialect == "postgresql":
        return column == any_(bindparam("members", values, type_=ARRAY(String())))
    return column.in_(values)


async def _current_versions(conn: AsyncConnection, session_ids: list[str]) -> dict[str, int]:
    versions: dict[str, int] = {}
    for start in range(0, len(session_ids), CHUNK):
        chunk = session_ids[start : start + CHUNK]
        result = await conn.execute(
            select(events.c.session_id, func.max(events.c.version))
            .where(_member_of(events.c.session_id, chunk, conn.dialect.name))
            .group_by(events.c.session_id)
        )
        versions.update({sid: int(version) for sid, version in result})
    return versions


async def _known_event_ids(conn: AsyncConnection, event_ids: list[str]) -> dict[str, str | None]:
    known: dict[str, str | None] = {}
    for start in range(0, len(event_ids), CHUNK):
        chunk = event_ids[start : start + CHUNK]
        result = await conn.execute(
            select(events.c.event_id, events.c.session_id).where(_member_of(events.c.event_id, chunk, conn.dialect.name))
        )
        known.update({event_id: session_id for event_id, session_id in result})
    return known


#: The insert's columns, in the order of the tuples `_row_for` builds.
_INSERT_COLUMNS = ("event_id", "session_id", "version", "type", "schema_version", "run", "uid", "partition",
                   "global_step", "data", "payload", "recorded_at")


@functools.cache
def insert_sql(dialect: Dialect) -> str:
    """The multi-row insert as driver SQL, compiled once per dialect by SQLAlchemy itself.

    Appends bypass SQLAlchemy's per-row parameter processing: `data` arrives encoded
    (`NewEvent.data_json`) and timestamps in the backend's form, so each row is one tuple.
    """
    compiled = events.insert().compile(dialect=dialect, column_keys=list(_INSERT_COLUMNS))
    if tuple(compiled.positiontup or ()) != _INSERT_COLUMNS:
        raise AssertionError(f"unexpected insert parameter order {compiled.positiontup}")
    return compiled.string


async def insert_events(conn: AsyncConnection, new_events: Sequence[NewEvent]) -> None:
    """Insert events as they are, no checks: for the append path and for tests that stage rows."""
    row = _row_for(conn.dialect.name)
    await conn.exec_driver_sql(insert_sql(conn.dialect), [row(e) for e in new_events])


def _row_for(dialect_name: str) -> Callable[[NewEvent], tuple[Any, ...]]:
    """A NewEvent as the driver-level insert's parameter tuple."""
    if dialect_name == "sqlite":
        return _sqlite_row
    return _native_row


def _sqlite_row(e: NewEvent) -> tuple[Any, ...]:
    # SQLAlchemy's SQLite DateTime text form; reads parse it back (as UTC: we only write UTC).
    t = e.recorded_at.astimezone(timezone.utc) if e.recorded_at.utcoffset() else e.recorded_at
    stamp = f"{t.year:04d}-{t.month:02d}-{t.day:02d} {t.hour:02d}:{t.minute:02d}:{t.second:02d}.{t.microsecond:06d}"
    return (e.event_id, e.session_id, e.version, e.type, e.schema_version, e.run, e.uid, e.partition,
            e.global_step, e.data_json, e.payload, stamp)


def _native_row(e: NewEvent) -> tuple[Any, ...]:
    return (e.event_id, e.session_id, e.version, e.type, e.schema_version, e.run, e.uid, e.partition,
            e.global_step, e.data_json, e.payload, e.recorded_at)
