"""A timeout `run_session` reports is true (issue 40, case 7; docs/design.md §12).

Once `run_session` has returned `timeout` (state `recording`), no attempt of that session starts:
a creation the database held past the time runners were given lands as created-and-failed
(`timeout`, the runner never called), and a retry whose start the database held does not run.
The database's lock is held by another connection (SQLite: a `BEGIN IMMEDIATE` write lock;
PostgreSQL: the `events` table's EXCLUSIVE lock the appends take) from a generated point — before
the session is created, or inside a generated attempt — until `run_session` has returned, so the
append waits exactly as long as the test says: no sleeps, no timing luck.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import Ledger, RetryPolicy, SandboxError, SessionHandle
from store import create_engine, local_database_file
from tests.conftest import BACKENDS, fresh_database

KW: dict[str, Any] = {"session_index": 0, "group_size": 1, "partition": "val", "global_step": 0}


class _LockHolder:
    """Another connection holding the lock every append needs, taken and released on demand."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.held = False
        self._sqlite: sqlite3.Connection | None = None
        self._pg: Any = None
        self._engine: Any = None

    async def take(self) -> None:
        path = local_database_file(self.url)
        if path is not None:
            self._sqlite = sqlite3.connect(path, isolation_level=None, timeout=30)
            self._sqlite.execute("BEGIN IMMEDIATE")  # SQLite's write lock
        else:
            self._engine = create_engine(self.url)
            self._pg = await self._engine.connect()
            await self._pg.begin()
            await self._pg.exec_driver_sql("LOCK TABLE events IN EXCLUSIVE MODE")
        self.held = True

    async def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self._sqlite is not None:
            self._sqlite.rollback()
            self._sqlite.close()
            self._sqlite = None
        else:
            await self._pg.rollback()
            await self._pg.close()
            await self._engine.dispose()


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as fresh:
        yield fresh


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    timeout=st.sampled_from([0.05, 0.1, 0.2]),
    recording=st.sampled_from([0.05, 0.1, 0.3]),
    attempts=st.integers(1, 3),
    lock_in_attempt=st.integers(
        0, 3
    ),  # 0: before the creation; k: attempt k takes it; > attempts: never
    ending=st.sampled_from(["raise", "hang"]),
)
def test_no_attempt_starts_after_run_session_returned_timeout(
    url: str, timeout: float, recording: float, attempts: int, lock_in_attempt: int, ending: str
) -> None:
    asyncio.run(_one_example(url, timeout, recording, attempts, lock_in_attempt, ending))


async def _one_example(
    url: str, timeout: float, recording: float, attempts: int, lock_in_attempt: int, ending: str
) -> None:
    session_id = f"s-{uuid.uuid4().hex[:12]}"
    holder = _LockHolder(url)
    returned = False
    calls: list[bool] = []  # one per runner call: whether run_session had returned by then
    never = asyncio.Event()

    async def runner(handle: SessionHandle) -> None:
        calls.append(returned)
        if handle.attempt == lock_in_attempt:
            await holder.take()  # this attempt's end (a retry, or the failure) waits on the lock
        if ending == "hang":
            await never.wait()  # a hung tool call: only the timeout ends it
        raise SandboxError("the sandbox went away")  # infrastructure: retried by the policy

    async with Ledger.open(url) as ledger:
        await ledger.create_session(f"warm-{session_id}", uid=f"warm-{session_id}", **KW)
        if lock_in_attempt == 0:
            await holder.take()
        try:
            outcome = await ledger.run_session(
                runner,
                session_id,
                uid=session_id,
                timeout=timeout,
                recording_timeout=recording,
                retry=RetryPolicy(max_attempts=attempts),
                **KW,
            )
        finally:
            returned = True
            await holder.release()
        final = await outcome.recorded() if outcome.state == "recording" else outcome
        assert not any(calls), f"an attempt started after run_session returned: {calls}"
        assert len(calls) <= attempts
        assert final.state == "failed", final
        if outcome.state == "recording":
            assert outcome.failure_reason == "timeout"
            assert isinstance(outcome.error, TimeoutError)
        if lock_in_attempt == 0:
            # the creation waited past every runner's time: created and failed, never run
            assert calls == [] and outcome.state == "recording"
            assert (final.state, final.failure_reason) == ("failed", "timeout")
            assert "was not started" in str(final.error)
        handle = await ledger.load_session(session_id)
        assert handle.state == final.state and handle.view.failure_reason == final.failure_reason
