"""The SQL of one group-commit batch: the append lock, deciding each request against the stored
log, and the driver-level multi-row insert. `store.log.event_store.EventStore` drives it."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, literal_column, select, text
from sqlalchemy.engine import Dialect as SqlDialect
from sqlalchemy.ext.asyncio import AsyncConnection

from store.dialects import Dialect, dialect_of
from store.errors import ConcurrencyError, StepPrunedError, StoreError, StoreInvariantError
from store.log.records import NewEvent
from store.schema.tables import events
from store.stored_json import load_json

#: Bound parameters per IN (...) list; well below SQLite's and asyncpg's limits.
CHUNK = 500

Outcome = tuple[int, bool] | Exception


@dataclass(slots=True)
class AppendRequest:
    """One caller's append, waiting in the group-commit queue."""

    session_id: str
    expected_version: int
    events: Sequence[NewEvent]
    future: asyncio.Future[int] = field(repr=False)


async def lock_for_append(conn: AsyncConnection) -> None:
    """Serialise appends so positions become visible in commit order (no skipped events): the
    dialect's lock statements, run first in the insert transaction (none on SQLite, whose
    `BEGIN IMMEDIATE` already holds the file's write lock)."""
    for statement in dialect_of(conn).append_lock_sql:
        await conn.execute(text(statement))


async def resolve(
    conn: AsyncConnection,
    batch: list[AppendRequest],
    *,
    check_ids: bool = True,
    cached: dict[str, int] | None = None,
    build_rows: bool = True,
) -> tuple[list[Outcome], list[tuple[Any, ...]]]:
    """Decide each request's fate against the stored log; return outcomes and rows to insert
    (none with `build_rows=False`: the caller built them, for the accepted requests' events).

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
        if (
            cached is not None
            and request.expected_version == cached.get(sid, 0)
            and sid not in unknown
        ):
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
    slots = await GroupSlots.load(conn, batch)
    closed = await _closed_steps(conn, batch) if slots else {}
    outcomes: list[Outcome] = []
    rows: list[tuple[Any, ...]] = []
    dialect = dialect_of(conn)
    row = _row_for(dialect)
    for request in batch:
        current = versions.get(request.session_id, 0)
        if request.expected_version == current and (
            not known or not any(e.event_id in known for e in request.events)
        ):
            conflict = _refused_in_closed_step(request, closed) if closed else None
            if conflict is None and slots:
                conflict = slots.claim(request)
            if conflict is not None:
                outcomes.append(conflict)
                continue
            versions[request.session_id] = current + len(request.events)  # the common case: accept
            for event in request.events:
                known[event.event_id] = request.session_id
                if build_rows:
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


class GroupSlots:
    """The group slots (session_index, group_size) creations of a batch claim, checked against
    the stored creations of their groups and against each other.

    A group is (run, partition, global_step, uid). The append transaction is serialised (SQLite's
    write lock, PostgreSQL's table lock), so what this reads cannot change before the insert; the
    partial unique index `uq_events_group_slot` is the backstop for writers that skip the check.
    """

    def __init__(self, taken: dict[tuple[Any, ...], list[tuple[str, int, int]]]) -> None:
        #: group -> [(session_id, session_index, group_size)] of its stored and accepted creations
        self.taken = taken

    def __bool__(self) -> bool:
        return bool(self.taken)

    @classmethod
    async def load(cls, conn: AsyncConnection, batch: list[AppendRequest]) -> GroupSlots:
        groups = {_group_of(e) for request in batch for e in request.events if e.slot is not None}
        if not groups:
            return cls({})
        taken: dict[tuple[Any, ...], list[tuple[str, int, int]]] = {group: [] for group in groups}
        dialect = dialect_of(conn)
        by_step: dict[tuple[str, str, int | None], set[str]] = {}
        for run, partition, step, uid in groups:
            by_step.setdefault((run, partition, step), set()).add(uid)
        for (run, partition, step), uids in sorted(by_step.items(), key=repr):
            ordered = sorted(uids)
            for start in range(0, len(ordered), CHUNK):
                result = await conn.execute(
                    # No ORDER BY position: SQLite would take `ix_events_type` for the order it
                    # gives and walk every creation of the log again; sorted here instead.
                    select(
                        events.c.position,
                        events.c.session_id,
                        events.c.uid,
                        events.c.session_index,
                        events.c.group_size,
                    )
                    .where(*_slot_key(run, partition, step))
                    .where(
                        dialect.member_of(events.c.uid, ordered[start : start + CHUNK]),
                        events.c.session_index.is_not(None),
                    )
                )
                for _position, sid, uid, index, size in sorted(result, key=lambda row: row[0]):
                    taken[(run, partition, step, uid)].append((sid, index, size))
        return cls(taken)

    def claim(self, request: AppendRequest) -> StoreError | None:
        """The request's conflict with its group (nothing claimed), or None (its slots claimed)."""
        claims = [e for e in request.events if e.slot is not None]
        for event in claims:
            index, size = event.slot  # type: ignore[misc]
            for sibling, sibling_index, sibling_size in self.taken.get(_group_of(event), ()):
                if sibling == event.session_id:
                    continue
                if sibling_size != size:
                    return GroupConflict(
                        event,
                        "group_size",
                        f"is {size}, but session {sibling!r} of this group declared {sibling_size}",
                    )
                if sibling_index == index:
                    return GroupConflict(
                        event,
                        "session_index",
                        f"{index} is taken in this group by session {sibling!r}",
                    )
        for event in claims:
            self.taken.setdefault(_group_of(event), []).append((event.session_id, *event.slot))  # type: ignore[misc]
        return None


async def _closed_steps(
    conn: AsyncConnection, batch: list[AppendRequest]
) -> dict[tuple[str, str, int], tuple[int, str]]:
    """The pruned steps among those the batch's creations name: (run, partition, step) ->
    (the prune record's position, its prune id). The append lock is held, so a prune recorded
    meanwhile is seen, and a prune records only while it holds the same lock."""
    steps: dict[tuple[str, str], set[int]] = {}
    for request in batch:
        for e in request.events:
            if e.slot is not None and e.global_step is not None:
                steps.setdefault((e.run, e.partition), set()).add(e.global_step)
    closed: dict[tuple[str, str, int], tuple[int, str]] = {}
    for (run, partition), wanted in sorted(steps.items()):
        found = await pruned_steps(conn, run, partition, sorted(wanted))
        closed.update({(run, partition, step): record for step, record in found.items()})
    return closed


async def pruned_steps(
    conn: AsyncConnection, run: str, partition: str, steps: Sequence[int]
) -> dict[int, tuple[int, str]]:
    """step -> (position, prune id) of the prune records of the run's partition among `steps`,
    through `ix_events_pruned_step` (its condition spelt as SQL text, as `_slot_key` says why)."""
    found: dict[int, tuple[int, str]] = {}
    wanted = list(steps)
    for start in range(0, len(wanted), CHUNK):
        result = await conn.execute(
            select(events.c.global_step, events.c.position, events.c.data).where(
                events.c.type == literal_column("'PayloadsPruned'"),
                events.c.run == run,
                events.c.partition == partition,
                events.c.global_step.in_(wanted[start : start + CHUNK]),
            )
        )
        for step, position, data in result:
            record = data if isinstance(data, dict) else load_json(data)
            found.setdefault(int(step), (int(position), str(record.get("prune_id"))))
    return found


def _refused_in_closed_step(
    request: AppendRequest, closed: dict[tuple[str, str, int], tuple[int, str]]
) -> StoreError | None:
    """A creation in a pruned step (docs/design.md §14: a pruned step is closed), or None."""
    for e in request.events:
        if e.slot is None or e.global_step is None:
            continue
        record = closed.get((e.run, e.partition, e.global_step))
        if record is not None:
            position, prune_id = record
            return StepPrunedError(
                e.session_id, e.run, e.partition, e.global_step, prune_id, position
            )
    return None


def _slot_key(run: str, partition: str, step: int | None) -> tuple[Any, ...]:
    """The leading columns of `uq_events_group_slot`, spelt as the index declares them, so the
    planner reads only the creations of the groups asked for (issue 28: with `type = ?` and the
    run alone, SQLite took `ix_events_type` and walked every creation of the log per batch).
    `type` is SQL text, not a bound value, so it implies the partial index's WHERE on every
    backend (PostgreSQL's generic plans cannot prove that from a parameter); the step is
    `coalesce(global_step, -1)` with -1 as text, the index's own expression."""
    return (
        events.c.type == literal_column("'SessionCreated'"),
        events.c.run == run,
        events.c.partition == partition,
        func.coalesce(events.c.global_step, literal_column("-1")) == (-1 if step is None else step),
    )


def _group_of(event: NewEvent) -> tuple[Any, ...]:
    return (event.run, event.partition, event.global_step, event.uid)


class GroupConflict(StoreError, ValueError):
    """A creation that does not fit its group: a taken session_index or another group_size."""

    def __init__(self, event: NewEvent, field: str, problem: str) -> None:
        step = "no step" if event.global_step is None else f"step {event.global_step}"
        #: What is wrong, without the session (the ledger's InvalidInput names it).
        self.problem = (
            f"{problem} (group uid {event.uid!r}, run {event.run!r}, {event.partition}, {step}); "
            "give each session of a group its own session_index and the same group_size"
        )
        super().__init__(f"session {event.session_id!r}: {field} {self.problem}")
        self.session_id = event.session_id
        self.field = field


def _foreign_ids(request: AppendRequest, owners: list[str | None]) -> StoreError:
    other = next(owner for owner in owners if owner != request.session_id)
    return StoreError(
        f"session {request.session_id!r}: event id already used by session {other!r}; event ids must be unique"
    )


async def _current_versions(conn: AsyncConnection, session_ids: list[str]) -> dict[str, int]:
    versions: dict[str, int] = {}
    for start in range(0, len(session_ids), CHUNK):
        chunk = session_ids[start : start + CHUNK]
        result = await conn.execute(
            select(events.c.session_id, func.max(events.c.version))
            .where(dialect_of(conn).member_of(events.c.session_id, chunk))
            .group_by(events.c.session_id)
        )
        versions.update({sid: int(version) for sid, version in result})
    return versions


async def _known_event_ids(conn: AsyncConnection, event_ids: list[str]) -> dict[str, str | None]:
    known: dict[str, str | None] = {}
    for start in range(0, len(event_ids), CHUNK):
        chunk = event_ids[start : start + CHUNK]
        result = await conn.execute(
            select(events.c.event_id, events.c.session_id).where(
                dialect_of(conn).member_of(events.c.event_id, chunk)
            )
        )
        known.update({event_id: session_id for event_id, session_id in result})
    return known


async def pg_decide_and_insert(
    conn: AsyncConnection, batch: list[AppendRequest], careful: bool, cached: dict[str, int] | None
) -> tuple[list[Outcome], float]:
    """The batch body of a backend that builds rows before its append lock
    (`Dialect.append_rows_before_lock`, PostgreSQL's), the lock held for as little as the
    contract allows: every row is built and turned into the dialect's insert parameters before
    the lock; under it, the batch is decided (the reads the group-slot check needs cannot move
    out) and inserted by one statement (`Dialect.append_insert`). Returns the outcomes and when
    the lock was taken."""
    dialect = dialect_of(conn)
    row = _row_for(dialect)
    built = [[row(event) for event in request.events] for request in batch]
    every = dialect.append_params([r for rows in built for r in rows])
    await lock_for_append(conn)
    locked = time.perf_counter()
    outcomes, _ = await resolve(conn, batch, check_ids=careful, cached=cached, build_rows=False)
    accepted = [isinstance(outcome, tuple) and outcome[1] for outcome in outcomes]
    if not all(accepted):
        every = dialect.append_params([r for rows, ok in zip(built, accepted) if ok for r in rows])
    if every:
        await conn.exec_driver_sql(_append_insert(dialect) or insert_sql(conn.dialect), every)
    return outcomes, locked


@functools.cache
def _append_insert(dialect: Dialect) -> str | None:
    return dialect.append_insert(_INSERT_COLUMNS)


#: The insert's columns, in the order of the tuples `_row_for` builds.
_INSERT_COLUMNS = (
    "event_id",
    "session_id",
    "version",
    "type",
    "schema_version",
    "run",
    "uid",
    "partition",
    "global_step",
    "data",
    "payload",
    "recorded_at",
    "session_index",
    "group_size",
)


@functools.cache
def insert_sql(dialect: SqlDialect) -> str:
    """The multi-row insert as driver SQL, compiled once per dialect by SQLAlchemy itself.

    Appends bypass SQLAlchemy's per-row parameter processing: `data` arrives encoded
    (`NewEvent.data_json`) and timestamps in the backend's form, so each row is one tuple.
    """
    compiled = events.insert().compile(dialect=dialect, column_keys=list(_INSERT_COLUMNS))
    if tuple(compiled.positiontup or ()) != _INSERT_COLUMNS:
        raise StoreInvariantError(
            f"unexpected insert parameter order {compiled.positiontup}: SQLAlchemy compiled the "
            "events insert unlike this library expects; report it with the SQLAlchemy version"
        )
    return compiled.string


async def insert_events(conn: AsyncConnection, new_events: Sequence[NewEvent]) -> None:
    """Insert events as they are, no checks: for the append path and for tests that stage rows."""
    row = _row_for(dialect_of(conn))
    await conn.exec_driver_sql(insert_sql(conn.dialect), [row(e) for e in new_events])


def _row_for(dialect: Dialect) -> Callable[[NewEvent], tuple[Any, ...]]:
    """A NewEvent as the driver-level insert's parameter tuple, its timestamp in the dialect's form."""
    stamp = dialect.timestamp_param

    def row(e: NewEvent) -> tuple[Any, ...]:
        index, size = e.slot or _NO_SLOT
        return (
            e.event_id,
            e.session_id,
            e.version,
            e.type,
            e.schema_version,
            e.run,
            e.uid,
            e.partition,
            e.global_step,
            e.data_json,
            e.payload,
            stamp(e.recorded_at),
            index,
            size,
        )

    return row


_NO_SLOT = (None, None)
