"""Replay, audit and history (docs/design.md §9, §11): golden logs, tampering, replay equality, time travel.

Golden logs (tests/fixtures/golden_v*.jsonl) are loaded verbatim; their projections must equal the
expectation files written by tests/fixtures/make_golden.py. Every single tampering of a projected
database must fail the audit with a first divergence that names it. Replaying a demo log into an
empty database (same backend or across) must reproduce every table and batch byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from sessions import Ledger
from sessions.audit.auditing import Divergence, audit, compare
from sessions.audit.replay import replay
from sessions.batches import to_plain_dict
from sessions.cli.demo import DemoConfig, run_demo
from sessions.projection.projector import Projector
from store import create_engine
from store.log.records import StoredEvent
from store.schema.migrate import upgrade
from store.schema.tables import (
    READ_MODELS,
    checkpoints,
    events,
    groups,
    metric_counts,
    projection_errors,
    queue_rows,
    sessions,
)
from tests import golden
from tests.conftest import BACKENDS, backend_of, fresh_database, wipe

GOLDEN_V2 = golden.FIXTURES / "golden_v2.jsonl"
DEMO = DemoConfig(steps=1, prompts=6, group_size=3, fail_rate=0.3, cancel_rate=0.1, seed=11)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The installed console script in a subprocess: exit status and streams as a user sees them."""
    script = Path(sys.executable).with_name("rollout-ledger")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "sessions.cli.main"]
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    return subprocess.run(
        [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`rollout-ledger ARGS` in this process (what the console script calls): (status, out, err).

    Sync tests only: the CLI runs its own event loop.
    """
    from sessions.cli.main import main

    capsys.readouterr()
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def sqlite_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two SQLite databases shared by this module's tests, wiped before each use."""
    folder = tmp_path_factory.mktemp("pool")
    with (
        fresh_database("sqlite", folder, "first") as first,
        fresh_database("sqlite", folder, "second") as second,
    ):
        yield [first, second]


@pytest.fixture(scope="module")
def postgres_pool() -> Iterator[list[str]]:
    """Two PostgreSQL databases shared by this module's tests, wiped before each use (far cheaper
    than CREATE DATABASE per test)."""
    with fresh_database("postgres") as first, fresh_database("postgres") as second:
        yield [first, second]


def _fresh(request: pytest.FixtureRequest, backend: str, index: int) -> str:
    """One of the module's two databases on `backend`, migrated and empty."""
    url = request.getfixturevalue(f"{backend}_pool")[index]
    asyncio.run(wipe(url))
    return url


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest) -> str:
    """An empty database on each backend (or on the backend an indirect parameter names)."""
    return _fresh(request, request.param, 0)


@pytest.fixture
def replica_url(request: pytest.FixtureRequest, backend_url: str) -> str:
    """A second empty database on the same backend as `backend_url`."""
    return _fresh(request, backend_of(backend_url), 1)


async def _projected_golden(url: str, log: Path) -> AsyncEngine:
    engine = create_engine(url)
    await golden.load_golden(engine, log)
    await Projector(engine).run()
    return engine


# ------------------------------------------------------------------ golden logs
@pytest.mark.parametrize("log", golden.golden_logs(), ids=lambda p: p.stem)
async def test_golden_log_projects_to_its_expectation_replays_and_audits_clean(
    log: Path, backend_url: str, replica_url: str
) -> None:
    expected = json.loads(golden.expectation_path(log).read_text(encoding="utf-8"))
    assert expected.pop("log") == log.name
    engine = await _projected_golden(backend_url, log)
    replica = create_engine(replica_url)
    try:
        assert await golden.projection_summary(engine) == expected
        report = await audit(engine)
        assert report.ok, report.divergences[:3]
        sessions = {
            row["session_id"]
            for row in golden.read_rows(log)
            if not row["session_id"].startswith("@run:")
        }
        assert (report.events, report.sessions) == (len(golden.read_rows(log)), len(sessions))
        assert len(sessions) >= 12
        await upgrade(replica)
        result = await replay(engine, replica)
        assert result.events == report.events
        assert await compare(replica, engine) == []
        assert await golden.projection_summary(replica) == expected
        assert (await audit(replica)).ok
    finally:
        await engine.dispose()
        await replica.dispose()


def test_golden_expectations_agree_across_schema_versions() -> None:
    """The v1 and v2 logs are one scenario: the schema bump must not move any projection. (v3 adds
    sessions and the run's configuration event, so it is its own scenario: see the next test.)"""
    summaries = [
        json.loads(golden.expectation_path(log).read_text(encoding="utf-8"))
        for log in golden.golden_logs()[:2]
    ]
    assert len(summaries) == 2
    for summary in summaries:
        summary.pop("log")
    assert all(s == summaries[0] for s in summaries[1:])
    first = summaries[0]
    assert first["group_tags"] == {
        "t0-a": "finished",
        "t0-b": "failure",
        "v0-a": "finished",
        "v0-b": "finished",
        "t1-a": "finished",
        "v1-a": "finished",
    }
    assert {(q["partition"], q["global_step"]) for q in first["queue"]} == {
        ("train", 0),
        ("val", 0),
        ("train", 1),
        ("val", 1),
    }
    assert {scope.split("/")[3] for scope in first["metrics"]} == {"*", "gsm8k", "swe"}


def test_the_v3_golden_log_keeps_the_old_scenario_and_adds_retries_and_partial_work() -> None:
    """v3 = the v1/v2 scenario (after the run's RunConfigured) plus a retried session and a timeout
    that kept its graded work: the old groups settle as before; the retried session's row is its
    second trajectory (the first is superseded); the partial row carries its own reward."""
    v2 = json.loads(golden.expectation_path(GOLDEN_V2).read_text(encoding="utf-8"))
    v3 = json.loads((golden.FIXTURES / "golden_v3.expected.json").read_text(encoding="utf-8"))
    assert v3["group_tags"] == {**v2["group_tags"], "v1-b": "finished"}
    rows = {q["session_id"]: q for q in v3["queue"] if q["kind"] == "row"}
    assert rows["v1-b-s0"]["key"] == "v1-b_0_1" and rows["v1-b-s0"]["reward"] == 1.0
    assert (
        rows["v1-b-s1"]["key"] == "v1-b_1_0"
        and rows["v1-b-s1"]["reward"] == 0.5
        and not rows["v1-b-s1"]["is_placeholder"]
    )
    events = {
        (s.session_id, s.version): s
        for s in golden.stored_events(golden.FIXTURES / "golden_v3.jsonl")
    }
    assert (
        events[("v1-b-s0", 4)].type == "AttemptFailed"
        and rows["v1-b-s0"]["source_position"] > events[("v1-b-s0", 4)].position
    )
    assert events[("@run:golden", 1)].type == "RunConfigured"


# ------------------------------------------------------------------ tampering
def _event(session_id: str, type_: str) -> StoredEvent:
    return next(
        s for s in golden.stored_events(GOLDEN_V2) if s.session_id == session_id and s.type == type_
    )


@dataclass(frozen=True)
class Expect:
    table: str
    where: str  # the divergence's key or session
    field: str
    expected: Any
    found: Any
    position: int | None = None

    def check(self, first: Divergence) -> None:
        assert (first.table, first.field) == (self.table, self.field), str(first)
        assert self.where in (first.key, first.session_id), str(first)
        if callable(self.found):
            assert first.expected == self.expected and self.found(first.found), str(first)
        else:
            assert (first.expected, first.found) == (self.expected, self.found), str(first)
        if self.position is not None:
            assert first.position == self.position, str(first)


Tamper = Callable[[AsyncConnection], Awaitable[Expect]]


async def change_session_reward(conn: AsyncConnection) -> Expect:
    await conn.execute(
        update(sessions).where(sessions.c.session_id == "t0-a-s0").values(reward=0.75)
    )
    return Expect("sessions", "t0-a-s0", "reward", 1.0, 0.75)


async def change_metric_count(conn: AsyncConnection) -> Expect:
    await conn.execute(
        update(metric_counts)
        .where(
            metric_counts.c.partition == "val",
            metric_counts.c.global_step == 0,
            metric_counts.c.data_source.is_(None),
            metric_counts.c.metric == "sessions/failed",
        )
        .values(value=metric_counts.c.value + 1)
    )
    return Expect("metric_counts", "golden/val/0/∅/sessions/failed", "value", 2.0, 3.0)


async def change_queue_reward(conn: AsyncConnection) -> Expect:
    await conn.execute(update(queue_rows).where(queue_rows.c.key == "t0-a_0_0").values(reward=0.5))
    return Expect("queue_rows", "golden/train/0/t0-a_0_0", "reward", 1.0, 0.5)


async def repoint_queue_row(conn: AsyncConnection) -> Expect:
    """A row pointing at another trajectory's tokens: the field, then the content hash, diverge."""
    own = _event("t0-a-s0", "TrajectoryRecorded").position
    other = _event("t0-a-s1", "TrajectoryRecorded").position
    await conn.execute(
        update(queue_rows).where(queue_rows.c.key == "t0-a_0_0").values(source_position=other)
    )
    return Expect("queue_rows", "golden/train/0/t0-a_0_0", "source_position", own, other)


async def delete_event(conn: AsyncConnection) -> Expect:
    reward = _event("t0-a-s0", "RewardPosted")
    succeeded = _event("t0-a-s0", "SessionSucceeded")
    await conn.execute(delete(events).where(events.c.position == reward.position))
    return Expect(
        "events", "t0-a-s0", "version", reward.version, succeeded.version, succeeded.position
    )


async def swap_versions(conn: AsyncConnection) -> Expect:
    started = _event("t0-a-s1", "SessionStarted")
    trajectory = _event("t0-a-s1", "TrajectoryRecorded")
    for position, version in (
        (started.position, -1),
        (trajectory.position, started.version),
        (started.position, trajectory.version),
    ):
        await conn.execute(
            update(events).where(events.c.position == position).values(version=version)
        )
    return Expect(
        "events", "t0-a-s1", "version order", started.version, trajectory.version, started.position
    )


async def delete_placeholder(conn: AsyncConnection) -> Expect:
    placeholder = _event("t0-b-s0", "PlaceholderEmitted")
    failed = _event("t0-b-s0", "SessionFailed")
    await conn.execute(delete(events).where(events.c.position == placeholder.position))
    return Expect(
        "events",
        "t0-b-s0",
        "placeholder",
        "PlaceholderEmitted after SessionFailed",
        None,
        failed.position,
    )


async def truncate_payload(conn: AsyncConnection) -> Expect:
    trajectory = _event("t0-a-s0", "TrajectoryRecorded")
    assert trajectory.payload is not None
    await conn.execute(
        update(events)
        .where(events.c.position == trajectory.position)
        .values(payload=trajectory.payload[:-3])
    )
    return Expect(
        "events",
        "t0-a-s0",
        "payload",
        "decodable token arrays",
        lambda found: "bytes" in found,
        trajectory.position,
    )


async def misstate_trainable_tokens(conn: AsyncConnection) -> Expect:
    trajectory = _event("t0-a-s0", "TrajectoryRecorded")
    true = trajectory.data["trainable_tokens"]
    await conn.execute(
        update(events)
        .where(events.c.position == trajectory.position)
        .values(data={**trajectory.data, "trainable_tokens": true + 1})
    )
    return Expect("events", "t0-a-s0", "trainable_tokens", true, true + 1, trajectory.position)


async def add_second_terminal(conn: AsyncConnection) -> Expect:
    succeeded = _event("t0-a-s0", "SessionSucceeded")
    position = int((await conn.execute(select(func.max(events.c.position)))).scalar_one()) + 1
    await conn.execute(
        events.insert().values(
            position=position,
            event_id="00000000-0000-4000-8000-00000000beef",
            session_id="t0-a-s0",
            version=succeeded.version + 1,
            type="SessionCancelled",
            schema_version=1,
            run="golden",
            uid="t0-a",
            partition="train",
            global_step=0,
            data={"message": "again"},
            payload=None,
            recorded_at=succeeded.recorded_at,
        )
    )
    return Expect("events", "t0-a-s0", "terminal events", 1, 2, position)


TAMPERS: list[Tamper] = [
    change_session_reward,
    change_metric_count,
    change_queue_reward,
    repoint_queue_row,
    delete_event,
    swap_versions,
    delete_placeholder,
    truncate_payload,
    misstate_trainable_tokens,
    add_second_terminal,
]


@pytest.mark.parametrize(
    ("backend_url", "tamper"),
    [("sqlite", t) for t in TAMPERS]
    + [pytest.param("postgres", t, marks=pytest.mark.postgres) for t in TAMPERS],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
    indirect=["backend_url"],
)
async def test_each_single_tampering_fails_the_audit_naming_it(
    backend_url: str, tamper: Tamper
) -> None:
    """The same database untampered audits clean: see the golden-log test above."""
    engine = await _projected_golden(backend_url, GOLDEN_V2)
    try:
        async with engine.begin() as conn:
            expect = await tamper(conn)
        report = await audit(engine)
        assert not report.ok
        expect.check(report.divergences[0])
        if tamper is repoint_queue_row:
            assert any(
                d.field == "content sha256" and d.key.endswith("t0-a_0_0")
                for d in report.divergences
            )
    finally:
        await engine.dispose()


async def test_audit_ignores_events_the_projector_has_not_reached(sqlite_url: str) -> None:
    """Read models lag the log on a live database: only what was projected is compared."""
    engine = create_engine(sqlite_url)
    try:
        await golden.load_golden(engine, GOLDEN_V2)
        await Projector(engine, page_size=20).step()
        report = await audit(engine)
        assert report.ok, report.divergences[:3]
        assert report.projected_through == 20 and report.events == 56
    finally:
        await engine.dispose()


def test_audit_cli_exit_status_and_first_divergence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "ledger.db"

    async def populate() -> None:
        engine = await _projected_golden(str(db), GOLDEN_V2)
        await engine.dispose()

    async def tamper() -> None:
        engine = create_engine(str(db))
        async with engine.begin() as conn:
            await change_session_reward(conn)
        await engine.dispose()

    asyncio.run(populate())
    status, out, err = run_cli(capsys, "audit", "--db", str(db))
    assert status == 0, err
    assert "audit passed" in out and err.strip() == ""
    asyncio.run(tamper())
    failed = _cli("audit", "--db", str(db), cwd=tmp_path)  # the console script, as a user runs it
    assert failed.returncode == 1
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1, failed.stderr
    assert (
        "sessions t0-a-s0" in lines[0]
        and "'reward'" in lines[0]
        and "expected 1.0, found 0.75" in lines[0]
    )


# ------------------------------------------------------------------ replay equality
#: The log and every table replay rebuilds: (table, natural order of its rows, columns not compared).
#: Every column is compared, surrogate ids included (a replay numbers queue rows as the projector
#: did: docs/design.md §9), but for the checkpoint's `updated_at`, the wall time of the projection.
TABLES = {
    "events": (events, ("position",), ()),
    "sessions": (sessions, ("session_id",), ()),
    "groups": (groups, ("run", "partition", "global_step", "uid"), ()),
    "metric_counts": (
        metric_counts,
        ("run", "partition", "global_step", "data_source", "metric"),
        (),
    ),
    "queue_rows": (queue_rows, ("id",), ()),
    "projection_errors": (projection_errors, ("position",), ()),
    "checkpoints": (checkpoints, ("name",), ("updated_at",)),
}


def test_replay_comparison_covers_every_read_model_and_every_column_but_one() -> None:
    """A table or column added later is compared unless someone decides otherwise here."""
    assert {table for table, _order, _ignored in TABLES.values()} == {events, *READ_MODELS}
    ignored = {(table.name, column) for table, _order, skip in TABLES.values() for column in skip}
    assert ignored == {("checkpoints", "updated_at")}
    assert all(set(order) <= set(table.c.keys()) for table, order, _skip in TABLES.values())


def _plain(value: Any) -> Any:
    if isinstance(value, memoryview):
        return bytes(value)
    if hasattr(value, "tzinfo"):
        return (
            value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
        )  # SQLite stores UTC without zone
    return value


async def table_rows(engine: AsyncEngine) -> dict[str, list[dict[str, Any]]]:
    out = {}
    async with engine.connect() as conn:
        for name, (table, order, ignored) in TABLES.items():
            rows = [dict(r) for r in (await conn.execute(select(table))).mappings()]
            rows.sort(
                key=lambda r: tuple((r[k] is None, r[k] if r[k] is not None else 0) for k in order)
            )
            out[name] = [{k: _plain(v) for k, v in r.items() if k not in ignored} for r in rows]
    return out


async def _batches(url: str) -> dict[tuple[str, int], dict[str, Any]]:
    async with Ledger.open(url) as ledger:
        async with ledger.engine.connect() as conn:
            steps = sorted(
                {
                    (p, s)
                    for p, s in (
                        await conn.execute(
                            select(groups.c.partition, groups.c.global_step).distinct()
                        )
                    )
                }
            )
        return {key: to_plain_dict(await ledger.batch(*key, timeout=0)) for key in steps}


async def _assert_replica_equal(source_url: str, target_url: str) -> None:
    source, target = create_engine(source_url), create_engine(target_url)
    try:
        want, got = await table_rows(source), await table_rows(target)
    finally:
        await source.dispose()
        await target.dispose()
    assert want["checkpoints"] and want["queue_rows"] and want["metric_counts"]
    for name in TABLES:
        assert len(got[name]) == len(want[name]), name
        for index, (a, b) in enumerate(zip(want[name], got[name])):
            assert a == b, f"{name} row {index}: source {a} != replica {b}"
    want_batches, got_batches = await _batches(source_url), await _batches(target_url)
    assert want_batches.keys() == got_batches.keys() and len(want_batches) == 2
    for key, batch in want_batches.items():
        other = got_batches[key]
        assert batch.keys() == other.keys(), key
        assert any(isinstance(v, torch.Tensor) for v in batch.values())
        for column, value in batch.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == other[column].dtype and torch.equal(value, other[column]), (
                    key,
                    column,
                )
            else:
                assert value == other[column], (key, column)


async def _record_demo(url: str) -> None:
    async with Ledger.open(url) as ledger:
        await run_demo(ledger, DEMO)
        await ledger.project()
        async with ledger.engine.connect() as conn:
            states = set((await conn.execute(select(sessions.c.state).distinct())).scalars())
    assert states == {"succeeded", "failed", "cancelled"}, states


async def test_replay_reproduces_every_table_and_batch(backend_url: str, replica_url: str) -> None:
    await _record_demo(backend_url)
    source, target = create_engine(backend_url), create_engine(replica_url)
    try:
        await upgrade(target)
        await replay(
            source, target, page_size=37
        )  # odd pages: replay must not depend on page boundaries
    finally:
        await source.dispose()
        await target.dispose()
    await _assert_replica_equal(backend_url, replica_url)


@pytest.mark.postgres
def test_replay_cli_across_backends_sqlite_to_postgres(
    request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "source.db"
    pg_url = _fresh(request, "postgres", 1)
    asyncio.run(_record_demo(str(db)))
    status, out, err = run_cli(capsys, "replay", "--db", str(db), "--into", pg_url)
    assert status == 0, err
    assert "replayed" in out
    asyncio.run(_assert_replica_equal(f"sqlite+aiosqlite:///{db}", pg_url))
    status, out, err = run_cli(capsys, "replay", "--db", str(db), "--into", pg_url)
    assert status != 0 and len(err.strip().splitlines()) == 1 and "already has events" in err


# ------------------------------------------------------------------ history / time travel
@pytest.fixture
def golden_v1_file(tmp_path: Path) -> Path:
    db = tmp_path / "golden.db"

    async def load() -> None:
        engine = create_engine(str(db))
        try:
            await golden.load_golden(engine, golden.FIXTURES / "golden_v1.jsonl")
        finally:
            await engine.dispose()

    asyncio.run(load())
    return db


def test_history_at_a_position_shows_the_state_then(
    golden_v1_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trajectory = _event("t0-b-s0", "TrajectoryRecorded")
    failed = _event("t0-b-s0", "SessionFailed")
    status, now, err = run_cli(capsys, "history", "t0-b-s0", "--db", str(golden_v1_file))
    assert status == 0, err
    assert "state now: failed (runner_error)" in now and "PlaceholderEmitted" in now
    status, then, err = run_cli(
        capsys, "history", "t0-b-s0", "--at", str(trajectory.position), "--db", str(golden_v1_file)
    )
    assert status == 0, err
    assert f"state as of position {trajectory.position}: running" in then
    assert (
        "TrajectoryRecorded" in then and "SessionFailed" not in then and "RewardPosted" not in then
    )
    assert trajectory.position < failed.position
    # trainable tokens come from the event (v1 here: upcast from the payload's mask), not a decode
    assert f"({trajectory.data['trainable_tokens']} trainable)" in then


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("no-such-session",), "no such session"),
        (("t0-b-s0", "--at", "3"), "no events at or before position 3"),
    ],
    ids=["unknown-session", "before-the-session"],
)
def test_history_errors_are_one_line(
    golden_v1_file: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], reason: str
) -> None:
    status, _out, err = run_cli(capsys, "history", *args, "--db", str(golden_v1_file))
    assert status != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and reason in lines[0], err
