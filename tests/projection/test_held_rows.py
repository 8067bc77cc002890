"""Batch ready when the step ends: a projector holds the rows its last page left.

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

import sessions.projection.held as held_module
import sessions.projection.projector as projector_module
from sessions import Ledger
from sessions.projection.projector import Projector
from store import create_engine
from store import read_models as rm
from tests.projection.test_projector import ENDS, play, random_scenario, snapshot

READS = ("load_sessions", "load_groups", "load_metrics", "trajectory_events")


async def _record(path: Path, seed: int, groups: int = 6) -> None:
    scenario = random_scenario(random.Random(seed), min_groups=groups, max_groups=groups, ends=ENDS)
    async with Ledger.open(
        f"sqlite+aiosqlite:///{path}", trajectory_selection=scenario.default_selection
    ) as ledger:
        await play(ledger, scenario, project_between=False)


async def _project(
    path: Path, page_size: int, make: Callable[[Any, int], list[Projector]]
) -> dict[str, Any]:
    """Project the log at `path` page by page, round robin over the projectors `make` returns."""
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    try:
        projectors = make(engine, page_size)
        turn = 0
        while (await projectors[turn % len(projectors)].step()).events:
            turn += 1
        async with engine.connect() as conn:
            ids = sorted(q["id"] for q in await _all_queue(conn))
        assert ids == list(
            range(1, len(ids) + 1)
        )  # numbered as a replay numbers them (snapshot drops ids)
        return await snapshot(engine)
    finally:
        await engine.dispose()


async def _log_and_reference(
    tmp_path: Path, seed: int, page_size: int
) -> tuple[Path, dict[str, Any]]:
    """A recorded log, and what one projector makes of a copy of it."""
    log = tmp_path / "log.db"
    await _record(log, seed=seed, groups=8)
    shutil.copyfile(log, tmp_path / "reference.db")
    return log, await _project(tmp_path / "reference.db", page_size, _one)


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


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**16), page_size=st.integers(1, 9))
def test_held_rows_project_what_reading_every_page_back_projects(
    tmp_path: Path, seed: int, page_size: int
) -> None:
    folder = tmp_path / f"{seed}-{page_size}"
    folder.mkdir()
    log = folder / "log.db"
    asyncio.run(_record(log, seed))
    results = {}
    for name, make in (
        ("fresh", lambda e, p: [_Fresh(e, p)]),
        ("held", _one),
        ("alternating", _two),
    ):
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
        handle = await ledger.create_session(
            f"s{i}",
            uid=f"u{i // 4}",
            session_index=i % 4,
            group_size=4,
            partition="train",
            global_step=0,
        )
        await handle.record_trajectory(
            prompt_ids=[1, 2], response_ids=[3, 4, 5], response_mask=[1, 1, 0], num_turns=1
        )
        await handle.post_reward(float(i % 2))
        handles.append(handle)
    return handles


async def _settle_step(
    ledger: Ledger, sessions: int, projector: Projector, monkeypatch: pytest.MonkeyPatch
) -> Counter[str]:
    """A step recorded and projected up to its ends; then its ends, projected by `projector`:
    the reads that last page made."""
    handles = await _open_step(ledger, sessions)
    await ledger.project()
    for handle in handles:
        await handle.complete()
    with _counting(monkeypatch) as calls:
        assert await projector.run() == sessions
    return calls


async def test_the_settling_page_reads_nothing_back(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows a step's last page touches are all held: no session, group, metric or trajectory
    read — while a projector that holds nothing reads them all."""
    async with Ledger.open(sqlite_url) as ledger:
        calls = await _settle_step(ledger, 12, ledger.projector, monkeypatch)
        assert calls == Counter(), calls
        fresh = Projector(ledger.engine)
        await fresh.step()  # the log's end: its first page reads nothing either
        batch = await ledger.batch("train", 0, timeout=5)
        assert batch.batch_size[0] == 12


async def test_a_projector_that_held_nothing_reads_the_rows(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counterpart: the same settling page on a new projector reads every kind of row."""
    async with Ledger.open(sqlite_url) as ledger:
        calls = await _settle_step(ledger, 8, Projector(ledger.engine), monkeypatch)
        assert set(calls) == set(READS), calls


async def test_a_page_rolled_back_after_its_rules_ran_drops_the_held_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rules change held rows in memory; a page that then fails must not leave them held, or
    its retry would count every event of the page twice."""
    log, expected = await _log_and_reference(tmp_path, seed=7, page_size=5)

    real = rm.insert_queue_rows
    failures = iter([True, False, True])

    async def flaky(conn: Any, rows: list[dict[str, Any]]) -> None:
        await real(conn, rows)
        if rows and next(failures, False):
            raise RuntimeError(
                "injected: the page fails after its rules ran and its rows were written"
            )

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


async def test_callers_of_one_projector_take_turns_in_process(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower and `ledger.batch` project through one projector: their pages never overlap
    (the second waits on the projector's own lock, not the database's), and every event is
    projected once."""
    inside = 0
    most = 0
    real = projector_module.projection_page

    @contextlib.asynccontextmanager
    async def watched(engine: Any) -> AsyncIterator[Any]:
        nonlocal inside, most
        inside += (
            1  # counted from before the database's lock: waiting for it is what must not happen
        )
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


# ------------------------------------------------------------------------------------------
# the batch rows a projector holds
# ------------------------------------------------------------------------------------------


def _steps_of(queue: list[dict[str, Any]]) -> set[tuple[Any, ...]]:
    return {(q["run"], q["partition"], q["global_step"]) for q in queue if q["kind"] == "row"}


def _same_rows(held: list[Any], read: list[Any]) -> None:
    assert len(held) == len(read)
    for a, b in zip(held, read):
        assert dict(a.meta) == dict(b.meta)
        assert (a.reward, a.is_placeholder) == (b.reward, b.is_placeholder)
        for name in ("prompt_ids", "response_ids", "response_mask", "logprobs"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert x.dtype == y.dtype and x.tolist() == y.tolist(), name


async def _held_against_read(path: Path, page_size: int) -> tuple[int, int]:
    """Project page by page; every step the projector holds must materialise exactly as its queue
    rows and source events read back do. Returns (steps held, steps with rows)."""
    from sessions.batches.rows import materialise

    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    try:
        projector = Projector(engine, page_size=page_size)
        while (await projector.step()).events:
            pass
        async with engine.connect() as conn:
            steps = _steps_of(await _all_queue(conn))
            held_count = 0
            for run, partition, step in sorted(steps, key=repr):
                held = projector.held_step(run, partition, step)
                if held is None:
                    continue
                held_count += 1
                queue = await rm.queue_rows_for(conn, run, partition, step)
                sources = await rm.source_events(conn, [q["source_position"] for q in queue])
                assert [q["id"] for q in held[0]] == [q["id"] for q in queue]
                assert held[0] == queue
                _same_rows(materialise(*held), materialise(queue, sources))
        return held_count, len(steps)
    finally:
        await engine.dispose()


async def _all_queue(conn: Any) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from store.schema.tables import queue_rows

    return [dict(r) for r in (await conn.execute(select(queue_rows))).mappings()]


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**16), page_size=st.integers(1, 40))
def test_held_batch_rows_are_the_rows_read_back(tmp_path: Path, seed: int, page_size: int) -> None:
    log = tmp_path / f"{seed}-{page_size}.db"
    asyncio.run(_record(log, seed, groups=8))
    held, steps = asyncio.run(_held_against_read(log, page_size))
    assert held == steps  # one projector from the log's start: it made every row of every step


async def test_a_step_is_held_from_its_first_session_and_given_to_batch(tmp_path: Path) -> None:
    """A follower that projected a step from its first session holds every row of it; one that
    came in when the step had begun holds none (its earlier rows were made elsewhere)."""
    path = tmp_path / "steps.db"
    async with Ledger.open(f"sqlite+aiosqlite:///{path}") as ledger:
        handles = await _open_step(ledger, 8)
        await ledger.project()  # this projector saw the step's first sessions
        late = Projector(ledger.engine)  # has seen nothing of it
        for handle in handles:
            await handle.complete()
        await late.run()
        assert late.held_step(ledger.run, "train", 0) is None
        await ledger.project()  # another projector moved the checkpoint: the held rows are dropped
        assert ledger.projector.held_step(ledger.run, "train", 0) is None
    assert await _held_against_read(tmp_path / "steps.db", 3) == (
        0,
        1,
    )  # projected already: nothing held


async def test_the_held_steps_are_bounded(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(held_module, "MAX_HELD_STEPS", 2)
    async with Ledger.open(sqlite_url) as ledger:
        for step in range(4):
            handle = await ledger.create_session(
                f"s{step}",
                uid=f"u{step}",
                session_index=0,
                group_size=1,
                partition="val",
                global_step=step,
            )
            await handle.record_trajectory(
                prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1], num_turns=1
            )
            await handle.complete()
            await ledger.project()
        held = [ledger.projector.held_step(ledger.run, "val", step) for step in range(4)]
        assert [h is not None for h in held] == [False, False, True, True]
        queue, sources = held[3]  # type: ignore[misc]
        assert [q["key"] for q in queue] == ["u3_0_0"] and sources[queue[0]["source_position"]][
            3
        ] is not None


@pytest.mark.parametrize("limit", ["off", "bytes"])
async def test_a_follower_holds_no_batch_rows_when_told_not_to_or_past_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str
) -> None:
    """A follower nobody asks for batches holds no payloads; past `MAX_HELD_BYTES` of open
    sessions' payloads it lets them go. Either way it projects the same rows as one that holds."""
    log, expected = await _log_and_reference(tmp_path, seed=11, page_size=4)
    if limit == "bytes":
        monkeypatch.setattr(held_module, "MAX_HELD_BYTES", 8)
    engine = create_engine(f"sqlite+aiosqlite:///{log}")
    try:
        projector = Projector(engine, page_size=4, hold_batches=limit == "bytes")
        while (await projector.step()).events:
            pass
        async with engine.connect() as conn:
            steps = _steps_of(await _all_queue(conn))
        assert steps and all(projector.held_step(*step) is None for step in steps)
        assert await snapshot(engine) == expected
    finally:
        await engine.dispose()
