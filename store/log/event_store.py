"""The append-only event log with optimistic concurrency and group commit.

Appends from many concurrent sessions are queued and committed together: one transaction and
one multi-row INSERT per batch, because on the async stack the cost is round trips, not rows.
Each caller's `await` returns only once its own events are durable; a caller whose expected
version is stale gets `ConcurrencyError` without affecting the others in the batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from datetime import timezone
from typing import Any

import sqlalchemy
from sqlalchemy import func, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store.dialects import WRITE_LOCK, dialect_of
from store.errors import (
    AppendOutcomeUnknown,
    ConcurrencyError,
    StoreError,
    StoreInputError,
    StoreInvariantError,
)
from store.faults import driver_error, wraps_faults
from store.log.append_sql import (
    CHUNK,
    AppendRequest,
    Outcome,
    _known_event_ids,
    insert_events,
    insert_sql,
    lock_for_append,
    pg_decide_and_insert,
    resolve,
)
from store.log.futures import DeferredCancelFuture
from store.log.records import NewEvent, StoredEvent
from store.log.sqlite_writer import ImmediateConnection, SqliteWriter, run_now
from store.retry import (
    RETRY_ATTEMPTS,
    RETRY_BASE_DELAY,
    connection_lost,
    is_transient,
    retry_transient,
)
from store.schema.tables import events

log = logging.getLogger(__name__)

#: Streams whose version the store remembers between commits (see `_resolve`).
_VERSION_CACHE_SIZE = 100_000
#: Lock hold times `EventStore.lock_holds` keeps (the most recent ones).
_LOCK_HOLDS_KEPT = 10_000
__all__ = [
    "RETRY_ATTEMPTS",
    "RETRY_BASE_DELAY",
    "EventStore",
    "insert_events",
    "is_transient",
    "retry_transient",
    "to_stored",
]


class EventStore:
    """Append and read events. One instance per engine and event loop."""

    def __init__(self, engine: AsyncEngine, *, max_batch_events: int = 4096) -> None:
        self.engine = engine
        self.max_batch_events = max_batch_events
        self._pending: deque[AppendRequest] = deque()
        self._wakeup = asyncio.Event()
        self._committed = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._closed = False
        #: Stream versions as of this store's last commits (see `_resolve`).
        self._versions: dict[str, int] = {}
        self._conn: AsyncConnection | None = None
        #: File SQLite: the batches' SQL runs on a thread of its own (`store.log.sqlite_writer` says why).
        sync_twin = dialect_of(engine).append_thread_engine(engine)
        self._thread_writer = SqliteWriter(sync_twin) if sync_twin is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batches_committed = 0
        self.events_committed = 0
        #: Seconds each recent PostgreSQL group commit held the append lock, from the moment
        #: `LOCK TABLE` returned to the commit's return (what bounds writers in other processes).
        self.lock_holds: deque[float] = deque(maxlen=_LOCK_HOLDS_KEPT)

    @property
    def append_engine(self) -> sqlalchemy.Engine:
        """The synchronous engine whose connections run the appends: the writer thread's own on a
        SQLite file, else the async engine's `sync_engine` (for listeners that watch the inserts)."""
        return (
            self._thread_writer.engine
            if self._thread_writer is not None
            else self.engine.sync_engine
        )

    # ------------------------------------------------------------------ append
    async def append(
        self, session_id: str, expected_version: int, new_events: Sequence[NewEvent]
    ) -> int:
        """Append `new_events` to a session's stream if it is at `expected_version`.

        Returns the stream's new version. Re-sending events whose ids are all stored already is a
        no-op that returns the current version. Raises ConcurrencyError on a version conflict.
        """
        # Shielded: a cancelled caller must not abandon a write that may still commit.
        return await asyncio.shield(self.submit(session_id, expected_version, new_events))

    def submit(
        self, session_id: str, expected_version: int, new_events: Sequence[NewEvent]
    ) -> asyncio.Future[int]:
        """Queue an append for the next group commit; the future resolves once it is durable.

        The future is a `DeferredCancelFuture`: a task cancelled while awaiting it is cancelled
        only once the append's fate is known (see `sessions.recorder.append_then_apply`).
        """
        if self._closed:
            raise StoreError("the event store is closed; open the ledger again")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise StoreError(
                "this event store belongs to another event loop: its group-commit worker runs there, so an append "
                "from this loop would wait forever — open the ledger on the loop that records"
            )
        _check_versions(session_id, expected_version, new_events)
        future: asyncio.Future[int] = DeferredCancelFuture(loop=loop)
        if not new_events:
            future.set_result(expected_version)
            return future
        self._pending.append(AppendRequest(session_id, expected_version, new_events, future))
        self._ensure_worker()
        self._wakeup.set()
        return future

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(
                self._run(), name="rollout-ledger-group-commit"
            )

    async def _run(self) -> None:
        while True:
            if not self._pending:
                self._wakeup.clear()
                if self._closed:
                    return
                await self._wakeup.wait()
                continue
            # no local name: the batch (its requests, futures, envelopes and payloads) is freed
            # once committed, not kept alive while the worker waits for the next one
            await self._commit(self._take_batch())

    def _take_batch(self) -> list[AppendRequest]:
        taken: list[AppendRequest] = []
        count = 0
        while self._pending and (
            not taken or count + len(self._pending[0].events) <= self.max_batch_events
        ):
            request = self._pending.popleft()
            taken.append(request)
            count += len(request.events)
        return taken

    async def _commit(self, batch: list[AppendRequest], *, careful: bool = False) -> None:
        """Commit a batch. The fast path trusts the unique constraints to catch re-sent event ids;
        if they fire, each request is redone on its own, carefully: ids looked up first, so a
        re-send is an idempotent no-op and a conflict fails only its own caller."""
        try:
            outcomes = await retry_transient(
                lambda: self._commit_together(batch, careful), what="append"
            )
        except DBAPIError as error:  # IntegrityError included
            if connection_lost(error):
                # Out of retries with the connection breaking under the commit: whether it landed
                # is for the database to say, so ask it before telling anyone anything.
                for request in batch:
                    self._versions.pop(request.session_id, None)
                await self._settle_in_doubt(batch, error)
                return
            if len(batch) == 1 and (careful or not isinstance(error, IntegrityError)):
                _settle(batch[0], _wrap(error, batch[0]))
                return
            if is_transient(error):
                # Out of retries on a lock: every request in the batch would meet the same wait
                # again, so all of them fail now, within one budget (nothing was written).
                for request in batch:
                    self._versions.pop(request.session_id, None)
                    _settle(request, _wrap(error, request))
                return
            log.debug(
                "group commit of %d appends failed (%s); redoing them one by one", len(batch), error
            )
            for request in batch:
                self._versions.pop(request.session_id, None)
            for request in batch:
                await self._commit([request], careful=True)
            return
        except Exception as error:  # noqa: BLE001 - e.g. the driver refusing one row's value
            # Not the database's verdict on the batch but one row the driver could not bind (an
            # integer out of range, text that is not UTF-8): one caller's bad append must not
            # fail its neighbours (docs/design.md §4), so each request is redone on its own.
            if len(batch) == 1:
                _settle(batch[0], _wrap(error, batch[0]))
                return
            log.debug(
                "group commit of %d appends failed (%r); redoing them one by one", len(batch), error
            )
            for request in batch:
                self._versions.pop(request.session_id, None)
            for request in batch:
                await self._commit([request], careful=True)
            return
        except BaseException as error:  # cancelled or interrupted: every waiter must hear about it
            for request in batch:
                interrupted = StoreError(
                    f"the append to session {request.session_id!r} was interrupted ({error!r}); "
                    "nothing of it is known to be written: read the stream back before retrying"
                )
                interrupted.__cause__ = error
                _settle(request, interrupted)
            raise
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

    async def _settle_in_doubt(self, batch: list[AppendRequest], error: DBAPIError) -> None:
        """Tell each caller of a batch whose commit broke with its connection what the database
        holds: its events all stored (the append succeeded), none (it failed: a retry is safe),
        or, if the database cannot be asked either, `AppendOutcomeUnknown`."""
        ids = [event.event_id for request in batch for event in request.events]

        async def stored() -> set[str]:
            async with self.engine.connect() as conn:
                return set(await _known_event_ids(conn, ids))

        try:
            present = await retry_transient(stored, what="append (asking what was written)")
        except Exception as lookup_error:  # noqa: BLE001 - the database is still away
            for request in batch:
                _settle(request, _in_doubt(error, lookup_error, request))
            return
        for request in batch:
            written = [event.event_id in present for event in request.events]
            if all(written):
                self.events_committed += len(request.events)
                _settle(request, request.expected_version + len(request.events))
            elif not any(written):
                _settle(request, _wrap(error, request, written=False))
            else:  # one transaction per batch: a part can only mean a bug
                _settle(
                    request,
                    StoreInvariantError(
                        f"session {request.session_id!r}: {sum(written)} of {len(written)} events "
                        "of one append are stored after a dropped connection; report this"
                    ),
                )
        self._committed.set()
        self._committed = asyncio.Event()

    async def _commit_together(self, batch: list[AppendRequest], careful: bool) -> list[Outcome]:
        cached = None if careful else self._versions
        if self._thread_writer is not None:

            def transaction(conn: Connection) -> list[Outcome]:
                with conn.begin():
                    return run_now(
                        _decide_and_insert(ImmediateConnection(conn), batch, careful, cached)
                    )

            outcomes = await self._thread_writer.run(transaction)
        else:
            conn = await self._writer()
            try:
                async with conn.begin():
                    if dialect_of(conn).append_rows_before_lock:
                        outcomes, locked = await pg_decide_and_insert(conn, batch, careful, cached)
                    else:
                        await lock_for_append(conn)
                        outcomes, locked = (
                            await _decide_and_insert(conn, batch, careful, cached),
                            None,
                        )
                if locked is not None:
                    self.lock_holds.append(time.perf_counter() - locked)
            except BaseException as error:
                if not isinstance(
                    error, IntegrityError
                ):  # the connection may be broken: start afresh
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

    def _remember(self, batch: list[AppendRequest], outcomes: list[Outcome]) -> None:
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
        if self._thread_writer is not None:
            writer, self._thread_writer = self._thread_writer, None
            await writer.close()

    # ------------------------------------------------------------------- reads
    @wraps_faults("reading a session's stream")
    async def read_stream(
        self, session_id: str, *, at_position: int | None = None
    ) -> list[StoredEvent]:
        """All events of one session in version order, optionally only those at or before a position."""
        query = select(events).where(events.c.session_id == session_id)
        if at_position is not None:
            query = query.where(events.c.position <= at_position)
        async with self.engine.connect() as conn:
            result = await conn.execute(query.order_by(events.c.version))
            return [to_stored(row) for row in result.mappings()]

    @wraps_faults("reading sessions' streams")
    async def read_streams(
        self, session_ids: Sequence[str], *, with_payload: bool = True
    ) -> dict[str, list[StoredEvent]]:
        """Several sessions' streams in one round trip per chunk; `with_payload=False` leaves the
        token payloads unread (None) for a reader that needs only the events' data."""
        out: dict[str, list[StoredEvent]] = {sid: [] for sid in session_ids}
        columns = [events] if with_payload else [c for c in events.c if c.name != "payload"]
        async with self.engine.connect() as conn:
            for start in range(0, len(session_ids), CHUNK):
                chunk = list(session_ids[start : start + CHUNK])
                result = await conn.execute(
                    select(*columns)
                    .where(events.c.session_id.in_(chunk))
                    .order_by(events.c.session_id, events.c.version)
                )
                for row in result.mappings():
                    out[row["session_id"]].append(to_stored(row))
        return out

    @wraps_faults("reading the log")
    async def read_from(self, after_position: int = 0, *, limit: int = 1000) -> list[StoredEvent]:
        """Up to `limit` events with position > after_position, in position order."""
        async with self.engine.connect() as conn:
            return await _read_page(conn, after_position, limit)

    async def iter_from(
        self, after_position: int = 0, *, page_size: int = 1000
    ) -> AsyncIterator[list[StoredEvent]]:
        """Pages of the global log from a position to its current end."""
        position = after_position
        while True:
            page = await self.read_from(position, limit=page_size)
            if not page:
                return
            yield page
            position = page[-1].position

    @wraps_faults("reading the log's last position")
    async def last_position(self) -> int:
        async with self.engine.connect() as conn:
            return int(
                (
                    await conn.execute(select(func.coalesce(func.max(events.c.position), 0)))
                ).scalar_one()
            )

    @wraps_faults("reading a stream's version")
    async def stream_version(self, session_id: str) -> int:
        async with self.engine.connect() as conn:
            query = select(func.coalesce(func.max(events.c.version), 0)).where(
                events.c.session_id == session_id
            )
            return int((await conn.execute(query)).scalar_one())


async def _decide_and_insert(
    conn: AsyncConnection | ImmediateConnection,
    batch: list[AppendRequest],
    careful: bool,
    cached: dict[str, int] | None,
) -> list[Outcome]:
    """A batch's transaction body: each request decided against the log, the accepted rows inserted."""
    outcomes, rows = await resolve(conn, batch, check_ids=careful, cached=cached)  # type: ignore[arg-type]
    if rows:
        await conn.exec_driver_sql(insert_sql(conn.dialect), rows)
    return outcomes


#: Column order of a page row: positional access is markedly cheaper than mappings on long pages.
_PAGE_COLUMNS = [c for c in events.c if c.name != "payload"] + [events.c.payload]
_PAGE_NO_PAYLOAD = _PAGE_COLUMNS[:-1]


@wraps_faults("reading a page of the log")
async def _read_page(
    conn: AsyncConnection, after_position: int, limit: int, *, with_payload: bool = True
) -> list[StoredEvent]:
    """Events after a position; without payloads when the reader only needs the JSON data."""
    columns = _PAGE_COLUMNS if with_payload else _PAGE_NO_PAYLOAD
    result = await conn.execute(
        select(*columns)
        .where(events.c.position > after_position)
        .order_by(events.c.position)
        .limit(limit)
    )
    return [_from_page_row(row, with_payload) for row in result]


def _from_page_row(row: Any, with_payload: bool) -> StoredEvent:
    (
        position,
        event_id,
        session_id,
        version,
        type_,
        schema,
        run,
        uid,
        partition,
        step,
        data,
        recorded_at,
    ) = row[:12]
    payload = row[12] if with_payload else None
    if recorded_at.tzinfo is None:  # SQLite keeps no zone; we only ever write UTC
        recorded_at = recorded_at.replace(tzinfo=timezone.utc)
    return StoredEvent(
        position,
        event_id,
        session_id,
        version,
        type_,
        schema,
        run,
        uid,
        partition,
        step,
        data,
        bytes(payload) if payload is not None else None,
        recorded_at,
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


def _check_versions(session_id: str, expected_version: int, new_events: Sequence[NewEvent]) -> None:
    if len({event.event_id for event in new_events}) != len(new_events):
        raise StoreInputError(
            f"session {session_id!r}: the appended events repeat an event id; each event needs its own"
        )
    for offset, event in enumerate(new_events, start=1):
        if event.session_id != session_id:
            raise StoreInputError(
                f"event {event.event_id} belongs to session {event.session_id!r}, not {session_id!r}"
            )
        if event.version != expected_version + offset:
            raise StoreInputError(
                f"session {session_id!r}: event {event.event_id} has version {event.version}, "
                f"expected {expected_version + offset} (versions continue the stream without gaps)"
            )


def _settle(request: AppendRequest, outcome: int | BaseException) -> None:
    if request.future.done():
        return
    if isinstance(outcome, BaseException):
        request.future.set_exception(outcome)
    else:
        request.future.set_result(outcome)


def _wrap(error: Exception, request: AppendRequest, *, written: bool | None = None) -> Exception:
    """What a failed append's caller gets, the database's or driver's error chained as its cause
    (`written=False`: the database was asked afterwards and holds none of the append)."""
    if isinstance(error, IntegrityError):
        # A concurrent writer in another process took the same version between our read and
        # insert (possible only where the backend did not serialise us).
        wrapped: Exception = ConcurrencyError(request.session_id, request.expected_version, -1)
    else:
        # The driver's own message: SQLAlchemy's would repeat the statement and every row's parameters.
        wrapped = driver_error(_what(request), error)
        if written is False:
            wrapped.args = (
                f"{wrapped.args[0]} (none of its events was written: the same command can be "
                "run again)",
            )
    wrapped.__cause__ = error
    return wrapped


def _what(request: AppendRequest) -> str:
    """How a message names an append: a session's, or a run's configuration (`@run:<run>`)."""
    sid = request.session_id
    if sid.startswith("@run:"):
        return f"recording the configuration of run {sid[len('@run:') :]!r}"
    return f"append to session {sid!r}"


def _in_doubt(
    error: Exception, lookup_error: Exception, request: AppendRequest
) -> AppendOutcomeUnknown:
    what = _what(request)
    doubt = AppendOutcomeUnknown(
        f"{what}: the outcome is unknown — the connection dropped during its commit "
        f"({driver_error(what, error).args[0].split(' failed: ', 1)[-1].split(';')[0]}) and the "
        "database could not be asked afterwards which of its events it holds. Nothing was "
        "applied to the session's handle; once the database answers, run the same command again "
        "on the same handle: it re-sends the same event ids, so a commit that landed is "
        "recognised, not duplicated",
        what=what,
        session_id=request.session_id,
        event_ids=tuple(event.event_id for event in request.events),
    )
    doubt.__cause__ = lookup_error
    doubt.__context__ = error
    return doubt
