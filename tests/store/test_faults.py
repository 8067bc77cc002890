"""Faults: a queue sink that raises or hangs, a locked, read-only or full SQLite database.

Each fault ends in success after a retry or in a clear error naming the problem, and never in a
half-written log (versions contiguous, no partial appends, `audit` clean) or a checkpoint that
moved past rows the sink never got.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from sessions import InProcessQueue, Ledger, StoreError
from sessions.audit.auditing import audit
from sessions.runs.recovery import recover
from store import read_models as rm
from tests import crash_workers as cw

KW: dict[str, Any] = {"partition": "val", "global_step": 0, "data_source": "faults"}


async def record_group(ledger: Ledger, uid: str, *, size: int = 2) -> None:
    """One group: session 0 succeeds, the others fail (placeholders)."""
    for index in range(size):
        try:
            async with ledger.session(
                f"{uid}-{index}", uid=uid, session_index=index, group_size=size, **KW
            ) as s:
                await s.record_trajectory(prompt_ids=[1, 2, 3], response_ids=[4, 5])
                if index:
                    raise RuntimeError("runner failed")
                await s.post_reward(1.0)
        except RuntimeError:
            pass


async def checkpoint(ledger: Ledger) -> int:
    async with ledger.engine.connect() as conn:
        return await rm.get_checkpoint(conn)


async def log_is_whole(ledger: Ledger) -> dict[str, Any]:
    """Versions contiguous, no torn append, projection consistent, audit clean."""
    streams = await cw.log_streams(ledger.engine)
    facts = cw.check_streams(streams)
    await cw.check_projection(ledger.engine, streams)
    report = await audit(ledger.engine)
    assert report.ok, [str(d) for d in report.divergences[:3]]
    return facts


# ------------------------------------------------------------------------------ queue faults
class FlakySink:
    """Fails its first `failures` puts (raising, or hanging when `hang`), then delivers."""

    def __init__(self, failures: int, *, hang: bool = False) -> None:
        self.inner = InProcessQueue()
        self.failures = failures
        self.hang = hang
        self.calls = 0
        self.order: list[str] = []

    async def put(self, items: Any) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            if self.hang:
                await asyncio.Event().wait()  # never set: hangs until cancelled
            raise ConnectionError(f"queue unreachable (put #{self.calls})")
        self.order.extend(item.key for item in items)
        await self.inner.put(items)


async def _follow_until_tag(
    ledger: Ledger,
    sink: FlakySink,
    uid: str,
    errors: list[tuple[Any, int, float]],
    *,
    backoff: float = 0.01,
    max_backoff: float = 0.04,
) -> asyncio.Task[int]:
    stop = asyncio.Event()
    follower = asyncio.create_task(
        ledger.projector.follow(
            stop,
            poll_interval=0.05,
            backoff=backoff,
            max_backoff=max_backoff,
            on_error=lambda error, attempt, delay: errors.append((error, attempt, delay)),
        )
    )
    # while the sink fails, the checkpoint stays put and nothing is in the queue table
    while len(errors) < 2:
        assert not follower.done(), follower.exception() if follower.done() else None
        await asyncio.sleep(0.005)
    assert await checkpoint(ledger) == 0
    async with ledger.engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM queue_rows"))).scalar_one() == 0
    deadline = time.monotonic() + 20
    while sink.inner.tag(ledger.run, "val", uid) is None:
        assert time.monotonic() < deadline, f"no tag for {uid} after {len(errors)} errors"
        assert not follower.done(), follower.exception() if follower.done() else None
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(follower, 5)
    return follower


async def test_follow_retries_a_raising_sink_with_backoff_until_the_group_tag_lands(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    sink = FlakySink(failures=5)
    errors: list[tuple[Any, int, float]] = []
    caplog.set_level(logging.WARNING, logger="sessions.projection.projector")
    async with Ledger.open(db_url, sinks=[sink]) as ledger:
        await record_group(ledger, "g1", size=3)
        follower = await _follow_until_tag(ledger, sink, "g1", errors)
        assert [(type(e), a, d) for e, a, d in errors] == [
            (ConnectionError, 1, 0.01),
            (ConnectionError, 2, 0.02),
            (ConnectionError, 3, 0.04),
            (ConnectionError, 4, 0.04),
            (ConnectionError, 5, 0.04),
        ]  # exponential, capped
        assert ledger.projector.failures_total == 5 and ledger.projector.failures == 0
        assert isinstance(ledger.projector.last_error, ConnectionError)
        warned = [r.getMessage() for r in caplog.records if "page failed" in r.getMessage()]
        assert len(warned) == 5 and "attempt 1" in warned[0] and "queue unreachable" in warned[0]
        assert any("recovered after 5 failed attempt(s)" in r.getMessage() for r in caplog.records)
        assert (
            follower.result() == await ledger.store.last_position()
        )  # every event once, counted once
        # the sink got every row, then the tag (status finished: one session succeeded)
        assert sink.order == ["g1_0_0", "g1_1_0", "g1_2_0", "g1"]
        assert sink.inner.tag(ledger.run, "val", "g1")["status"] == "finished"
        assert await checkpoint(ledger) == await ledger.store.last_position()
        await log_is_whole(ledger)


async def test_follow_survives_a_hanging_sink_by_timing_it_out(db_url: str) -> None:
    sink = FlakySink(failures=2, hang=True)
    errors: list[tuple[Any, int, float]] = []
    async with Ledger.open(db_url, sinks=[sink]) as ledger:
        ledger.projector.sink_timeout = 0.1
        await record_group(ledger, "g2", size=2)
        await _follow_until_tag(ledger, sink, "g2", errors)
        assert [a for _, a, _ in errors] == [1, 2]
        assert all(
            isinstance(e, TimeoutError) and "sink_timeout=0.1" in str(e) and "FlakySink" in str(e)
            for e, _, _ in errors
        )
        assert sink.inner.tag(ledger.run, "val", "g2")["status"] == "finished"
        assert sink.order == ["g2_0_0", "g2_1_0", "g2"]
        # while a put hangs the page holds the write lock; once timed out, writers go on
        await record_group(ledger, "g3", size=1)
        await log_is_whole(ledger)


async def test_project_raises_on_a_failing_sink_and_moves_nothing(db_url: str) -> None:
    """`run()` (what `ledger.project()` uses) still raises: the caller decides; nothing moved."""
    sink = FlakySink(failures=1)
    async with Ledger.open(db_url, sinks=[sink]) as ledger:
        await record_group(ledger, "g4")
        with pytest.raises(ConnectionError, match="queue unreachable"):
            await ledger.project()
        assert await checkpoint(ledger) == 0 and sink.order == []
        assert await ledger.project() == await ledger.store.last_position()
        assert sink.order == ["g4_0_0", "g4_1_0", "g4"]
        await log_is_whole(ledger)


async def test_a_sinks_own_timeout_passes_unchanged(sqlite_url: str) -> None:
    """`sink_timeout` converts only its own expiry: a sink's own TimeoutError subclass reaches the caller as is."""

    class SinkTimeout(TimeoutError):
        pass

    class Impatient:
        async def put(self, items: Any) -> None:
            raise SinkTimeout("the queue's own deadline passed")

    async with Ledger.open(sqlite_url, sinks=[Impatient()]) as ledger:
        await record_group(ledger, "g5", size=1)
        with pytest.raises(SinkTimeout, match="own deadline"):
            await ledger.project()
        assert await checkpoint(ledger) == 0


async def test_follow_rejects_a_nonsense_backoff(sqlite_url: str) -> None:
    async with Ledger.open(sqlite_url) as ledger:
        with pytest.raises(ValueError, match="backoff"):
            await ledger.projector.follow(asyncio.Event(), backoff=1.0, max_backoff=0.5)


# ------------------------------------------------------------------------------ SQLite: locked
HOLDER = r"""
import select, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA busy_timeout=10000")
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
select.select([sys.stdin], [], [], float(sys.argv[2]))  # until told (release), or at most this long
conn.execute("COMMIT")
print("released", flush=True)
"""


@contextlib.contextmanager
def write_lock_held(path: Path, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """Another process holding SQLite's write lock (BEGIN IMMEDIATE) for `seconds` at most, or
    until `release(holder)` says to let go (a known point, where a test can choose one)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(seconds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        try:
            holder.wait(seconds + 15)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait(5)


def release(holder: subprocess.Popen[str]) -> None:
    """Tell `write_lock_held`'s process to let go, and return once it has."""
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "released"


async def test_sqlite_locked_by_another_writer_waits_and_then_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.db"
    caplog.set_level(logging.WARNING, logger="store.retry")

    def retried() -> bool:
        return any(
            "database is locked" in r.getMessage() and "retry" in r.getMessage()
            for r in caplog.records
        )

    # a busy timeout long enough that the retries outlast any delay in releasing the lock below
    async with Ledger.open(path, sqlite_busy_timeout=2.0) as ledger:
        handle = await ledger.create_session(
            "busy-0", uid="busy", session_index=0, group_size=1, **KW
        )
        with write_lock_held(path, 60) as holder:
            append = asyncio.ensure_future(
                handle.record_trajectory(prompt_ids=[1], response_ids=[2, 3])
            )
            while not retried():  # the append met the lock and is retrying: a known point
                assert not append.done(), append
                await asyncio.sleep(0.01)
            assert not append.done(), "the append committed while the lock was held"
            await asyncio.to_thread(release, holder)
            await asyncio.wait_for(append, 60)
        await handle.complete()
        await ledger.project()
        assert [s.version for s in await ledger.store.read_stream("busy-0")] == [1, 2, 3, 4]
        await log_is_whole(ledger)


async def test_sqlite_locked_beyond_the_retry_budget_fails_clearly_and_writes_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    async with Ledger.open(path, sqlite_busy_timeout=0.05) as ledger:
        handle = await ledger.create_session(
            "busy-1", uid="busy", session_index=0, group_size=1, **KW
        )
        with write_lock_held(path, 60) as holder:
            started = time.monotonic()
            with pytest.raises(StoreError) as caught:
                await handle.record_trajectory(prompt_ids=[1], response_ids=[2, 3])
            assert time.monotonic() - started < 2.0, (
                "the budget is a few busy timeouts, not however long the holder holds"
            )
            message = str(caught.value)
            assert "busy-1" in message and "database is locked" in message
            with pytest.raises(StoreError, match="database is locked"):
                await ledger.create_session(
                    "busy-2", uid="busy2", session_index=0, group_size=1, **KW
                )
            assert handle.version == 2 and handle.state == "running"
            release(holder)  # only now: the failures came while it was held
        # nothing of either append was written; the caller's retry after the holder let go succeeds
        assert [s.type for s in await ledger.store.read_stream("busy-1")] == [
            "SessionCreated",
            "SessionStarted",
        ]
        assert await ledger.store.read_stream("busy-2") == []
        await handle.record_trajectory(prompt_ids=[1], response_ids=[2, 3])
        await handle.complete()
        await ledger.project()
        await log_is_whole(ledger)


async def test_a_locked_database_fails_a_whole_group_commit_within_one_retry_budget(
    tmp_path: Path,
) -> None:
    """Many appends queued behind another process's lock fail together once the batch's retry
    budget is spent: redoing them one by one would make each wait out the lock again."""
    path = tmp_path / "ledger.db"
    async with Ledger.open(path, sqlite_busy_timeout=0.05) as ledger:
        handles = [
            await ledger.create_session(
                f"busy-{i}", uid=f"busy{i}", session_index=0, group_size=1, **KW
            )
            for i in range(20)
        ]
        with write_lock_held(path, 60) as holder:
            started = time.monotonic()
            results = await asyncio.gather(
                *(h.record_trajectory(prompt_ids=[1], response_ids=[2, 3]) for h in handles),
                return_exceptions=True,
            )
            waited = time.monotonic() - started
            assert all(
                isinstance(r, StoreError) and "database is locked" in str(r) for r in results
            ), results
            assert waited < 2.0, (
                f"20 appends took {waited:.1f}s to fail: each paid its own retry budget"
            )
            release(holder)  # only now: the failures came while it was held
        assert all(h.version == 2 for h in handles)
        for h in handles:  # nothing was written; the callers' retries succeed
            await h.record_trajectory(prompt_ids=[1], response_ids=[2, 3])
        await ledger.project()
        await log_is_whole(ledger)


def test_sqlite_busy_timeout_is_validated() -> None:
    from store import create_engine

    for bad in (-1, "5", True):
        with pytest.raises(ValueError, match="sqlite_busy_timeout"):
            create_engine("sqlite+aiosqlite://", sqlite_busy_timeout=bad)
    with pytest.raises(ValueError, match="SQLite databases only"):
        create_engine("postgresql+asyncpg://u@h/db", sqlite_busy_timeout=1)


# ------------------------------------------------------------------------------ tmpfs mounts
@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `path` (root and mount permission needed, else the test skips)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True, capture_output=True)


async def _record_some(url: str) -> int:
    async with Ledger.open(url) as ledger:
        await record_group(ledger, "ro", size=2)
        await ledger.project()
        return await ledger.store.last_position()


async def _read_only_checks(url: str, last: int) -> None:
    async with Ledger.open(url) as ledger:
        batch = await ledger.batch("val", 0, timeout=5)  # reading works
        assert batch.batch_size[0] == 2
        with pytest.raises(StoreError, match="readonly database") as caught:
            await ledger.create_session("ro-new", uid="ronew", session_index=0, group_size=1, **KW)
        assert "ro-new" in str(caught.value)
        assert await ledger.store.last_position() == last  # nothing written
        assert (await audit(ledger.engine)).ok


async def test_sqlite_opened_read_only_reads_and_refuses_writes_clearly(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    last = await _record_some(f"sqlite+aiosqlite:///{path}")
    await _read_only_checks(f"sqlite+aiosqlite:///file:{path}?mode=ro&uri=true", last)
    async with Ledger.open(path) as ledger:  # the file itself is untouched and still writable
        assert await ledger.store.last_position() == last
        await record_group(ledger, "after", size=1)


async def test_sqlite_on_a_read_only_filesystem(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        path = mnt / "ledger.db"
        last = await _record_some(f"sqlite+aiosqlite:///{path}")
        remount(mnt, "ro")
        try:
            with pytest.raises(StoreError) as caught:
                async with Ledger.open(path):
                    pass
            message = str(caught.value)
            assert "read-only" in message and str(path) in message and "immutable=1" in message
            await _read_only_checks(f"sqlite+aiosqlite:///file:{path}?immutable=1&uri=true", last)
        finally:
            remount(mnt, "rw")


# ------------------------------------------------------------------------------ full disk
async def _full_disk_checks(ledger: Ledger, free_space: Any) -> None:
    """Append until the disk is full; check the error and the log; free space; go on."""
    handle = await ledger.create_session("full-0", uid="full", session_index=0, group_size=1, **KW)
    payload = list(range(1, 2049))
    with pytest.raises(StoreError) as caught:
        for _ in range(10_000):
            await handle.record_trajectory(prompt_ids=[1], response_ids=payload)
    message = str(caught.value)
    assert "database or disk is full" in message and "full-0" in message
    version = handle.version
    assert (
        len(await ledger.store.read_stream("full-0")) == version
    )  # the failed append left nothing
    # inside session(): the failure to record the end is noted on the original error
    with pytest.raises(StoreError) as inner:
        async with ledger.session("full-1", uid="full1", session_index=0, group_size=1, **KW) as s:
            await s.record_trajectory(prompt_ids=[1], response_ids=payload)
    notes = getattr(inner.value, "__notes__", [])
    assert "database or disk is full" in str(inner.value)
    free_space()
    # nothing half-written; the same handle goes on where it stopped
    facts = cw.check_streams(await cw.log_streams(ledger.engine))
    await handle.record_trajectory(prompt_ids=[1], response_ids=[7, 8])
    assert handle.version == version + 1
    await handle.post_reward(1.0)
    await handle.complete()
    open_ids = facts["open"]
    if "full-1" in open_ids:  # its end could not be recorded: the sweep fails it
        assert any("could not record the session's end" in n for n in notes)
        assert await recover(ledger, timedelta(0)) == ["full-1"]
    await ledger.project()
    await log_is_whole(ledger)
    full1_exists = "full-1" in await cw.log_streams(
        ledger.engine
    )  # its creation may itself have hit the full disk
    assert (await ledger.batch("val", 0, timeout=5)).batch_size[0] == len(
        handle.view.trajectories
    ) + full1_exists


async def test_sqlite_on_a_full_filesystem(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        path = mnt / "ledger.db"
        async with Ledger.open(path) as ledger:
            stat = os.statvfs(mnt)
            filler = mnt / "filler"
            with open(filler, "wb") as out:  # leave ~96 KiB free
                out.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - 96 * 1024))
            await _full_disk_checks(ledger, filler.unlink)


async def test_full_disk_simulated_on_either_backend(db_url: str) -> None:
    """The same checks without a mount: the driver reports the disk full on event inserts."""
    async with Ledger.open(db_url) as ledger:
        state = {"inserts": 0, "full": True}
        appends = (
            ledger.store.append_engine
        )  # on a SQLite file, the append writer thread's own engine
        dbapi = appends.dialect.dbapi

        @event.listens_for(appends, "before_cursor_execute")
        def disk_full(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            if state["full"] and statement.lstrip().upper().startswith("INSERT INTO EVENTS"):
                state["inserts"] += 1
                if state["inserts"] > 3:
                    raise dbapi.OperationalError("database or disk is full")

        await _full_disk_checks(ledger, lambda: state.update(full=False))
