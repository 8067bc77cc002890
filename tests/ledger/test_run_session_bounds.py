"""Bounded waits at the boundary (issue: input boundary, item 5): a timeout the caller set is kept
even when the database is locked, a handle used on the wrong event loop says so instead of
hanging, and opening a ledger survives a connection dropped mid-open."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

import sessions.ledger.ledger as ledger_module
from sessions import Ledger, LedgerError
from tests.store.test_faults import write_lock_held

KW: dict[str, Any] = {"session_index": 0, "group_size": 1, "partition": "val", "global_step": 0}


async def test_run_session_returns_within_its_timeout_and_recording_budget_while_the_database_is_locked(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    timeout, recording = 0.5, 1.0

    async def runner(handle: Any) -> None:
        await asyncio.sleep(30)  # a hung tool call: only the timeout ends it

    async with Ledger.open(path) as ledger:
        await ledger.create_session("warm", uid="warm", **KW)  # the file exists and is migrated
        with write_lock_held(path, 6.0):
            started = time.monotonic()
            outcome = await ledger.run_session(
                runner, "slow", uid="slow", timeout=timeout, recording_timeout=recording, **KW
            )
            took = time.monotonic() - started
            # the creation itself waited on the lock too: all of it fits timeout + recording (+ slack)
            assert took < timeout + recording + 0.5, took
            assert outcome.state == "recording" and outcome.failure_reason == "timeout"
            assert isinstance(outcome.error, TimeoutError) and "recording_timeout" in str(
                outcome.error
            )
        # once the lock is gone the recording lands: close() waits for it
    async with Ledger.open(path) as ledger:
        handle = await ledger.load_session("slow")
        assert (handle.state, handle.view.failure_reason) == ("failed", "timeout")


async def test_run_session_without_a_locked_database_reports_the_recorded_outcome(
    tmp_path: Path,
) -> None:
    async def runner(handle: Any) -> None:
        await asyncio.sleep(30)

    async with Ledger.open(tmp_path / "ledger.db") as ledger:
        started = time.monotonic()
        outcome = await ledger.run_session(
            runner, "quick", uid="quick", timeout=0.2, recording_timeout=5.0, **KW
        )
        assert time.monotonic() - started < 2.0
        assert (outcome.state, outcome.failure_reason) == ("failed", "timeout")


def test_a_handle_used_on_another_event_loop_raises_instead_of_hanging(tmp_path: Path) -> None:
    made: dict[str, Any] = {}

    async def make() -> None:
        ledger_cm = Ledger.open(tmp_path / "ledger.db")
        made["ledger"] = await ledger_cm.__aenter__()
        made["handle"] = await made["ledger"].create_session("loop-1", uid="loop", **KW)

    asyncio.run(make())  # that loop is closed now

    async def use() -> None:
        with pytest.raises(LedgerError, match="another event loop"):
            await asyncio.wait_for(
                made["handle"].record_trajectory(prompt_ids=[1], response_ids=[2]), 5
            )

    result: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run_into(use(), result))
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the handle hung on the new loop"
    assert not result, result
    with warnings.catch_warnings():  # the first loop's pooled connection dies with it, unreturned
        warnings.simplefilter("ignore")
        made.clear()
        gc.collect()


def _run_into(coro: Any, errors: list[BaseException]) -> None:
    try:
        asyncio.run(coro)
    except BaseException as error:  # noqa: BLE001 - reported to the test thread
        errors.append(error)


async def test_opening_survives_a_connection_dropped_while_migrating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ledger_module.upgrade
    calls: list[int] = []

    async def flaky(engine: Any, **options: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError(
                "SELECT 1",
                {},
                ConnectionError("terminating connection due to administrator command"),
            )
        await real(engine, **options)

    monkeypatch.setattr(ledger_module, "upgrade", flaky)
    async with Ledger.open(tmp_path / "ledger.db") as ledger:
        await ledger.create_session("opened", uid="opened", **KW)
    assert len(calls) == 2


async def test_a_ledger_used_from_another_running_loop_refuses_every_call_and_keeps_serving_its_own(
    db_url: str,
) -> None:
    """The ledger's reads and writes from a foreign loop (another thread's asyncio.run) raise one
    clear error; without the check a PostgreSQL read fails with "attached to a different loop"
    and leaves connections bound to the foreign loop in the owner's pool."""
    async with Ledger.open(db_url) as ledger:
        async with ledger.session("own-1", uid="own", **KW) as s:
            await s.record_trajectory(prompt_ids=[1], response_ids=[2])
            await s.post_reward(1.0)
        calls = {
            "project": lambda: ledger.project(),
            "metrics": lambda: ledger.metrics("val", 0),
            "batch": lambda: ledger.batch("val", 0, timeout=1),
            "metrics_dict": lambda: ledger.metrics_dict("val", 0, timeout=1),
            "load_session": lambda: ledger.load_session("own-1"),
            "create_session": lambda: ledger.create_session("own-2", uid="own2", **KW),
        }
        refused: dict[str, str] = {}

        async def foreign() -> None:
            for name, call in calls.items():
                try:
                    await asyncio.wait_for(call(), 5)
                except LedgerError as error:
                    refused[name] = str(error)

        errors: list[BaseException] = []
        thread = threading.Thread(target=lambda: _run_into(foreign(), errors))
        thread.start()
        await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive() and not errors, errors
        assert set(refused) == set(calls), refused
        assert all(
            "another event loop" in message and "SyncLedger" in message
            for message in refused.values()
        )
        # the owner loop is unharmed: its pool holds no connection of the foreign loop
        rows = {r.metric: r.value for r in await ledger.metrics("val", 0) if r.data_source is None}
        assert rows["sessions/succeeded"] == 1.0
        assert (await ledger.load_session("own-1")).state == "succeeded"
