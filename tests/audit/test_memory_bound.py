"""The audit's memory bound never changes its verdict.

Past `memory_sessions` sessions the audit's fold moves the rows of steps that look done to a
scratch file and compares from there (`sessions.audit.scratch`); a step reached again after that
(a late creation, an event after its sessions ended) sends the audit back to an unbounded fold.
Held here on a multi-step demo ledger with a prune: for generated page sizes, bounds, projector
checkpoints and damage (a tampered read model, a late creation in the first step, an event after
a session's end), the bounded audit reports exactly the divergences the unbounded one does.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, update

from sessions import Ledger, prune
from sessions.audit import auditing, log_check
from sessions.audit.auditing import audit
from sessions.cli.demo import DemoConfig, run_demo
from sessions.projection.projector import Projector
from store import create_engine
from store.schema.tables import events, groups, sessions

RUN = "bound"
STEPS = 5


async def _record(url: str) -> None:
    async with Ledger.open(url, run=RUN) as ledger:
        await run_demo(ledger, DemoConfig(steps=STEPS, prompts=3, group_size=2, seed=3))
        await ledger.project()
        await prune(ledger, run=RUN, before_step=2)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bound") / "template.db"
    asyncio.run(_record(f"sqlite+aiosqlite:///{path}"))
    return path


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setattr(auditing, "SETTLE_MARGIN", 0)
    yield monkeypatch


async def _late_creation(url: str) -> None:
    # In the oldest step not pruned: a pruned step is closed to new sessions (design §14).
    async with Ledger.open(url, run=RUN) as ledger:
        late = await ledger.create_session(
            "late-0", uid="late", session_index=0, group_size=1, partition="train", global_step=2
        )
        await late.complete()


async def _after_the_end(url: str) -> None:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            sid, version, uid = (
                await conn.execute(
                    select(sessions.c.session_id, sessions.c.version, sessions.c.uid)
                    .where(sessions.c.global_step == 0, sessions.c.state == "succeeded")
                    .limit(1)
                )
            ).one()
            end = int((await conn.execute(select(func.max(events.c.position)))).scalar_one())
            await conn.execute(
                events.insert().values(
                    position=end + 1,
                    event_id=str(uuid.uuid4()),
                    session_id=sid,
                    version=version + 1,
                    type="SessionCancelled",
                    schema_version=1,
                    run=RUN,
                    uid=uid,
                    partition="train",
                    global_step=0,
                    data={"message": "again"},
                    payload=None,
                    recorded_at=datetime.now(timezone.utc),
                )
            )
    finally:
        await engine.dispose()


async def _tamper_group(url: str) -> None:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                update(groups)
                .where(groups.c.global_step == 1)
                .values(succeeded=groups.c.succeeded + 1)
            )
    finally:
        await engine.dispose()


DAMAGE = {
    "none": None,
    "late creation": _late_creation,
    "event after the end": _after_the_end,
    "tampered group": _tamper_group,
}


async def _both(url: str, bound: int, project: bool) -> auditing.AuditReport:
    engine = create_engine(url)
    try:
        if project:  # else damage appended to the log leaves the checkpoint inside it
            await Projector(engine).run()
        bounded = await audit(engine, memory_sessions=bound)
        whole = await audit(engine, memory_sessions=None)
    finally:
        await engine.dispose()
    assert bounded.divergences == whole.divergences
    assert (bounded.ok, bounded.events, bounded.sessions, bounded.projected_through) == (
        whole.ok,
        whole.events,
        whole.sessions,
        whole.projected_through,
    )
    return bounded


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    page=st.integers(5, 300),
    bound=st.integers(0, 20),
    damage=st.sampled_from(sorted(DAMAGE)),
    project_again=st.booleans(),
)
def test_a_bounded_audit_reports_what_an_unbounded_one_does(
    template: Path,
    small_pages: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
    page: int,
    bound: int,
    damage: str,
    project_again: bool,
) -> None:
    small_pages.setattr(log_check, "CONTENT_PAGE", page)
    path = tmp_path_factory.mktemp("case") / "ledger.db"
    shutil.copyfile(template, path)
    url = f"sqlite+aiosqlite:///{path}"
    make = DAMAGE[damage]
    if make is not None:
        asyncio.run(make(url))
    asyncio.run(_both(url, bound, project_again))


def test_the_bound_moves_rows_out_and_keeps_the_verdict(
    template: Path, small_pages: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The bounded audit does use its scratch file (else the property above proves nothing)."""
    small_pages.setattr(log_check, "CONTENT_PAGE", 50)
    added: list[int] = []
    real_add = auditing.Scratch.add

    async def add(self: auditing.Scratch, models: object) -> None:
        added.append(len(models.sessions))  # type: ignore[attr-defined]
        await real_add(self, models)  # type: ignore[arg-type]

    small_pages.setattr(auditing.Scratch, "add", add)
    path = tmp_path / "ledger.db"
    shutil.copyfile(template, path)

    async def go() -> None:
        engine = create_engine(f"sqlite+aiosqlite:///{path}")
        try:
            report = await audit(engine, memory_sessions=4)
        finally:
            await engine.dispose()
        assert report.ok, report.divergences[:3]

    asyncio.run(go())
    assert len(added) >= 2 and sum(added) > 0, added


@pytest.mark.postgres
def test_a_bounded_audit_of_a_postgresql_ledger_compares_through_its_sqlite_scratch(
    pg_url: str, small_pages: pytest.MonkeyPatch
) -> None:
    """The scratch file is SQLite whatever the audited backend: timestamps and JSON cross."""
    small_pages.setattr(log_check, "CONTENT_PAGE", 40)

    async def go() -> None:
        await _record(pg_url)
        await _tamper_group(pg_url)
        report = await _both(pg_url, 3, False)
        assert any(d.table == "groups" for d in report.divergences), report.divergences[:3]

    asyncio.run(go())
