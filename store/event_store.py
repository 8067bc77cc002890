"""The append-only event log with optimistic concurrency and group commit.

Appends from many concurrent sessions are queued and committed together: one transaction and
one multi-row INSERT per batch, because on the async stack the cost is round trips, not rows.
Each caller's `await` returns only once its own events are durable; a caller whose expected
version is stale gets `ConcurrencyError` without affecting the others in the batch.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timezone
from typing import Any

from sqlalchemy import String, any_, bindparam, func, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store.engine import WRITE_LOCK
from store.errors import ConcurrencyError, StoreError
from store.records import NewEvent, StoredEvent
from store.tables import events

log = logging.getLogger(__name__)

#: Bound parameters per IN (...) list; well below SQLite's and asyncpg's limits.
_CHUNK = 500
#: Streams whose version the store remembers between commits (see `_resolve`).
_VERSION_CACHE_SIZE = 100_000
#: PostgreSQL: give up waiting for the append lock after this long rather than hang forever.
PG_LOCK_TIMEOUT = "10s"


_Outcome = tuple[int, bool] | Exception


@dataclass(slots=True)
class _Append:
    session_id: str
    expected_version: int
    events: Sequence[NewEvent]
    future: asyncio.Future[int] = field(repr=False)


class EventStore:
    """Append and read events. One instance per engine and event loop."""

    def __init__(self, engine: AsyncEngine, *, max_batch_events: int = 4096) -> None:
        self.engine = engine
        self.max_batch_events = max_batch_events
        self._pending: deque[_Append] = deque()
        self._wakeup = asyncio.Event()
        self._committed = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._closed = False
        #: Stream versions as of this store's last commits (see `_resolve`).
        self._versions: dict[str, int] = {}
        self._conn: AsyncConnection | None = None
        self.batches_committed = 0
        self.events_committed = 0

    # ------------------------------------------------------------------ append
    async def append(self, session_id: str, expected_version: int, new_events: Sequence[NewEvent]) -> int:
        """Append `new_events` to a session's stream if it is at `expected_version`.

        Returns the stream's new version. Re-sending events whose ids are all stored already is a
        no-op that returns the current version. Raises ConcurrencyError on a version conflict.
        """
        # Shielded: a cancelled caller must not abandon a write that may still commit.
        return await asyncio.shield(self.submit(session_id, expected_version, new_events))

    def submit(self, session_id: str, expected_version: int, new_events: Sequence[NewEvent]) -> asyncio.Future[int]:
        """Queue an append for the next group commit; the future resolves once it is durable.

        For callers that must learn an append's fate even when cancelled (see
        `sessions.recorder.append_then_apply`): they shield the future and, if cancelled, await it.
        """
        if self._closed:
            raise StoreError("the event store is closed; open the ledger again")
        _check_versions(session_id, expected_version, new_events)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if not new_events:
            future.set_result(expected_version)
            return future
        self._pending.append(_Append(session_id, expected_version, new_events, future))
        self._ensure_worker()
        self._wakeup.set()
        return future

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="rollout-ledger-group-commit")

    async def _run(self) -> None:
        while True:
            if not self._pending:
                self._wakeup.clear()
                if self._closed:
                    return
                await self._wakeup.wait()
                continue
            batch = self._take_batch()
            await self._commit(batch)

    def _take_batch(self) -> list[_Append]:
        taken: list[_Append] = []
        count = 0
        while self._pending and (not taken or count + len(self._pending[0].events) <= self.max_batch_events):
            request = self._pending.popleft()
            taken.append(request)
            count += len(request.events)
        return taken

    async def _commit(self, batch: list[_Append], *, careful: bool = False) -> None:
        """Commit a batch. The fast path trusts the unique constraints to catch re-sent event ids;
        if they fire, each request is redone on its own, carefully: ids looked up first, so a
        re-send is an idempotent no-op and a conflict fails only its own caller."""
        try:
            outcomes = await retry_transient(lambda: self._commit_together(batch, careful), what="append")
        except DBAPIError as error:  # IntegrityError included
            if len(batch) == 1 and (careful or not isinstance(error, IntegrityError)):
                _settle(batch[0], _wrap(error, batch[0]))
                return
            if is_transient(error):
                # Out of retries on a lock or a lost connection: every request in the batch would
                # meet the same wait again, so all of them fail now, within one budget.
                for request in batch:
                    self._versions.pop(request.session_id, None)
                    _settle(request, _wrap(error, request))
                return
            log.debug("group commit of %d appends failed (%s); redoing them one by one", len(batch), error)
            for request in batch:
                self._versions.pop(request.session_id, None)
            for request in batch:
                await self._commit([request], careful=True)
            return
        except BaseException as error:  # noqa: BLE001 - every waiter must hear about it
            for request in batch:
                _settle(request, error if isinstance(error, Exception) else StoreError(repr(error)))
            if not isinstance(error, Exception):
                raise
            return
        self.batches_committed += 1
        for request, outcome in zip(batch, outcomes):
            if isinstance(outcome, Exception):
                _settle(request, outcome)
            else:
                version, accepted = outcome
                self.events_committed += len(request.events) if accepted else 0
                _settle(request, version)
        self._committed.set()
        self._committed = asyncio.Event()

    async def _commit_together(self, batch: list[_Append], careful: bool) -> list[_Outcome]:
        conn = await self._writer()
        try:
            async with conn.begin():
                if conn.dialect.name == "postgresql":
                    await _lock_for_append(conn)
                outcomes, rows = await _resolve(conn, batch, check_ids=careful, cached=None if careful else self._versions)
                if rows:
                    await conn.exec_driver_sql(_insert_sql(conn.dialect), rows)
        except BaseException as error:
            if not isinstance(error, IntegrityError):  # the connection may be broken: start afresh
                await self._drop_writer()
            raise
        self._remember(batch, outcomes)
        return outcomes

    async def _writer(self) -> AsyncConnection:
        """The worker's connection, held from one batch to the next.

        A pool checkout per batch (with its reset on return, and on PostgreSQL its pre-ping)
        cost about as much loop time as the batch's insert; a held connection that breaks is
        dropped and the retry takes a fresh one.
        """
        if self._conn is None:
            conn = await self.engine.connect()
            try:
                self._conn = await conn.execution_options(**{WRITE_LOCK: True})
            except BaseException:
                await conn.close()
                raise
        return self._conn

    async def _drop_writer(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            await conn.invalidate()  # never hand a possibly broken connection back to the pool
            await conn.close()
        except Exception as error:  # noqa: BLE001 - already failing; the original error matters
            log.debug("closing the append connection failed: %s", error)

    def _remember(self, batch: list[_Append], outcomes: list[_Outcome]) -> None:
        """Keep each stream's version after a commit, so the next append to it needs no query."""
        if len(self._versions) > _VERSION_CACHE_SIZE:
            self._versions.clear()  # a bounded cache: forgetting only costs a version query
        for request, outcome in zip(batch, outcomes):
            if isinstance(outcome, tuple):
                self._versions[request.session_id] = outcome[0]
            else:
                self._versions.pop(request.session_id, None)

    async def wait_for_commit(self, timeout: float | None = None) -> bool:
        """Wait until this process commits another batch (for followers). False on timeout."""
        committed = self._committed
        try:
            await asyncio.wait_for(committed.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Commit what is queued, then stop the group-commit worker."""
        self._closed = True
        self._wakeup.set()
        if self._worker is not None:
            await self._worker
            self._worker = None
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.close()

    # ------------------------------------------------------------------- reads
    async def read_stream(self, session_id: str, *, at_position: int | None = None) -> list[StoredEvent]:
        """All events of one session in version order, optionally only those at or before a position."""
        query = select(events).where(events.c.session_id == session_id)
        if at_position is not None:
            query = query.where(events.c.position <= at_position)
        async with self.engine.connect() as conn:
            result = await conn.execute(query.order_by(events.c.version))
            return [to_stored(row) for row in result.mappings()]

    async def read_streams(self, session_ids: Sequence[str]) -> dict[str, list[StoredEvent]]:
        """Several sessions' streams in one round trip per chunk."""
        out: dict[str, list[StoredEvent]] = {sid: [] for sid in session_ids}
        async with self.engine.connect() as conn:
            for start in range(0, len(session_ids), _CHUNK):
                chunk = list(session_ids[start : start + _CHUNK])
                result = await conn.execute(
                    select(events).where(events.c.session_id.in_(chunk)).order_by(events.c.session_id, events.c.version)
                )
                for row in result.mappings():
                    out[row["session_id"]].append(to_stored(row))
        return out

    async def read_from(self, after_position: int = 0, *, limit: int = 1000) -> list[StoredEvent]:
        """Up to `limit` events with position > after_position, in position order."""
        async with self.engine.connect() as conn:
            return await read_page(conn, after_position, limit)

    async def iter_from(self, after_position: int = 0, *, page_size: int = 1000) -> AsyncIterator[list[StoredEvent]]:
        """Pages of the global log from a position to its current end."""
        position = after_position
        while True:
            page = await self.read_from(position, limit=page_size)
            if not page:
                return
            yield page
            position = page[-1].position

    async def last_position(self) -> int:
        async with self.engine.connect() as conn:
            return int((await conn.execute(select(func.coalesce(func.max(events.c.position), 0)))).scalar_one())

    async def stream_version(self, session_id: str) -> int:
        async with self.engine.connect() as conn:
            query = select(func.coalesce(func.max(events.c.version), 0)).where(events.c.session_id == session_id)
            return int((await conn.execute(query)).scalar_one())


#: Column order of a page row: positional access is markedly cheaper than mappings on long pages.
_PAGE_COLUMNS = [c for c in events.c if c.name != "payload"] + [events.c.payload]
_PAGE_NO_PAYLOAD = _PAGE_COLUMNS[:-1]

#: Attempts for an operation that failed transiently (lost connection, lock timeout, busy file).
RETRY_ATTEMPTS = 4
RETRY_BASE_DELAY = 0.05


def is_transient(error: BaseException) -> bool:
    """Errors worth retrying: the connection dropped, or a lock could not be had in time.

    Retrying an append is safe even when the failure hid a successful commit: the retry finds
    the event ids stored and becomes an idempotent no-op.
    """
    if not isinstance(error, DBAPIError) or isinstance(error, IntegrityError):
        return False
    if error.connection_invalidated:
        return True
    text_ = str(error.orig).lower()
    return any(
        marker in text_
        for marker in ("database is locked", "lock timeout", "lock_timeout", "connection was closed", "terminating connection",
                       "connection is closed", "connection refused", "server closed the connection")
    )


async def retry_transient(operation: Any, *, what: str, attempts: int = RETRY_ATTEMPTS) -> Any:
    """Run `operation()` (a coroutine factory), retrying transient database errors with backoff."""
    for attempt in range(attempts):
        try:
            return await operation()
        except DBAPIError as error:
            if attempt == attempts - 1 or not is_transient(error):
                raise
            delay = RETRY_BASE_DELAY * (2**attempt)
            log.warning("%s failed transiently (%s); retry %d/%d in %.2fs", what, error.orig, attempt + 1, attempts - 1, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


async def read_page(conn: AsyncConnection, after_position: int, limit: int, *, with_payload: bool = True) -> list[StoredEvent]:
    """Events after a position; without payloads when the reader only needs the JSON data."""
    columns = _PAGE_COLUMNS if with_payload else _PAGE_NO_PAYLOAD
    result = await conn.execute(
        select(*columns).where(events.c.position > after_position).order_by(events.c.position).limit(limit)
    )
    return [_from_page_row(row, with_payload) for row in result]


def _from_page_row(row: Any, with_payload: bool) -> StoredEvent:
    position, event_id, session_id, version, type_, schema, run, uid, partition, step, data, recorded_at = row[:12]
    payload = row[12] if with_payload else None
    if recorded_at.tzinfo is None:  # SQLite keeps no zone; we only ever write UTC
        recorded_at = recorded_at.replace(tzinfo=timezone.utc)
    return StoredEvent(
        position, event_id, session_id, version, type_, schema, run, uid, partition, step, data,
        bytes(payload) if payload is not None else None, recorded_at,
    )


def to_stored(row: Any) -> StoredEvent:
    """A StoredEvent from a mapping row of `events` (any column order; payload optional)."""
    recorded_at = row["recorded_at"]
    if recorded_at.tzinfo is None:  # SQLite keeps no zone; we only ever write UTC
        recorded_at = recorded_at.replace(tzinfo=timezone.utc)
    payload = row.get("payload")
    return StoredEvent(
        position=row["position"],
        event_id=row["event_id"],
        session_id=row["session_id"],
        version=row["version"],
        type=row["type"],
        schema_version=row["schema_version"],
        run=row["run"],
        uid=row["uid"],
        partition=row["partition"],
        global_step=row["global_step"],
        data=row["data"],
        payload=bytes(payload) if payload is not None else None,
        recorded_at=recorded_at,
    )


async def _lock_for_append(conn: AsyncConnection) -> None:
    """Serialise appends so positions become visible in commit order (no skipped events).

    EXCLUSIVE mode blocks other writers but not readers; the lock lives only for the insert
    transaction, and a lock timeout turns a stuck writer elsewhere into an error, not a hang.
    """
    await conn.execute(text(f"SET LOCAL lock_timeout = '{PG_LOCK_TIMEOUT}'"))
    await conn.execute(text("LOCK TABLE events IN EXCLUSIVE MODE"))


async def _resolve(
    conn: AsyncConnection, batch: list[_Append], *, check_ids: bool = True, cached: dict[str, int] | None = None
) -> tuple[list[_Outcome], list[tuple[Any, ...]]]:
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
    outcomes: list[_Outcome] = []
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


def _foreign_ids(request: _Append, owners: list[str | None]) -> StoreError:
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
    for start in range(0, len(session_ids), _CHUNK):
        chunk = session_ids[start : start + _CHUNK]
        result = await conn.execute(
            select(events.c.session_id, func.max(events.c.version))
            .where(_member_of(events.c.session_id, chunk, conn.dialect.name))
            .group_by(events.c.session_id)
        )
        versions.update({sid: int(version) for sid, version in result})
    return versions


async def _known_event_ids(conn: AsyncConnection, event_ids: list[str]) -> dict[str, str | None]:
    known: dict[str, str | None] = {}
    for start in range(0, len(event_ids), _CHUNK):
        chunk = event_ids[start : start + _CHUNK]
        result = await conn.execute(
            select(events.c.event_id, events.c.session_id).where(_member_of(events.c.event_id, chunk, conn.dialect.name))
        )
        known.update({event_id: session_id for event_id, session_id in result})
    return known


#: The insert's columns, in the order of the tuples `_row_for` builds.
_INSERT_COLUMNS = ("event_id", "session_id", "version", "type", "schema_version", "run", "uid", "partition",
                   "global_step", "data", "payload", "recorded_at")


@functools.cache
def _insert_sql(dialect: Dialect) -> str:
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
    await conn.exec_driver_sql(_insert_sql(conn.dialect), [row(e) for e in new_events])


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


def _check_versions(session_id: str, expected_version: int, new_events: Sequence[NewEvent]) -> None:
    if len({event.event_id for event in new_events}) != len(new_events):
        raise ValueError(f"session {session_id!r}: the appended events repeat an event id; each event needs its own")
    for offset, event in enumerate(new_events, start=1):
        if event.session_id != session_id:
            raise ValueError(f"event {event.event_id} belongs to session {event.session_id!r}, not {session_id!r}")
        if event.version != expected_version + offset:
            raise ValueError(
                f"session {session_id!r}: event {event.event_id} has version {event.version}, "
                f"expected {expected_version + offset} (versions continue the stream without gaps)"
            )


def _settle(request: _Append, outcome: int | BaseException) -> None:
    if request.future.done():
        return
    if isinstance(outcome, BaseException):
        request.future.set_exception(outcome)
    else:
        request.future.set_result(outcome)


def _wrap(error: Exception, request: _Append) -> Exception:
    if isinstance(error, IntegrityError):
        # A concurrent writer in another process took the same version between our read and
        # insert (possible only where the backend did not serialise us).
        return ConcurrencyError(request.session_id, request.expected_version, -1)
    # The driver's own message: SQLAlchemy's would repeat the statement and every row's parameters.
    cause = error.orig if isinstance(error, DBAPIError) and error.orig is not None else error
    return StoreError(f"append to session {request.session_id!r} failed: {type(cause).__name__}: {cause}")
