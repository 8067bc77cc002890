"""`run_session(timeout=…)` keeps an honest bound while an append waits.

The decision (docs/design.md §12, docs/failures.md): the call returns within `timeout` per attempt
(plus the retry backoffs) and then at most `recording_timeout` seconds for recording the session's
end, however long the database keeps an append waiting. If the end is not in the log by then, the
outcome's state is `recording` and `await outcome.recorded()` gives the recorded outcome once the
database frees. Tested against a real held lock on each backend: another process holding SQLite's
write lock (BEGIN IMMEDIATE), and `LOCK TABLE events` in another PostgreSQL connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from sessions import Ledger
from tests.conftest import backend_of
from tests.store.test_faults import write_lock_held

KW: dict[str, Any] = {"session_index": 0, "group_size": 1, "partition": "val"}
#: What the event loop, the lock holder and a loaded 2-core machine may add to a bound.
SLACK = 0.75


@contextlib.asynccontextmanager
async def lock_held(url: str, seconds: float) -> AsyncIterator[float]:
    """Another connection holds the lock every append needs for `seconds`; yields when it is
    held, with the monotonic time it will be released at. SQLite: another process in BEGIN
    IMMEDIATE. PostgreSQL: a transaction holding `LOCK TABLE events IN ACCESS EXCLUSIVE MODE`."""
    if backend_of(url) == "sqlite":
        path = url.split(":///", 1)[1]
        with write_lock_held(path, seconds):  # type: ignore[arg-type]
            yield time.monotonic() + seconds
        return
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    transaction = conn.transaction()
    await transaction.start()
    await conn.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
    released = time.monotonic() + seconds

    async def release() -> None:
        await asyncio.sleep(seconds)
        await transaction.rollback()
        await conn.close()

    releasing = asyncio.ensure_future(release())
    try:
        yield released
    finally:
        await releasing


async def _warm(ledger: Ledger) -> None:
    """The database migrated and the run's configuration recorded before the lock is taken."""
    await ledger.create_session("warm", uid="warm", global_step=99, **KW)


async def test_an_append_waiting_on_a_held_lock_returns_within_the_bound(db_url: str) -> None:
    """The runner's append is in flight when its timeout comes (the issue's case: the call used to
    return only once the database let go, 5-11 s for timeout=1): `run_session` returns at
    timeout + recording_timeout, saying the end is still being recorded; once the lock is gone
    the session is failed (`timeout`) and its group settles."""
    timeout, recording = 1.0, 1.0

    async def runner(handle: Any) -> None:
        await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3])  # waits on the lock
        await asyncio.sleep(30)

    async with Ledger.open(db_url) as ledger:
        await _warm(ledger)
        async with lock_held(db_url, 5.0) as released:
            started = time.monotonic()
            outcome = await ledger.run_session(
                runner,
                "locked",
                uid="locked",
                global_step=0,
                timeout=timeout,
                recording_timeout=recording,
                **KW,
            )
            took = time.monotonic() - started
            assert took < timeout + recording + SLACK, took
            assert time.monotonic() < released, "the bound was not tested against a held lock"
            assert (outcome.state, outcome.failure_reason) == ("recording", "timeout")
            assert isinstance(outcome.error, TimeoutError)
            assert "outcome.recorded()" in str(outcome.error), outcome.error
            final = await outcome.recorded(timeout=30)
            assert time.monotonic() >= released - 0.3  # nothing committed while the lock was held
        assert (final.state, final.failure_reason) == ("failed", "timeout"), final
        assert final.pending is None and await final.recorded() is final
        stored = await ledger.load_session("locked")
        assert (stored.state, stored.view.failure_reason) == ("failed", "timeout")
        batch = await ledger.batch("val", 0, timeout=10)  # settled: its placeholder row
        assert batch.batch_size[0] == 1 and bool(batch["is_placeholder"][0])


async def test_a_runner_failing_while_the_lock_is_held_is_recorded_afterwards(
    db_url: str,
) -> None:
    """The lock is held before the call, so the creation waits on it past the bound: the call
    returns within the bound, and once the lock is gone the session lands created and failed as
    `timeout` — its runner, which would have crashed, is never called after the call returned
    `timeout` (issue 40, case 7). `Ledger.close()` waits for a recording nobody awaited."""
    calls: list[int] = []
    timeout, recording = 0.5, 0.5

    async def runner(handle: Any) -> None:
        calls.append(1)
        raise RuntimeError("the tool crashed")

    async with Ledger.open(db_url) as ledger:
        await _warm(ledger)
        async with lock_held(db_url, 3.0):
            started = time.monotonic()
            outcome = await ledger.run_session(
                runner,
                "crashed",
                uid="crashed",
                global_step=1,
                timeout=timeout,
                recording_timeout=recording,
                **KW,
            )
            assert time.monotonic() - started < timeout + recording + SLACK
            assert outcome.state == "recording"
    async with Ledger.open(db_url) as ledger:  # the first one's close() waited for the recording
        stored = await ledger.load_session("crashed")
        assert (stored.state, stored.view.failure_reason) == ("failed", "timeout")
        assert "was not started" in (stored.view.message or "")
    assert calls == [], "the runner ran after run_session had returned timeout"


async def test_a_lock_released_within_the_bound_gives_the_recorded_outcome(db_url: str) -> None:
    """A shorter wait than recording_timeout: the call returns the terminal outcome itself, once
    the lock is released, and never later than the bound."""
    timeout, recording = 0.5, 6.0

    async def runner(handle: Any) -> None:
        await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3])
        await asyncio.sleep(30)

    async with Ledger.open(db_url) as ledger:
        await _warm(ledger)
        async with lock_held(db_url, 2.0) as released:
            started = time.monotonic()
            outcome = await ledger.run_session(
                runner,
                "waited",
                uid="waited",
                global_step=2,
                timeout=timeout,
                recording_timeout=recording,
                **KW,
            )
            took = time.monotonic() - started
        assert (outcome.state, outcome.failure_reason) == ("failed", "timeout"), outcome
        assert outcome.pending is None
        assert time.monotonic() >= released - 0.3 and took < timeout + recording + SLACK, took


async def test_the_creation_waiting_on_the_lock_counts_in_the_bound(db_url: str) -> None:
    """The lock is held before the call: even creating the session waits, and the call still
    returns within the bound; the session is created and failed (`timeout`) once the lock is
    gone, its runner never called."""
    timeout, recording = 0.5, 0.5

    async def runner(handle: Any) -> None:
        await asyncio.sleep(30)

    async with Ledger.open(db_url) as ledger:
        await _warm(ledger)
        async with lock_held(db_url, 3.0):
            started = time.monotonic()
            outcome = await ledger.run_session(
                runner,
                "late",
                uid="late",
                global_step=3,
                timeout=timeout,
                recording_timeout=recording,
                **KW,
            )
            assert time.monotonic() - started < timeout + recording + SLACK
            assert outcome.state == "recording"
        final = await outcome.recorded(timeout=30)
        assert (final.state, final.failure_reason) == ("failed", "timeout")
        assert "was not started" in str(final.error)
