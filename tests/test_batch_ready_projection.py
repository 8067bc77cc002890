"""Issue 18, batch ready when the step ends: a projector holds the rows its last page left.

The held rows must change nothing a projector writes (the same read models, queue and metrics as
a projector that reads every page's rows back), must be dropped whenever they may be stale
(another projector's page, a page rolled back after the rules changed them in memory), and must
spare the settling page of a step its reads. Callers of one projector take turns in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sessions.projection.projector as projector_module
from sessions import Ledger
from sessions.projection.projector import Projector
from store import create_engine
from store import read_models as rm
from tests.test_projector import ENDS, play, random_scenario, snapshot

READS = ("load_sessions", "load_groups", "load_metrics", "trajectory_events")


async def _record(path: Path, seed: int, groups: int = 6) -> None:
    scenario = random_scenario(random.Random(seed), min_groups=groups, max_groups=groups, ends=ENDS)
    async with Ledger.open(f"sqlite+aiosqlite:///{path}", trajectory_selection=scenario.default_selection) as ledger:
        await play(ledger, scenario, project_between=False)


async def _project(path: Path, page_size: int, make: Callable[[Any, int], list[Projector]]) -> dict[str, Any]:
    """Project the log at `path` page by page, round robin over the projectors `make` returns."""
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    try:
        projectors = make(engine, page_size)
        turn = 0
        while (await projectors[turn % len(projectors)].step()).events:
            turn += 1
        return await snapshot(engine)
    finally:
        await engine.dispose()


def _one(engine: Any, page_size: int) -> list[Projector]:
    return [Projector(engine, page_size=page_size)]


def _two(engine: Any, page_size: int) -> list[Projector]:
    return [Projector(engine, page_size=page_size), Projector(engine, page_size=page_size)]


class _Fresh:
    """A new projector for every page: nothing held, every row read back (the reference)."""

    def __init__(self, engine: Any, page_size: int) -> None:
        self.engine, self.page_size = engine, page_size

    async def step(self) -> Any:
        return await Projector(self.engine, page_size=self.page_size).step()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), page_size=st.integers(1, 9))
def test_held_rows_project_what_reading_every_page_back_projects(tmp_path: Path, seed: int, page_size: int) -> None:
    folder = tmp_path / f"{seed}-{page_size}"
    folder.mkdir()
    log = folder / "log.db"
    asyncio.run(_record(log, seed))
    results = {}
    for name, make in (("fresh", lambda e, p: [_Fresh(e, p)]), ("held", _one), ("alternating", _two)):
        copy = folder / f"{name}.db"
        shutil.copyfile(log, copy)
        results[name] = asyncio.run(_project(copy, page_size, make))
    assert results["held"] == results["fresh"]
    assert results["alternating"] == results["fresh"]


@contextlib.contextmanager
def _counting(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Count the read-model reads of a page, by function."""
    calls: Counter[str] = Counter()
    for name in READS:
        real = getattr(rm, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(rm, name, counted)
    yield calls


async def _open_step(ledger: Ledger, sessions: int) -> list[Any]:
    handles = []
    for i in range(sessions):
        handle = await ledger.create_session(f"s{i}", uid=f"u{i // 4}", session_index=i % 4, group_size=4,
                                             partition="train", global_step=0)
        await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4, 5], response_mask=[1, 1, 0], num_turns=1)
        await handle.post_reward(float(i % 2))
        handles.append(handle)
    return handles


async def test_the_settling_page_reads_nothing_back(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows a step's last page touches are all held: no session, group, metric or trajectory
    read — while a projector that holds nothing reads them all."""
    async with Ledger.open(sqlite_url) as ledger:
        handles = await _open_step(ledger, 12)
        await ledger.project()
        for handle in handles:
            await handle.complete()
        with _counting(monkeypatch) as calls:
            assert await ledger.project() == 12
        assert calls == Counter(), calls
        fresh = Projector(ledger.engine)
        await fresh.step()  # the log's end: its first page reads nothing either
        batch = await ledger.batch("train", 0, timeout=5)
        assert batch.batch_size[0] == 12


async def test_a_projector_that_held_nothing_reads_the_rows(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counterpart: the same settling page on a new projector reads every kind of row."""
    async with Ledger.open(sqlite_url) as ledger:
        handles = await _open_step(ledger, 8)
        await ledger.project()
        for handle in handles:
            await handle.complete()
        with _counting(monkeypatch) as calls:
            assert await Projector(ledger.engine).run() == 8
        assert set(calls) == set(READS), calls


async def test_a_page_rolled_back_after_its_rules_ran_drops_the_held_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules change held rows in memory; a page that then fails must not leave them held, or
    its retry would count every event of the page twice."""
    log = tmp_path / "log.db"
    await _record(log, seed=7, groups=8)
    shutil.copyfile(log, tmp_path / "reference.db")
    expected = await _project(tmp_path / "reference.db", 5, _one)

    real = rm.insert_queue_rows
    failures = iter([True, False, True])

    async def flaky(conn: Any, rows: list[dict[str, Any]]) -> None:
        await real(conn, rows)
        if rows and next(failures, False):
            raise RuntimeError("injected: the page fails after its rules ran and its rows were written")

    monkeypatch.setattr(rm, "insert_queue_rows", flaky)
    engine = create_engine(f"sqlite+aiosqlite:///{log}")
    try:
        projector = Projector(engine, page_size=5)  # the same instance retries, as a follower does
        raised = 0
        while True:
            try:
                if not (await projector.step()).events:
                    break
            except RuntimeError:
                raised += 1
        assert raised == 2
        assert await snapshot(engine) == expected
    finally:
        await engine.dispose()


async def test_callers_of_one_projector_take_turns_in_process(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower and `ledger.batch` project through one projector: their pages never overlap
    (the second waits on the projector's own lock, not the database's), and every event is
    projected once."""
    inside = 0
    most = 0
    real = projector_module.projection_page

    @contextlib.asynccontextmanager
    async def watched(engine: Any) -> AsyncIterator[Any]:
        nonlocal inside, most
        inside += 1  # counted from before the database's lock: waiting for it is what must not happen
        most = max(most, inside)
        try:
            async with real(engine) as conn:
                await asyncio.sleep(0.01)  # a page long enough for the other caller to arrive
                yield conn
        finally:
            inside -= 1

    async with Ledger.open(sqlite_url) as ledger:
        handles = await _open_step(ledger, 8)
        for handle in handles:
            await handle.complete()
        ledger.projector.page_size = 7
        monkeypatch.setattr(projector_module, "projection_page", watched)
        counts = await asyncio.gather(*(ledger.projector.run() for _ in range(3)))
        async with ledger.engine.connect() as conn:
            end = await rm.log_end(conn)
            assert await rm.get_checkpoint(conn) == end
        assert most == 1
        assert sum(counts) == end
