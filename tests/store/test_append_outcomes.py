"""An append whose connection breaks under its commit ends decided or safely retryable
(docs/design.md §11).

The fault is injected where it hurts most: the commit lands, then the connection "drops" before
the caller hears (a `DBAPIError` with `connection_invalidated`), and every retry meets the same.
What the store must do, on both backends:

* ask the database afterwards: all of the append stored → the command succeeded; none → a
  `DriverError` saying nothing was written;
* if it cannot ask either → `AppendOutcomeUnknown`, nothing applied to the handle; running the
  same command again re-sends the same event ids, so a commit that landed is recognised, not
  duplicated; a different command first reads back what landed.

Which command is in doubt, and whether its commit landed, are generated (hypothesis). The kill
storm against a real PostgreSQL server is `test_a_kill_storm_ends_every_command_acknowledged_or_safely_retried`.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.exc import DBAPIError

from sessions import ConcurrencyError, Ledger, StoreError
from store import AppendOutcomeUnknown, DriverError
from store.log import append_sql, event_store
from tests.conftest import BACKENDS, fresh_database, wipe

DROPPED = "connection was closed in the middle of operation: terminating connection"

COMMANDS = ("trajectory", "reward", "complete")
EVENT_OF = {
    "trajectory": "TrajectoryRecorded",
    "reward": "RewardPosted",
    "complete": "SessionSucceeded",
}


def dropped() -> DBAPIError:
    return DBAPIError("COMMIT", None, Exception(DROPPED), connection_invalidated=True)


class Faults:
    """Patches of the store's commit and its read-back: `landing` commits the first attempt and
    then reports a dropped connection; `blind` makes asking the database afterwards fail too."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.landing = False
        self.refusing = False
        self.blind = False
        original_commit = event_store.EventStore._commit_together
        original_known = append_sql._known_event_ids

        async def commit(store: Any, batch: Any, careful: bool) -> Any:
            if self.refusing:
                raise dropped()  # before anything is written
            if self.landing:
                await original_commit(store, batch, careful)
                self.refusing = True  # every retry meets a dead connection
                raise dropped()
            return await original_commit(store, batch, careful)

        async def known(conn: Any, ids: list[str]) -> Any:
            if self.blind:
                raise dropped()
            return await original_known(conn, ids)

        monkeypatch.setattr(event_store.EventStore, "_commit_together", commit)
        monkeypatch.setattr(event_store, "_known_event_ids", known)

    def off(self) -> None:
        self.landing = self.refusing = self.blind = False


@pytest.fixture(scope="module", params=BACKENDS)
def module_url(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[str]:
    with fresh_database(request.param, tmp_path_factory.mktemp("outcomes")) as url:
        yield url


@pytest.fixture
def _quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    from store import retry

    monkeypatch.setattr(retry, "RETRY_BASE_DELAY", 0.001)


async def _command(handle: Any, name: str) -> None:
    if name == "trajectory":
        await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4, 5])
    elif name == "reward":
        await handle.post_reward(1.0)
    else:
        await handle.complete()


async def _prepare(ledger: Ledger, name: str) -> Any:
    """A session with every command before `name` done."""
    handle = await ledger.create_session(
        f"s-{uuid.uuid4().hex[:8]}",
        uid=f"u-{uuid.uuid4().hex[:8]}",
        session_index=0,
        group_size=1,
        partition="train",
    )
    for earlier in COMMANDS[: COMMANDS.index(name)]:
        await _command(handle, earlier)
    return handle


async def _types(ledger: Ledger, session_id: str) -> list[str]:
    return [s.type for s in await ledger.store.read_stream(session_id)]


SETTINGS = settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.usefixtures("_quick_retries")
@SETTINGS
@given(name=st.sampled_from(COMMANDS), lands=st.booleans())
def test_the_store_asks_the_database_before_answering(
    module_url: str, monkeypatch: pytest.MonkeyPatch, name: str, lands: bool
) -> None:
    faults = Faults(monkeypatch)

    async def check() -> None:
        await wipe(module_url)
        async with Ledger.open(module_url) as ledger:
            handle = await _prepare(ledger, name)
            before = await _types(ledger, handle.session_id)
            faults.landing, faults.refusing = lands, not lands
            if lands:
                await _command(handle, name)  # it landed: the caller is told it succeeded
                assert len(await _types(ledger, handle.session_id)) > len(before)
            else:
                with pytest.raises(DriverError, match="none of its events was written") as caught:
                    await _command(handle, name)
                assert not isinstance(caught.value, AppendOutcomeUnknown)
                assert await _types(ledger, handle.session_id) == before
            faults.off()
            assert (await ledger.store.read_stream(handle.session_id))[-1].version == handle.version

    asyncio.run(check())


@pytest.mark.usefixtures("_quick_retries")
@SETTINGS
@given(name=st.sampled_from(COMMANDS), lands=st.booleans(), same=st.booleans())
def test_an_unknown_outcome_is_resolved_by_the_next_command(
    module_url: str, monkeypatch: pytest.MonkeyPatch, name: str, lands: bool, same: bool
) -> None:
    """Blind: the store cannot ask either, so the caller hears `AppendOutcomeUnknown`. Then the
    same command again (`same`) or a different one; the commit in doubt `lands` or not."""
    faults = Faults(monkeypatch)

    async def check() -> None:
        await wipe(module_url)
        async with Ledger.open(module_url) as ledger:
            handle = await _prepare(ledger, name)
            version = handle.version
            faults.landing, faults.refusing, faults.blind = lands, not lands, True
            with pytest.raises(AppendOutcomeUnknown, match="outcome is unknown") as caught:
                await _command(handle, name)
            assert caught.value.session_id == handle.session_id and caught.value.event_ids
            assert handle.version == version  # nothing applied
            faults.off()
            same_again = same or name == "complete"  # after `complete`, only it can follow
            if same_again:
                await _command(handle, name)  # the same ids again: recognised if they landed
                done = {*COMMANDS[: COMMANDS.index(name) + 1]}
            else:
                other = COMMANDS[COMMANDS.index(name) + 1]
                if lands:  # the handle reads back what landed and refuses a stale decision
                    with pytest.raises(ConcurrencyError) as conflict:
                        await _command(handle, other)
                    assert "had been written after all" in " ".join(conflict.value.__notes__)
                await _command(handle, other)  # decided on what the log holds
                done = {*COMMANDS[: COMMANDS.index(name)], other} | ({name} if lands else set())
            stored = await ledger.store.read_stream(handle.session_id)
            types = [s.type for s in stored]
            assert stored[-1].version == handle.version
            assert len({s.event_id for s in stored}) == len(stored)
            for command, event_type in EVENT_OF.items():
                assert types.count(event_type) == (command in done), (command, types)

    asyncio.run(check())


def test_a_full_disk_on_the_runs_configuration_names_the_run_and_what_to_do(
    tmp_path: Any,
) -> None:
    from sqlalchemy import event

    async def check() -> None:
        async with Ledger.open(tmp_path / "l.db", run="r2") as ledger:  # recorded on first use
            appends = ledger.store.append_engine
            dbapi = appends.dialect.dbapi
            state = {"full": True}

            @event.listens_for(appends, "before_cursor_execute")
            def full(_c: Any, _cu: Any, statement: str, *_: Any) -> None:
                if state["full"] and statement.lstrip().upper().startswith("INSERT INTO EVENTS"):
                    raise dbapi.OperationalError("database or disk is full")

            with pytest.raises(StoreError) as caught:
                await ledger.create_session(
                    "a", uid="a", session_index=0, group_size=1, partition="val"
                )
            message = str(caught.value)
            assert message.startswith("recording the configuration of run 'r2' failed")
            assert "free space there" in message and "OperationalError:" not in message
            state["full"] = False
            handle = await ledger.create_session(
                "a", uid="a", session_index=0, group_size=1, partition="val"
            )
            await handle.complete()

    asyncio.run(check())


# ------------------------------------------------------------ a real server, backends killed
KILL = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
    "WHERE datname = $1 AND pid <> pg_backend_pid()"
)


@pytest.mark.postgres
def test_a_kill_storm_ends_every_command_acknowledged_or_safely_retried(pg_url: str) -> None:
    """Every backend of the database is terminated every 10-80 ms while sessions record (waves of 40, until a command has
    met the storm).
    Each command is run until it is acknowledged, retrying on any `StoreError` as a user would
    (the same command on the same handle). At the end every session holds each of its events
    exactly once, and every error was a `StoreError` that said what it knew; `Ledger.open` in the
    storm opens or raises a `StoreError`."""
    import asyncpg
    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    admin_dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    errors: collections.Counter[str] = collections.Counter()
    created: list[int] = []
    opens: collections.Counter[str] = collections.Counter()

    async def storm() -> int:
        stop = asyncio.Event()
        admin = await asyncpg.connect(admin_dsn)
        kills = 0

        async def killer() -> None:
            nonlocal kills
            rng = random.Random(5)
            while not stop.is_set():
                kills += len(await admin.fetch(KILL, url.database))
                await asyncio.sleep(rng.uniform(0.01, 0.08))

        async with Ledger.open(pg_url, run="storm") as ledger:
            task = asyncio.ensure_future(killer())

            async def until_acknowledged(command: Any) -> Any:
                for _ in range(200):
                    try:
                        return await command()
                    except StoreError as error:  # anything else fails the test
                        errors[type(error).__name__] += 1
                        text = str(error)
                        assert (
                            "none of its events was written" in text
                            or "outcome is unknown" in text
                            or "expected version" in text
                            or "failed" in text
                        ), text
                        await asyncio.sleep(0.02)
                raise AssertionError("a command never went through")

            async def session(i: int) -> None:
                handle = await until_acknowledged(
                    lambda: ledger.create_session(
                        f"k{i}",
                        uid=f"g{i // 4}",
                        session_index=i % 4,
                        group_size=4,
                        partition="train",
                        global_step=0,
                    )
                )
                for name in COMMANDS:
                    await until_acknowledged(lambda name=name: _command(handle, name))

            started, wave = time.monotonic(), 0
            while wave < 3 or not errors and time.monotonic() - started < 60:
                await asyncio.gather(*(session(wave * 40 + i) for i in range(40)))
                wave += 1
            created.append(wave * 40)
            for _ in range(8):
                try:
                    async with Ledger.open(pg_url, run="storm"):
                        opens["opened"] += 1
                except StoreError:
                    opens["StoreError"] += 1
            stop.set()
            await task
        await admin.close()
        return kills

    kills = asyncio.run(storm())
    assert kills > 0 and sum(errors.values()) > 0, "the storm never hit a command"

    async def stored() -> list[Any]:
        conn = await asyncpg.connect(admin_dsn)
        try:
            return await conn.fetch("SELECT session_id, type FROM events ORDER BY position")
        finally:
            await conn.close()

    per_session: dict[str, list[str]] = collections.defaultdict(list)
    for row in asyncio.run(stored()):
        per_session[row["session_id"]].append(row["type"])
    sessions = {sid: types for sid, types in per_session.items() if sid.startswith("k")}
    assert len(sessions) == created[0]
    for sid, types in sessions.items():
        assert types.count("SessionCreated") == 1, (sid, types)
        assert types.count("TrajectoryRecorded") == 1, (sid, types)
        assert types.count("RewardPosted") == 1, (sid, types)
        assert types.count("SessionSucceeded") == 1, (sid, types)
    assert sum(opens.values()) == 8
    print(f"kills {kills}; errors {dict(errors)}; opens {dict(opens)}")
