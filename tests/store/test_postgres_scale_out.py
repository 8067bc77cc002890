"""PostgreSQL scale-out: global order, many writer processes, one leading projector, faults.

Every test gets a fresh database (`pg_url`), skips without a server on a developer machine and
fails without one in CI. Worker processes use the 'spawn' context and live in tests/pg_workers.py.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue as queue_module
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from tests import pg_workers

pytestmark = pytest.mark.postgres

TERMINAL = ("SessionSucceeded", "SessionFailed", "SessionCancelled")
KILL_OTHERS = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


# ---------------------------------------------------------------------------- helpers
def kill_storm(dsn: str, seconds: float, spare: int) -> int:
    """Terminate every other backend of the database but `spare`, without pause, for `seconds`
    (run in a thread with its own event loop so that the loop under test cannot slow it down)."""
    import asyncpg

    async def storm() -> int:
        conn = await asyncpg.connect(dsn)
        killed, until = 0, time.monotonic() + seconds
        try:
            while time.monotonic() < until:
                killed += sum(
                    1 for (ok,) in await conn.fetch(KILL_OTHERS + " AND pid <> $1", spare) if ok
                )
        finally:
            await conn.close()
        return killed

    return asyncio.run(storm())


class Hub:
    """Spawned worker processes and the queue they report on."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.queue = self.ctx.Queue()
        self.procs: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self.results: dict[str, Any] = {}

    def start(self, name: str, target: Any, *args: Any) -> None:
        proc = self.ctx.Process(target=target, args=(*args, self.queue), name=name, daemon=True)
        proc.start()
        self.procs[name] = proc

    def _pump(self, timeout: float) -> None:
        kind, name, body = self.queue.get(timeout=timeout)
        if kind == "ready":
            self.pids[name] = body
        elif kind == "error":
            raise AssertionError(f"worker {name} failed:\n{body}")
        else:
            self.results[name] = body

    def wait(
        self, names: list[str], *, ready: bool = False, timeout: float = 90.0
    ) -> dict[str, Any]:
        """Block until every named worker is ready (or done, with its result)."""
        deadline = time.monotonic() + timeout
        have = self.pids if ready else self.results
        while any(name not in have for name in names):
            dead = [
                n
                for n in names
                if n not in have and not self.procs[n].is_alive() and self.queue.empty()
            ]
            if dead:
                time.sleep(0.2)  # a last message may still be in flight
                if self.queue.empty():
                    raise AssertionError(
                        f"worker(s) {dead} exited ({[self.procs[n].exitcode for n in dead]}) without reporting"
                    )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting for {[n for n in names if n not in have]}")
            try:
                self._pump(min(remaining, 0.5))
            except queue_module.Empty:
                pass
        return {name: have[name] for name in names}

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(10)


@pytest.fixture
def hub() -> Iterator[Hub]:
    opened = Hub()
    try:
        yield opened
    finally:
        opened.close()


async def _migrate(url: str) -> None:
    from store import create_engine, upgrade

    engine = create_engine(url)
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()


def migrate(url: str) -> None:
    asyncio.run(_migrate(url))


def admin_dsn(url: str) -> str:
    """Plain (asyncpg) DSN for the database behind an async SQLAlchemy URL."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def fetch(url: str, sql: str, **params: Any) -> list[Any]:
    from store import create_engine

    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return list((await conn.execute(text(sql), params)).all())
    finally:
        await engine.dispose()


async def event_streams(url: str) -> dict[str, list[tuple[int, str, Any]]]:
    """session -> [(version, type, data)] in version order (the runs' configuration streams left out)."""
    streams: dict[str, list[tuple[int, str, Any]]] = defaultdict(list)
    rows = await fetch(
        url,
        "SELECT session_id, version, type, data FROM events WHERE type <> 'RunConfigured' "
        "ORDER BY session_id, version",
    )
    for sid, version, type_, data in rows:
        streams[sid].append((version, type_, data))
    return dict(streams)


def assert_sessions_whole(
    streams: dict[str, list[tuple[int, str, Any]]], *, all_terminal: bool = True
) -> Counter[str]:
    """Contiguous versions 1..n, a SessionCreated first, at most (exactly, if all_terminal) one
    terminal event and nothing after it but the placeholder that must follow a SessionFailed."""
    ends: Counter[str] = Counter()
    for sid, stream in streams.items():
        versions = [v for v, _, _ in stream]
        assert versions == list(range(1, len(stream) + 1)), (
            f"{sid}: versions {versions} are not 1..n"
        )
        types = [t for _, t, _ in stream]
        assert types[0] == "SessionCreated" and types.count("SessionCreated") == 1, (
            f"{sid}: {types}"
        )
        terminals = [i for i, t in enumerate(types) if t in TERMINAL]
        assert len(terminals) <= 1, f"{sid}: {len(terminals)} terminal events: {types}"
        if all_terminal:
            assert len(terminals) == 1, f"{sid} never ended: {types}"
        if not terminals:
            assert "PlaceholderEmitted" not in types, f"{sid}: {types}"
            ends["open"] += 1
            continue
        end = terminals[0]
        tail = types[end + 1 :]
        if types[end] == "SessionFailed":
            assert tail == ["PlaceholderEmitted"], (
                f"{sid}: SessionFailed must be followed by its placeholder: {types}"
            )
        else:
            assert tail == [], f"{sid}: events after {types[end]}: {types}"
            assert "PlaceholderEmitted" not in types, f"{sid}: {types}"
        ends[types[end]] += 1
    return ends


EXPECTED_ROWS_SQL = """
SELECT
  (SELECT coalesce(sum(jsonb_array_length(data->'selected')), 0) FROM events
     WHERE type = 'SessionSucceeded' AND position <= :upto)
  + (SELECT count(*) FROM events WHERE type = 'PlaceholderEmitted' AND position <= :upto)
"""

#: Groups whose every session has settled (succeeded, cancelled, failed and placeholder emitted).
SETTLED_GROUPS_SQL = """
WITH created AS (
  SELECT session_id, run, uid, (data->>'group_size')::int AS group_size FROM events WHERE type = 'SessionCreated'
), settled AS (
  SELECT DISTINCT session_id FROM events WHERE type IN ('SessionSucceeded', 'SessionCancelled', 'PlaceholderEmitted')
)
SELECT count(*) FROM (
  SELECT c.run, c.uid FROM created c JOIN settled s USING (session_id)
  GROUP BY c.run, c.uid HAVING count(*) >= min(c.group_size)
) g
"""


async def assert_projection_complete(url: str) -> dict[str, int]:
    """Checkpoint at the end of the log; every queue row exactly once and as many as the
    sessions table (and the log) call for."""
    ((last,),) = await fetch(url, "SELECT coalesce(max(position), 0) FROM events")
    ((checkpoint,),) = await fetch(url, "SELECT position FROM checkpoints WHERE name = 'projector'")
    assert checkpoint == last, f"checkpoint {checkpoint} is not at the end of the log ({last})"
    ((rows, tags, distinct),) = await fetch(
        url,
        "SELECT count(*) FILTER (WHERE kind = 'row'), count(*) FILTER (WHERE kind = 'tag'), "
        "count(DISTINCT (run, partition, key)) FROM queue_rows",
    )
    assert distinct == rows + tags, "duplicate queue keys"
    ((from_sessions, sessions),) = await fetch(
        url, "SELECT coalesce(sum(selected_rows), 0), count(*) FROM sessions"
    )
    ((settled_groups,),) = await fetch(url, "SELECT count(*) FROM groups WHERE status <> 'pending'")
    ((from_log,),) = await fetch(url, EXPECTED_ROWS_SQL, upto=last)
    ((settled_in_log,),) = await fetch(url, SETTLED_GROUPS_SQL)
    ((created,),) = await fetch(
        url, "SELECT count(DISTINCT session_id) FROM events WHERE type <> 'RunConfigured'"
    )
    assert rows == from_sessions == from_log, (
        f"queue rows {rows}, sessions table says {from_sessions}, log says {from_log}"
    )
    assert tags == settled_groups == settled_in_log, (
        f"group tags {tags}, groups table {settled_groups}, log {settled_in_log}"
    )
    assert sessions == created
    per_session = await fetch(
        url,
        "SELECT s.session_id FROM sessions s LEFT JOIN queue_rows q ON q.session_id = s.session_id AND q.kind = 'row' "
        "GROUP BY s.session_id, s.selected_rows HAVING count(q.id) <> s.selected_rows",
    )
    assert per_session == [], (
        f"sessions whose queue rows differ from selected_rows: {per_session[:5]}"
    )
    return {"rows": rows, "tags": tags, "sessions": sessions, "events": last}


async def copy_events(source: str, target: str) -> int:
    """Copy the log (positions included) into a migrated, empty database."""
    from store import create_engine
    from store.schema.tables import events

    src, dst = create_engine(source), create_engine(target)
    try:
        async with src.connect() as conn:
            rows = [
                dict(r)
                for r in (await conn.execute(select(events).order_by(events.c.position))).mappings()
            ]
        async with dst.begin() as conn:
            for start in range(0, len(rows), 500):
                await conn.execute(events.insert(), rows[start : start + 500])
        return len(rows)
    finally:
        await src.dispose()
        await dst.dispose()


async def read_models(url: str) -> dict[str, list[tuple[Any, ...]]]:
    from store import create_engine
    from store.schema.tables import groups, metric_counts, queue_rows, sessions

    def ordered(table: Any, *skip: str) -> Any:
        columns = [c for c in table.columns if c.name not in skip]
        return select(*columns).order_by(
            *(c.nulls_first() for c in columns if c.name not in ("reward_info", "tags", "value"))
        )

    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return {
                "sessions": [tuple(r) for r in await conn.execute(ordered(sessions))],
                "groups": [tuple(r) for r in await conn.execute(ordered(groups))],
                "queue_rows": [tuple(r) for r in await conn.execute(ordered(queue_rows, "id"))],
                "metric_counts": [
                    tuple(r) for r in await conn.execute(ordered(metric_counts, "id"))
                ],
            }
    finally:
        await engine.dispose()


async def assert_same_as_fresh_projection(url: str, fresh_url: str) -> None:
    """Project a copy of the log from scratch in another database: the read models must match."""
    from sessions.projection.projector import Projector
    from store import create_engine

    await _migrate(fresh_url)
    await copy_events(url, fresh_url)
    engine = create_engine(fresh_url)
    try:
        await Projector(engine).run()
    finally:
        await engine.dispose()
    ours, fresh = await read_models(url), await read_models(fresh_url)
    for table in ("sessions", "groups", "queue_rows"):
        assert len(ours[table]) == len(fresh[table]), table
        for mine, theirs in zip(ours[table], fresh[table]):
            assert mine == theirs, f"{table} differs from a fresh projection:\n{mine}\n{theirs}"
    assert [r[:-1] for r in ours["metric_counts"]] == [r[:-1] for r in fresh["metric_counts"]]
    for mine, theirs in zip(ours["metric_counts"], fresh["metric_counts"]):
        assert mine[-1] == pytest.approx(theirs[-1], rel=1e-9, abs=1e-9), mine


# ------------------------------------------------------------- 1. global order for a tailing reader
def test_tailing_reader_sees_every_event_in_commit_order(pg_url: str, hub: Hub) -> None:
    """Writers in 3 OS processes (2 engines each) and 2 engines in this process append
    concurrent batches while readers tail `read_from`: each must see exactly the final table
    order, and each append's events must sit together (batches never interleave).
    (Without the table lock in `EventStore`, this test fails: readers skip events that commit
    late, and concurrent batches interleave.)"""
    migrate(pg_url)
    go = hub.ctx.Event()
    names = [f"p{i}" for i in range(3)]
    for name in names:
        hub.start(name, pg_workers.append_worker, pg_url, name, 2, 3, 40, 6, go)
    hub.wait(names, ready=True)

    async def tail(reader: Any, writers: asyncio.Future[Any], seed: int) -> list[tuple[int, str]]:
        """Follow the log with `read_from` until the writers are done and the log is drained."""
        observed: list[tuple[int, str]] = []
        position, rng, empty_after_done = 0, random.Random(seed), 0
        while empty_after_done < 2:
            done = writers.done()
            page = await reader.read_from(position, limit=rng.randint(1, 40))
            for stored in page:
                assert stored.position > position, f"position {stored.position} after {position}"
                observed.append((stored.position, stored.event_id))
                position = stored.position
            if not page:
                empty_after_done = empty_after_done + 1 if done else 0
                await asyncio.sleep(0)
        return observed

    async def main() -> tuple[list[list[tuple[int, str]]], list[list[str]]]:
        from store import EventStore, create_engine

        reader = EventStore(create_engine(pg_url))
        local = asyncio.gather(
            *(
                pg_workers.append_batches(
                    pg_url, f"local{e}", streams=3, appends=40, max_batch=6, seed=e
                )
                for e in range(2)
            )
        )
        go.set()
        remote = asyncio.ensure_future(asyncio.to_thread(hub.wait, names))
        writers = asyncio.gather(local, remote)
        try:
            # three tailing readers (one engine, separate connections) poll at different page sizes
            observed = await asyncio.gather(*(tail(reader, writers, seed) for seed in range(3)))
            local_ids, remote_ids = await writers
        finally:
            await reader.close()
            await reader.engine.dispose()
        appends = [ids for per_engine in local_ids for ids in per_engine]
        appends += [ids for per_process in remote_ids.values() for ids in per_process]
        return observed, appends

    readers, appends = asyncio.run(main())
    table = [
        tuple(r)
        for r in asyncio.run(
            fetch(pg_url, "SELECT position, event_id FROM events ORDER BY position")
        )
    ]
    assert len(appends) == 8 * 40
    assert len(table) == sum(len(ids) for ids in appends)
    for observed in readers:
        missing = sorted(set(table) - set(observed))
        assert observed == table, (
            f"a tailing reader missed {len(missing)} events (first {missing[:3]})"
        )
    index = {event_id: i for i, (_, event_id) in enumerate(table)}
    for ids in appends:
        spots = [index[event_id] for event_id in ids]
        assert spots == list(range(spots[0], spots[0] + len(ids))), (
            f"an append's events interleave with others: {spots}"
        )


# ------------------------------------------------------------- 2. many writer processes, conflicts
def test_writer_processes_conflict_cleanly(pg_url: str, hub: Hub) -> None:
    """4 processes, each with its own Ledger: private sessions, plus every process creating the
    same session ids and then appending to them from stale versions. Every session stays whole;
    every conflict is reported to the writer that lost, and only to it."""
    migrate(pg_url)
    writers, private, shared = 4, 24, 12
    barrier = hub.ctx.Barrier(writers)
    names = [f"w{w}" for w in range(writers)]
    for w in range(writers):
        hub.start(names[w], pg_workers.conflict_worker, pg_url, w, private, shared, barrier)
    results = hub.wait(names, timeout=120)
    streams = asyncio.run(event_streams(pg_url))

    ends = assert_sessions_whole(streams)
    assert len(streams) == writers * private + shared
    assert sum(ends.values()) == len(streams)

    # private sessions ended as their writers were told
    event_of = {
        "succeeded": "SessionSucceeded",
        "failed": "SessionFailed",
        "cancelled": "SessionCancelled",
    }
    for name in names:
        for sid, state in results[name]["private"].items():
            assert next(t for _, t, _ in streams[sid] if t in TERMINAL) == event_of[state], sid

    for j in range(shared):
        sid = f"dup-{j}"
        stream = streams[sid]
        # creation: exactly one winner (the writer named in the stored event); the rest were told
        creators = [w for w, name in enumerate(names) if sid in results[name]["created"]]
        refused = [
            w
            for w, name in enumerate(names)
            if ("create", sid, "InvalidInput", 0, -1) in results[name]["conflicts"]
        ]
        assert len(creators) == 1, f"{sid} created by {creators}"
        assert sorted(creators + refused) == list(range(writers)), (
            f"{sid}: created by {creators}, refused {refused}"
        )
        assert stream[0][2]["metadata"] == {"writer": creators[0]}
        # stale appends: exactly one winner whose events follow version 2; the rest got ConcurrencyError
        winners = [
            w for w, name in enumerate(names) if any(a[0] == sid for a in results[name]["appended"])
        ]
        stale = {
            w: c
            for w, name in enumerate(names)
            for c in results[name]["conflicts"]
            if c[0] == "stale" and c[1] == sid
        }
        assert len(winners) == 1, f"{sid}: appended by {winners}"
        winner = winners[0]
        assert sorted([winner, *stale]) == list(range(writers)), (
            f"{sid}: winner {winner}, told of a conflict {sorted(stale)}"
        )
        for w, (_, _, kind, expected, actual) in stale.items():
            assert kind == "ConcurrencyError" and expected == 2 and actual >= 3, (sid, w, stale[w])
        action = pg_workers.CONTEND_ACTIONS[(winner + j) % len(pg_workers.CONTEND_ACTIONS)]
        types = [t for _, t, _ in stream]
        assert types[:2] == ["SessionCreated", "SessionStarted"]
        tail = {
            "succeed": ["TrajectoryRecorded", "RewardPosted", "SessionSucceeded"],
            "fail": ["SessionFailed", "PlaceholderEmitted"],
            "cancel": ["SessionCancelled"],
        }[action]
        assert types[2:] == tail, f"{sid}: {types}, winner {winner} ran {action}"
        data = stream[2][2]
        writer_seen = (
            data["extra"]["writer"] if action == "succeed" else int(data["message"].split()[-1])
        )
        assert writer_seen == winner, (
            f"{sid}: version 3 written by {writer_seen}, but writer {winner} was told it won"
        )
        versions = [
            v
            for s, _, v in sorted(
                a for name in names for a in results[name]["appended"] if a[0] == sid
            )
        ]
        assert max(versions) == len(stream)

    told = sum(len(results[name]["conflicts"]) for name in names)
    assert told == 2 * shared * (writers - 1)


# ------------------------------------------------------------- 3. one leader among projectors
def _log_lines(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.strip()]


def test_one_leading_projector_survives_sigkill(
    pg_url: str, second_pg_url: str, hub: Hub, tmp_path: Path
) -> None:
    """Two follower processes on one database: one leads; SIGKILL it mid-stream while two writer
    processes keep appending; the other takes over from the checkpoint. Every queue row lands
    exactly once and the read models equal a fresh projection of the same log."""
    migrate(pg_url)
    go = hub.ctx.Event()
    writers = ["wa", "wb"]
    for name in writers:
        hub.start(name, pg_workers.session_writer_worker, pg_url, name, 96, 0.04, go)
    logs = {name: tmp_path / f"{name}.log" for name in ("fa", "fb")}
    for name, path in logs.items():
        hub.start(name, pg_workers.follower_worker, pg_url, name, str(path), 16, 0.05)
    hub.wait([*writers, *logs], ready=True)
    go.set()

    def wait_for(what: str, condition: Any, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = condition()
            if found:
                return found
            time.sleep(0.02)
        raise AssertionError(
            f"timed out waiting for {what}: { ({n: _log_lines(p) for n, p in logs.items()}) }"
        )

    def lines(name: str, kind: str) -> list[list[str]]:
        return [line for line in _log_lines(logs[name]) if line[0] == kind]

    def leaders() -> list[str]:
        return [name for name in logs if lines(name, "leader")]

    first = wait_for("a leader", leaders)
    assert len(first) == 1, f"two followers lead at once: {first}"
    leader = first[0]
    other = next(n for n in logs if n != leader)
    wait_for("the leader to project a few pages", lambda: len(lines(leader, "page")) >= 3)
    assert all(hub.procs[w].is_alive() for w in writers) and not set(hub.results) & set(writers), (
        "writers ended too soon"
    )
    assert leaders() == [leader], "the second follower led while the first still held the lead"
    os.kill(hub.pids[leader], signal.SIGKILL)
    killed_at = time.time()
    hub.procs[leader].join(10)

    took_over = float(
        wait_for("the other follower to take over", lambda: lines(other, "leader"))[0][1]
    )
    assert took_over >= killed_at - 0.01, "the second follower led while the first was alive"
    outcomes = hub.wait(writers, timeout=90)
    assert sum(len(o) for o in outcomes.values()) == 192

    async def caught_up() -> bool:
        ((last,),) = await fetch(pg_url, "SELECT coalesce(max(position), 0) FROM events")
        checkpoint = await fetch(
            pg_url, "SELECT position FROM checkpoints WHERE name = 'projector'"
        )
        return bool(checkpoint) and checkpoint[0][0] == last

    wait_for("the new leader to reach the end of the log", lambda: asyncio.run(caught_up()))
    os.kill(hub.pids[other], signal.SIGTERM)
    total_other = hub.wait([other], timeout=30)[other]

    before = [(int(line[1]), int(line[2]), float(line[3])) for line in lines(leader, "page")]
    after = [(int(line[1]), int(line[2]), float(line[3])) for line in lines(other, "page")]
    ((events_total,),) = asyncio.run(fetch(pg_url, "SELECT count(*) FROM events"))
    assert before and after
    assert all(at >= took_over for _, _, at in after), (
        "the waiting follower projected before it led"
    )
    assert total_other == sum(n for n, _, _ in after) < events_total, (
        "the new leader restarted from the beginning"
    )
    assert after[0][1] > max(p for _, p, _ in before), (
        "the new leader re-projected pages the old one had committed"
    )
    assert sum(n for n, _, _ in before) + total_other <= events_total
    streams = asyncio.run(event_streams(pg_url))
    assert_sessions_whole(streams)
    counts = asyncio.run(assert_projection_complete(pg_url))
    assert counts["sessions"] == 192
    asyncio.run(assert_same_as_fresh_projection(pg_url, second_pg_url))


# ------------------------------------------------------------- 4. dropped connections
async def test_dropped_connections_never_tear_sessions_or_move_the_checkpoint_alone(
    pg_url: str, second_pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An admin connection terminates every other backend of the database again and again while
    sessions are recorded and projected (a `run()` loop and two `follow()`ers). Each append succeeds
    (after retries) or raises a clear StoreError; its events are all present or all absent; no
    session is torn; the checkpoint never runs ahead of its rows; a waiting follower survives and a
    stopped one ends cleanly; and projecting to the end afterwards gives exactly the expected rows
    and the read models of a fresh projection."""
    import asyncpg
    from sqlalchemy.exc import DBAPIError

    from sessions import ConcurrencyError, Ledger, SandboxError, StoreError
    from sessions.projection.projector import Projector

    caplog.set_level(logging.WARNING, logger="store.log.event_store")
    appends: list[tuple[str, list[str], BaseException | None]] = []
    command_errors: list[BaseException] = []
    projection_errors: list[BaseException] = []
    mismatches: list[tuple[int, int, int]] = []
    follow_errors: list[tuple[str, bool, bool, BaseException]] = []
    follow_totals: list[int] = []
    kills = 0
    faults_off, stop = asyncio.Event(), asyncio.Event()

    async with Ledger.open(pg_url, run="faults") as ledger:
        original = ledger.store.submit

        def recording_submit(
            session_id: str, expected: int, new_events: Any
        ) -> asyncio.Future[int]:
            """Every append goes through submit (the recorder awaits its future): record its fate."""
            ids = [e.event_id for e in new_events]
            future = original(session_id, expected, new_events)

            def settled(done: asyncio.Future[int]) -> None:
                error = asyncio.CancelledError() if done.cancelled() else done.exception()
                appends.append((session_id, ids, error))

            future.add_done_callback(settled)
            return future

        ledger.store.submit = recording_submit  # type: ignore[method-assign]

        async def admin() -> None:
            """Kill the other backends every 0.2-0.5 s (the retries absorb these), and every 2.5 s
            without pause for 0.6 s (longer than the retries last); in between, check the
            checkpoint against its rows in one snapshot."""
            nonlocal kills
            conn = await asyncpg.connect(admin_dsn(pg_url))
            rng = random.Random(11)
            try:
                next_kill, next_burst = time.monotonic() + 0.2, time.monotonic() + 1.5
                while not stop.is_set():
                    async with conn.transaction(isolation="repeatable_read", readonly=True):
                        checkpoint = await conn.fetchval(
                            "SELECT coalesce(max(position), 0) FROM checkpoints"
                        )
                        rows = await conn.fetchval(
                            "SELECT count(*) FROM queue_rows WHERE kind = 'row'"
                        )
                        expected = await conn.fetchval(
                            EXPECTED_ROWS_SQL.replace(":upto", "$1"), checkpoint
                        )
                    if rows != expected:
                        mismatches.append((checkpoint, rows, expected))
                    now = time.monotonic()
                    if not faults_off.is_set() and now >= next_kill:
                        kills += sum(1 for (ok,) in await conn.fetch(KILL_OTHERS) if ok)
                        next_kill = now + rng.uniform(0.2, 0.5)
                    if not faults_off.is_set() and now >= next_burst:
                        kills += await asyncio.to_thread(
                            kill_storm, admin_dsn(pg_url), 0.6, conn.get_server_pid()
                        )
                        next_burst = time.monotonic() + 2.5
                    await asyncio.sleep(0.01)
            finally:
                await conn.close()

        async def project() -> None:
            projector = Projector(ledger.engine, page_size=24)
            while not stop.is_set():
                try:
                    await projector.run()
                except Exception as error:  # noqa: BLE001 - retries exhausted: counted, then go on
                    projection_errors.append(error)
                await asyncio.sleep(0.02)

        async def follower(name: str) -> None:
            """`follow` as a supervisor would run it: restarted if it raises."""
            projector = Projector(ledger.engine, page_size=24)
            while not stop.is_set():
                leading = False

                def lead() -> None:
                    nonlocal leading
                    leading = True

                try:
                    follow_totals.append(
                        await projector.follow(stop, poll_interval=0.05, on_leader=lead)
                    )
                except StoreError as error:  # a driver fault, wrapped with its cause
                    follow_errors.append((name, leading, stop.is_set(), error))
                    await asyncio.sleep(0.05)

        async def session(i: int) -> None:
            plan = ("ok", "ok", "fail", "cancel", "empty")[i % 5]
            try:
                handle = await ledger.create_session(
                    f"f-{i}",
                    uid=f"fg{i // 4}",
                    session_index=i % 4,
                    group_size=4,
                    partition="train",
                    global_step=0,
                )
                if plan == "cancel":
                    await handle.cancel("operator")
                    return
                if plan != "empty":
                    await handle.record_trajectory(
                        prompt_ids=[1, 2, 3], response_ids=list(range(10, 10 + 32 + i % 7))
                    )
                if plan == "fail":
                    await handle.fail_with(SandboxError("sandbox went away"))
                    return
                await handle.post_reward(1.0)
                await handle.complete()
            except (
                StoreError
            ) as error:  # retries ran out: a clear error, and the session is left as is
                command_errors.append(error)

        limit = asyncio.Semaphore(12)

        async def limited(i: int) -> None:
            async with limit:
                await asyncio.sleep(random.uniform(0, 0.05))
                await session(i)

        started = time.monotonic()
        background = [
            asyncio.ensure_future(c) for c in (admin(), project(), follower("fa"), follower("fb"))
        ]
        batch = 0
        while time.monotonic() - started < 6.0 or batch < 2:
            await asyncio.gather(*(limited(batch * 40 + i) for i in range(40)))
            batch += 1
        faults_off.set()
        await asyncio.sleep(0.5)  # let the followers settle on connections that stay up
        stop.set()
        await asyncio.gather(*background)
        created_total = batch * 40

        # -- what the writers were told, against what is stored
        stored_ids = {r[0] for r in await fetch(pg_url, "SELECT event_id FROM events")}
        ok = [a for a in appends if a[2] is None]
        failed = [a for a in appends if a[2] is not None]
        for sid, ids, error in appends:
            present = [event_id in stored_ids for event_id in ids]
            if error is None:
                assert all(present), f"{sid}: an append that returned is missing events"
            else:
                assert all(present) or not any(present), (
                    f"{sid}: an append that raised left part of its events"
                )
                assert isinstance(error, StoreError) and not isinstance(error, ConcurrencyError), (
                    f"{sid}: {error!r}"
                )
                assert sid in str(error), f"unclear error for {sid}: {error!r}"
        for error in command_errors:
            text_ = str(error)
            assert (
                "failed" in text_ or "outcome is unknown" in text_ or "concurrency" in text_.lower()
            ), error
        assert len(ok) > 0.7 * len(appends), f"only {len(ok)} of {len(appends)} appends succeeded"
        for error in projection_errors:
            assert isinstance(error, StoreError) and isinstance(error.__cause__, DBAPIError), (
                f"projection failed with {error!r}"
            )
        # `follow` may give up only as a leader whose page retries ran out mid-storm: a waiting
        # follower outlives dropped connections, and a stop after one still ends it cleanly
        for name, leading, stopping, error in follow_errors:
            assert leading and not stopping, (
                f"follower {name} (leading={leading}, stopping={stopping}) raised {error!r}"
            )
        assert len(follow_totals) == 2, follow_errors
        retries = [r for r in caplog.records if "failed transiently" in r.getMessage()]
        assert kills > 0 and retries, (
            f"the fault injection never hit (kills {kills}, retries {len(retries)})"
        )
        assert mismatches == [], (
            f"checkpoint moved without its rows (checkpoint, rows, expected): {mismatches[:5]}"
        )

        streams = await event_streams(pg_url)
        assert_sessions_whole(streams, all_terminal=False)

        # -- recover: cancel what the faults left open, then project to the end and compare
        for sid, stream in streams.items():
            if not any(t in TERMINAL for _, t, _ in stream):
                handle = await ledger.load_session(sid)
                await handle.cancel("left open by the fault test")
        await ledger.project()
        logging.getLogger(__name__).info(
            "faults: %d backends killed, %d retries (%d in projection), %d/%d appends failed, %d projection "
            "errors, %d follow errors, %d sessions",
            kills,
            len(retries),
            sum("projection" in r.getMessage() for r in retries),
            len(failed),
            len(appends),
            len(projection_errors),
            len(follow_errors),
            len(streams),
        )

    streams = await event_streams(pg_url)
    assert_sessions_whole(streams)
    assert len(streams) <= created_total
    await assert_projection_complete(pg_url)
    await assert_same_as_fresh_projection(pg_url, second_pg_url)


# ------------------------------------------------------------- 5. the demo on PostgreSQL
def test_demo_on_postgres_ends_every_session_once(pg_url: str) -> None:
    script = Path(sys.executable).with_name("rollout-ledger")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "sessions.cli.main"]
    done = subprocess.run(
        [
            *command,
            "demo",
            "--db",
            pg_url,
            "--steps",
            "1",
            "--prompts",
            "4",
            "--group-size",
            "2",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    bad = asyncio.run(
        fetch(
            pg_url,
            "SELECT session_id, count(*) FILTER (WHERE type IN ('SessionSucceeded', 'SessionFailed', 'SessionCancelled')) "
            "FROM events WHERE type <> 'RunConfigured' GROUP BY session_id "
            "HAVING count(*) FILTER (WHERE type IN ('SessionSucceeded', 'SessionFailed', 'SessionCancelled')) <> 1",
        )
    )
    assert bad == []
    ((sessions,),) = asyncio.run(
        fetch(pg_url, "SELECT count(DISTINCT session_id) FROM events WHERE type <> 'RunConfigured'")
    )
    assert sessions == 1 * 2 * 4 * 2
    assert_sessions_whole(asyncio.run(event_streams(pg_url)))
    asyncio.run(assert_projection_complete(pg_url))
