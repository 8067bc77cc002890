"""Event store conformance, written once and run on SQLite and PostgreSQL (docs/design.md §8).

Modelled on the `eventsourcing` package's recorder test cases: optimistic concurrency,
idempotent re-sends, global ordering and paging, group commit, isolation of a bad append.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import func, select

from store import ConcurrencyError, EventStore, NewEvent, StoreError, create_engine, upgrade
from store.schema.tables import events as events_table


def mk(
    session_id: str,
    version: int,
    *,
    type: str = "Noted",
    data: dict[str, Any] | None = None,
    payload: bytes | None = None,
    event_id: str | None = None,
    run: str = "r",
    uid: str = "u",
    partition: str = "val",
    global_step: int | None = 0,
) -> NewEvent:
    return NewEvent(
        event_id=event_id or str(uuid.uuid4()),
        session_id=session_id,
        version=version,
        type=type,
        schema_version=1,
        run=run,
        uid=uid,
        partition=partition,
        global_step=global_step,
        data=data if data is not None else {"n": version},
        payload=payload,
        recorded_at=datetime.now(timezone.utc),
    )


def batch(session_id: str, after: int, n: int, **kwargs: Any) -> list[NewEvent]:
    return [mk(session_id, after + i, **kwargs) for i in range(1, n + 1)]


async def open_store(url: str, **kwargs: Any) -> EventStore:
    engine = create_engine(url)
    await upgrade(engine)
    return EventStore(engine, **kwargs)


async def shut(store: EventStore) -> None:
    await store.close()
    await store.engine.dispose()


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[EventStore]:
    opened = await open_store(db_url)
    try:
        yield opened
    finally:
        await shut(opened)


async def row_count(store: EventStore) -> int:
    async with store.engine.connect() as conn:
        return int(
            (await conn.execute(select(func.count()).select_from(events_table))).scalar_one()
        )


async def ids_stored(store: EventStore, event_ids: list[str]) -> set[str]:
    async with store.engine.connect() as conn:
        result = await conn.execute(
            select(events_table.c.event_id).where(events_table.c.event_id.in_(event_ids))
        )
        return {row[0] for row in result}


# ------------------------------------------------------------------ basics
async def test_append_and_read_stream_round_trip(store: EventStore) -> None:
    assert await store.read_stream("s1") == []
    assert await store.stream_version("s1") == 0
    assert await store.last_position() == 0
    first = [
        mk(
            "s1",
            1,
            type="A",
            data={"nested": {"x": [1, 2.5, None]}, "s": "ü"},
            run="run-1",
            uid="g1",
            partition="train",
            global_step=None,
        ),
        mk(
            "s1",
            2,
            type="B",
            payload=b"\x00\x01\xff" * 10,
            run="run-1",
            uid="g1",
            partition="train",
            global_step=None,
        ),
    ]
    assert await store.append("s1", 0, first) == 2
    assert await store.append("s1", 2, [mk("s1", 3, type="C")]) == 3
    got = await store.read_stream("s1")
    assert [e.version for e in got] == [1, 2, 3]
    assert [e.type for e in got] == ["A", "B", "C"]
    assert [e.event_id for e in got[:2]] == [e.event_id for e in first]
    assert got[0].data == {"nested": {"x": [1, 2.5, None]}, "s": "ü"}
    assert got[0].payload is None
    assert got[1].payload == b"\x00\x01\xff" * 10 and isinstance(got[1].payload, bytes)
    assert (
        got[0].run,
        got[0].uid,
        got[0].partition,
        got[0].global_step,
        got[0].schema_version,
    ) == (
        "run-1",
        "g1",
        "train",
        None,
        1,
    )
    for new, old in zip(got[:2], first):
        assert new.recorded_at.tzinfo is not None
        assert abs(new.recorded_at - old.recorded_at) < timedelta(milliseconds=1)
    assert await store.stream_version("s1") == 3
    assert await store.last_position() == got[-1].position


async def test_read_stream_is_in_version_order_and_isolated_per_session(store: EventStore) -> None:
    for round_ in range(3):
        for sid in ("a", "b", "c"):
            await store.append(
                sid, round_, [mk(sid, round_ + 1, data={"sid": sid, "round": round_})]
            )
    for sid in ("a", "b", "c"):
        stream = await store.read_stream(sid)
        assert [e.version for e in stream] == [1, 2, 3]
        assert [e.data for e in stream] == [{"sid": sid, "round": r} for r in range(3)]
        assert all(e.session_id == sid for e in stream)
    many = await store.read_streams(["c", "a", "missing"])
    assert [e.version for e in many["a"]] == [1, 2, 3]
    assert [e.data["sid"] for e in many["c"]] == ["c"] * 3
    assert many["missing"] == []
    # without payloads: the same events, their payloads left unread
    await store.append("p", 0, [mk("p", 1, payload=b"\x01\x02")])
    with_payload = (await store.read_streams(["p"]))["p"]
    without = (await store.read_streams(["p"], with_payload=False))["p"]
    assert [e.payload for e in with_payload] == [b"\x01\x02"]
    assert [e.payload for e in without] == [None]
    assert [dataclasses.replace(e, payload=None) for e in with_payload] == without
    # as of a position: only what had been appended by then
    b_stream = await store.read_stream("b")
    at = b_stream[1].position
    assert [e.version for e in await store.read_stream("b", at_position=at)] == [1, 2]
    assert [e.version for e in await store.read_stream("a", at_position=at)] == [1, 2]


async def test_append_checks_versions_and_sessions_before_queueing() -> None:
    """Malformed appends are refused before they reach any database (no tables needed)."""
    unopened = EventStore(create_engine("sqlite+aiosqlite://"))
    try:
        with pytest.raises(ValueError, match="version"):
            await unopened.append("s", 0, [mk("s", 2)])  # gap
        with pytest.raises(ValueError, match="version"):
            await unopened.append("s", 0, [mk("s", 1), mk("s", 3)])
        with pytest.raises(ValueError, match="belongs to session"):
            await unopened.append("s", 0, [mk("other", 1)])
        first = mk("s", 1)
        with pytest.raises(ValueError, match="repeat an event id"):
            await unopened.append(
                "s", 0, [first, dataclass_replace(mk("s", 2), event_id=first.event_id)]
            )
        assert await unopened.append("s", 0, []) == 0
        assert await unopened.append("s", 5, []) == 5
        assert unopened.batches_committed == 0 and unopened.events_committed == 0
    finally:
        await shut(unopened)


# ------------------------------------------------------------------ optimistic concurrency
async def test_conflicting_expected_version_raises_and_writes_nothing(store: EventStore) -> None:
    await store.append("s", 0, batch("s", 0, 2))
    for expected in (0, 1, 3, 7):  # a new stream's version, stale, ahead, far ahead
        before_position, before_rows = await store.last_position(), await row_count(store)
        rejected = batch("s", expected, 3)
        with pytest.raises(ConcurrencyError) as info:
            await store.append("s", expected, rejected)
        assert info.value.session_id == "s"
        assert info.value.expected == expected and info.value.actual == 2
        assert "'s'" in str(info.value) and f"expected version {expected}" in str(info.value)
        assert await store.stream_version("s") == 2
        assert await store.last_position() == before_position
        assert await row_count(store) == before_rows
        assert await ids_stored(store, [e.event_id for e in rejected]) == set()
    # the stream still accepts the right version afterwards
    assert await store.append("s", 2, batch("s", 2, 1)) == 3


async def test_a_stream_advanced_by_another_writer_is_not_appended_to_from_a_stale_version(
    db_url: str,
) -> None:
    """A store remembers the versions it committed and skips the version query when a request
    expects exactly that version; another process's append in between must still be caught."""
    mine, other = await open_store(db_url), await open_store(db_url)
    try:
        assert await mine.append("s", 0, batch("s", 0, 2)) == 2  # `mine` now believes s is at 2
        assert await other.append("s", 2, batch("s", 2, 1)) == 3
        stale = batch("s", 2, 2)
        with pytest.raises(ConcurrencyError) as info:
            await mine.append("s", 2, stale)
        assert info.value.expected == 2
        assert [e.version for e in await mine.read_stream("s")] == [1, 2, 3]
        assert await ids_stored(mine, [e.event_id for e in stale]) == set()
        # having failed once, it asks the database and appends from the true version
        assert await mine.append("s", 3, batch("s", 3, 1)) == 4
        # a batch mixing a stale remembered stream with a fresh one fails only the stale request
        assert await other.append("s", 4, batch("s", 4, 1)) == 5
        results = await asyncio.gather(
            mine.append("s", 4, batch("s", 4, 1)),
            mine.append("t", 0, batch("t", 0, 1)),
            return_exceptions=True,
        )
        assert isinstance(results[0], ConcurrencyError) and results[1] == 1
        assert [e.version for e in await mine.read_stream("s")] == [1, 2, 3, 4, 5]
    finally:
        await shut(mine)
        await shut(other)


async def test_concurrency_error_is_a_store_error() -> None:
    assert issubclass(ConcurrencyError, StoreError)


# ------------------------------------------------------------------ idempotency
async def test_resending_stored_event_ids_is_a_no_op(store: EventStore) -> None:
    sent = batch("s", 0, 3)
    assert await store.append("s", 0, sent) == 3
    committed = store.events_committed
    position = await store.last_position()
    # the same request again (e.g. a retry after a lost acknowledgement)
    assert await store.append("s", 0, sent) == 3
    # and once the stream has moved on, a late duplicate still is a no-op, not a conflict
    assert await store.append("s", 3, batch("s", 3, 1)) == 4
    assert await store.append("s", 0, sent) == 4
    assert await store.append("s", 0, sent[:1]) == 4
    assert await row_count(store) == 4
    assert await store.last_position() > position  # only the genuinely new event was added
    assert store.events_committed == committed + 1
    assert [e.event_id for e in (await store.read_stream("s"))[:3]] == [e.event_id for e in sent]


async def test_partially_known_or_foreign_event_ids_are_an_error(store: EventStore) -> None:
    sent = batch("s", 0, 2)
    await store.append("s", 0, sent)
    fresh = mk("s", 3)
    mixed = [dataclass_replace(sent[1], version=3), dataclass_replace(fresh, version=4)]
    with pytest.raises(StoreError, match="some but not all"):
        await store.append("s", 2, mixed)
    assert await store.stream_version("s") == 2
    assert await ids_stored(store, [fresh.event_id]) == set()
    # an id stored under another session is not a re-send
    with pytest.raises(StoreError, match="already used by session"):
        await store.append("b", 0, [dataclass_replace(sent[0], session_id="b")])
    assert await store.read_stream("b") == []


def dataclass_replace(event: NewEvent, **changes: Any) -> NewEvent:
    import dataclasses

    return dataclasses.replace(event, **changes)


# ------------------------------------------------------------------ global order
async def test_positions_are_strictly_increasing_and_read_from_pages(store: EventStore) -> None:
    appended: list[str] = []
    for round_ in range(4):
        for sid in ("x", "y", "z"):
            events = batch(sid, round_ * 2, 2)
            await store.append(sid, round_ * 2, events)
            appended += [e.event_id for e in events]
    everything = await store.read_from(0, limit=10_000)
    assert [e.event_id for e in everything] == appended  # commit order
    positions = [e.position for e in everything]
    assert all(a < b for a, b in zip(positions, positions[1:]))
    assert positions[-1] == await store.last_position()

    for limit in (1, 5, 7, 24, 100):
        pages, after = [], 0
        while page := await store.read_from(after, limit=limit):
            assert len(page) <= limit
            assert page[0].position > after
            pages.append(page)
            after = page[-1].position
        assert [e.position for page in pages for e in page] == positions
        assert len(pages) == -(-len(positions) // limit)

    middle = positions[10]
    assert [e.position for e in await store.read_from(middle, limit=3)] == positions[11:14]
    assert await store.read_from(positions[-1]) == []
    collected = [
        e.position async for page in store.iter_from(positions[4], page_size=4) for e in page
    ]
    assert collected == positions[5:]


async def test_events_of_one_append_get_contiguous_positions_across_writers(db_url: str) -> None:
    """Two independent stores (as two processes would) never interleave one append's events."""
    stores = [await open_store(db_url), await open_store(db_url)]
    try:
        requests = [(stores[i % 2], f"s{i}", batch(f"s{i}", 0, 5)) for i in range(16)]
        await asyncio.gather(*(s.append(sid, 0, evs) for s, sid, evs in requests))
        log = await stores[0].read_from(0, limit=1000)
        assert len(log) == 80
        for _, sid, _evs in requests:
            mine = [e.position for e in log if e.session_id == sid]
            index = [e.position for e in log].index(mine[0])
            assert [e.position for e in log[index : index + 5]] == mine, (
                f"{sid}'s events were interleaved"
            )
            assert [e.version for e in log[index : index + 5]] == [1, 2, 3, 4, 5]
    finally:
        for s in stores:
            await shut(s)


@contextlib.contextmanager
def _at_the_append_lock() -> Iterator[threading.Event]:
    """An event set when an append issues the statement that takes the log's write lock
    (SQLite's `BEGIN IMMEDIATE`, PostgreSQL's `LOCK TABLE events`), on any engine of this process."""
    reached = threading.Event()

    def seen(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith(("BEGIN IMMEDIATE", "LOCK TABLE events")):
            reached.set()

    sqlalchemy.event.listen(sqlalchemy.Engine, "before_cursor_execute", seen)
    try:
        yield reached
    finally:
        sqlalchemy.event.remove(sqlalchemy.Engine, "before_cursor_execute", seen)


async def test_a_reader_never_sees_a_later_position_before_an_earlier_one(
    store: EventStore,
) -> None:
    """While another writer's insert is uncommitted, an append must not become visible past it:
    every snapshot a tailing reader takes is a prefix of the final log (docs/design.md §8)."""
    from store.dialects import WRITE_LOCK
    from store.log.event_store import insert_events

    await store.append("before", 0, batch("before", 0, 1))
    slow = mk("other-writer", 1)
    async with store.engine.connect() as conn:
        conn = await conn.execution_options(**{WRITE_LOCK: True})
        transaction = await conn.begin()
        await insert_events(conn, [slow])  # takes a position, not yet committed
        with _at_the_append_lock() as waiting:
            append = asyncio.ensure_future(store.append("later", 0, batch("later", 0, 2)))
            # the append is at the lock the open transaction holds: a known point, not a sleep
            assert await asyncio.to_thread(waiting.wait, 30), "the append never reached its lock"
        snapshot = [e.position for e in await store.read_from(0)]
        await transaction.commit()
    assert await asyncio.wait_for(append, 30) == 2
    final = await store.read_from(0)
    assert [e.session_id for e in final] == ["before", "other-writer", "later", "later"]
    positions = [e.position for e in final]
    assert snapshot == positions[: len(snapshot)], (
        "a reader saw an event that an earlier position then joined"
    )


# ------------------------------------------------------------------ group commit
async def test_concurrent_appends_are_group_committed_and_readable_on_return(
    store: EventStore,
) -> None:
    n = 60
    before = store.batches_committed

    async def one(i: int) -> int:
        sid = f"gc-{i}"
        events = batch(sid, 0, 1 + i % 3)
        version = await store.append(sid, 0, events)
        # on return the events are committed: readable through any other connection
        stream = await store.read_stream(sid)
        assert [e.event_id for e in stream] == [e.event_id for e in events]
        return version

    versions = await asyncio.gather(*(one(i) for i in range(n)))
    assert versions == [1 + i % 3 for i in range(n)]
    used = store.batches_committed - before
    assert 1 <= used < n, f"{n} concurrent appends took {used} transactions"
    assert store.events_committed == sum(1 + i % 3 for i in range(n))
    assert await row_count(store) == store.events_committed

    # a batch never exceeds max_batch_events (a single larger append still goes through alone)
    small = EventStore(store.engine, max_batch_events=4)
    try:
        await asyncio.gather(*(small.append(f"m{i}", 0, batch(f"m{i}", 0, 2)) for i in range(10)))
        assert small.batches_committed >= 5  # 20 events, at most 4 per transaction
        assert await small.append("big", 0, batch("big", 0, 9)) == 9
        assert await row_count(store) == store.events_committed + 29
    finally:
        await small.close()


async def test_one_stale_append_fails_alone_within_a_batch(store: EventStore) -> None:
    await store.append("bad", 0, batch("bad", 0, 2))
    before = store.batches_committed
    good = {f"ok-{i}": batch(f"ok-{i}", 0, 2) for i in range(20)}
    stale = batch("bad", 1, 1)  # the stream is at 2
    calls = [store.append(sid, 0, evs) for sid, evs in list(good.items())[:10]]
    calls.append(store.append("bad", 1, stale))
    calls += [store.append(sid, 0, evs) for sid, evs in list(good.items())[10:]]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(results[10], ConcurrencyError)
    assert results[:10] + results[11:] == [2] * 20
    assert store.batches_committed - before < len(calls), "the appends were not committed together"
    for sid, evs in good.items():
        assert [e.event_id for e in await store.read_stream(sid)] == [e.event_id for e in evs]
    assert await store.stream_version("bad") == 2
    assert await ids_stored(store, [stale[0].event_id]) == set()

    # in one batch: a resend of a queued request is a no-op; a second writer at the same version loses
    first, rival = batch("s", 0, 2), batch("s", 0, 2)
    results = await asyncio.gather(
        store.append("s", 0, first),
        store.append("s", 0, first),
        store.append("s", 0, rival),
        return_exceptions=True,
    )
    assert results[0] == 2 and results[1] == 2
    assert isinstance(results[2], ConcurrencyError)
    assert [e.event_id for e in await store.read_stream("s")] == [e.event_id for e in first]


async def test_same_session_same_expected_version_exactly_one_wins(db_url: str) -> None:
    """Several tasks — across independent stores, as separate processes would be — race for version 2."""
    stores = [await open_store(db_url) for _ in range(3)]
    try:
        await stores[0].append("contested", 0, batch("contested", 0, 1))
        attempts = [batch("contested", 1, 2) for _ in range(9)]
        results = await asyncio.gather(
            *(stores[i % 3].append("contested", 1, evs) for i, evs in enumerate(attempts)),
            return_exceptions=True,
        )
        winners = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
        losers = [r for r in results if isinstance(r, BaseException)]
        assert len(winners) == 1, results
        assert results[winners[0]] == 3
        assert len(losers) == 8 and all(isinstance(r, ConcurrencyError) for r in losers), losers
        stream = await stores[1].read_stream("contested")
        assert [e.version for e in stream] == [1, 2, 3]
        assert [e.event_id for e in stream[1:]] == [e.event_id for e in attempts[winners[0]]]
    finally:
        for s in stores:
            await shut(s)


async def test_lifecycle_followers_cancelled_callers_and_close(store: EventStore) -> None:
    # followers wake on a commit
    assert await store.wait_for_commit(timeout=0.01) is False
    waiter = asyncio.ensure_future(store.wait_for_commit(timeout=5))
    await asyncio.sleep(0)
    await store.append("w", 0, batch("w", 0, 1))
    assert await waiter is True
    # a cancelled caller does not abandon its write
    kept = batch("cancelled-caller", 0, 2)
    task = asyncio.ensure_future(store.append("cancelled-caller", 0, kept))
    await asyncio.sleep(0)  # queued
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # close commits what is queued, then refuses new appends
    pending = [
        asyncio.ensure_future(store.append(f"c{i}", 0, batch(f"c{i}", 0, 1))) for i in range(5)
    ]
    await asyncio.sleep(0)
    await store.close()
    assert [await p for p in pending] == [1] * 5
    assert [e.event_id for e in await store.read_stream("cancelled-caller")] == [
        e.event_id for e in kept
    ]
    assert await row_count(store) == 1 + 2 + 5
    with pytest.raises(StoreError, match="closed"):
        await store.append("late", 0, batch("late", 0, 1))


# ------------------------------------------------------------------ durability
async def test_reopening_a_sqlite_file_keeps_everything(sqlite_url: str) -> None:
    first = await open_store(sqlite_url)
    written: dict[str, list[NewEvent]] = {}
    for i in range(5):
        sid = f"keep-{i}"
        written[sid] = batch(sid, 0, 3, payload=bytes([i]) * 8)
    await asyncio.gather(*(first.append(sid, 0, evs) for sid, evs in written.items()))
    log_before = await first.read_from(0, limit=1000)
    await shut(first)

    second = await open_store(sqlite_url)  # upgrade on an up-to-date database is a no-op
    try:
        log_after = await second.read_from(0, limit=1000)
        assert log_after == log_before
        for sid, evs in written.items():
            stream = await second.read_stream(sid)
            assert [e.event_id for e in stream] == [e.event_id for e in evs]
            assert [e.payload for e in stream] == [e.payload for e in evs]
        # and appends continue from where the log was
        await second.append("keep-0", 3, batch("keep-0", 3, 1))
        with pytest.raises(ConcurrencyError):
            await second.append("keep-1", 0, batch("keep-1", 0, 1))
        assert (await second.read_from(log_before[-1].position))[0].session_id == "keep-0"
    finally:
        await shut(second)


async def test_reopened_ledger_folds_the_same_sessions(sqlite_url: str) -> None:
    from sessions import Ledger
    from sessions import aggregate as agg
    from sessions import events as ev

    async with Ledger.open(sqlite_url) as ledger:
        handle = await ledger.create_session(
            "persist", uid="u", session_index=0, group_size=1, partition="val"
        )
        await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3], num_turns=1)
        await handle.post_reward(1.0, acc=1.0)
        await handle.complete()
        live = handle.view
    async with Ledger.open(sqlite_url) as reopened:
        stored = await reopened.store.read_stream("persist")
        assert agg.fold("persist", (ev.decode(s).event for s in stored)) == live
        assert (await reopened.load_session("persist")).view == live


async def test_a_failed_insert_reports_the_driver_error_without_the_rows(store: EventStore) -> None:
    """A write the driver refuses fails its own append with a short StoreError naming the session,
    not SQLAlchemy's message that repeats the statement and every row's parameters."""
    bad = mk("s", 1, payload=complex(1, 2), data={"big": "x" * 5000})  # type: ignore[arg-type]
    with pytest.raises(StoreError) as info:
        await store.append("s", 0, [bad])
    message = str(info.value)
    assert "session 's'" in message
    assert "[SQL:" not in message and "x" * 100 not in message and len(message) < 600, message
    assert await store.stream_version("s") == 0
    assert await store.append("s", 0, batch("s", 0, 1)) == 1  # the store still works


async def test_sqlite_file_appends_run_on_the_writer_thread_and_memory_ones_on_the_loops_connection(
    tmp_path: Any,
) -> None:
    """A SQLite file's group commits run on a thread of their own (store.sqlite_writer); an
    in-memory database has one connection only, so its appends stay on the engine's."""
    from sqlalchemy import event

    for url, on_thread in (
        (f"sqlite+aiosqlite:///{tmp_path / 'file.db'}", True),
        ("sqlite+aiosqlite://", False),
    ):
        opened = await open_store(url)
        try:
            threads: list[str] = []
            event.listen(
                opened.append_engine,
                "before_cursor_execute",
                lambda *_args, threads=threads: threads.append(threading.current_thread().name),
            )
            assert (opened.append_engine is not opened.engine.sync_engine) is on_thread
            await asyncio.gather(
                *(opened.append(f"t{i}", 0, batch(f"t{i}", 0, 2)) for i in range(20))
            )
            assert await row_count(opened) == 40 and threads
            assert (
                all(name.startswith("rollout-ledger-sqlite-append") for name in threads)
                is on_thread
            )
        finally:
            await shut(opened)
