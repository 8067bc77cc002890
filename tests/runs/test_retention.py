"""Retention: pruning settled steps' payloads keeps the audit, the metrics and the
replay of every read model but the pruned steps' queue rows; a pruned batch is `BatchPruned`.

Both backends; hypothesis draws the run's size and the bound. The 1,000-step run with a
keep-last-50 policy is `benchmarks/retention.py` (too slow for CI).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from sessions import BatchPruned, Ledger, RetentionPolicy, prune
from sessions.audit.auditing import audit
from sessions.audit.read_model_diff import compare
from sessions.audit.replay import replay
from sessions.cli.demo import DemoConfig, run_demo
from sessions.errors import ConfigError, InvalidArgument
from sessions.runs import retention
from store import create_engine, upgrade
from store import retention as sql
from tests.conftest import backend_of, fresh_database, wipe


@contextlib.asynccontextmanager
async def _record(
    url: str, steps: int, policy: RetentionPolicy | None = None
) -> AsyncIterator[Ledger]:
    options: dict[str, Any] = {"retention": policy} if policy else {}
    async with Ledger.open(url, run="r", **options) as ledger:
        await run_demo(
            ledger,
            DemoConfig(
                steps=steps, prompts=4, group_size=3, fail_rate=0.3, cancel_rate=0.1, seed=5
            ),
        )
        await ledger.project()
        yield ledger


async def _metrics(ledger: Ledger) -> list[Any]:
    return sorted(
        (m.partition, m.global_step, m.data_source or "", m.metric, m.value)
        for m in await ledger.metrics(run="r")
    )


async def _tombstones(ledger: Ledger) -> int:
    """Payloads a prune replaced: known by their row's mark (revision 0008), not their size."""
    async with ledger.engine.connect() as conn:
        return int(
            (
                await conn.execute(text("SELECT count(*) FROM events WHERE pruned_by IS NOT NULL"))
            ).scalar_one()
        )


async def _check(url: str, steps: int, keep_last: int, replica: str) -> None:
    async with _record(url, steps) as ledger:
        before = await _metrics(ledger)
        report = await prune(ledger, run="r", keep_last=keep_last)
        pruned = list(range(max(0, steps - keep_last)))
        assert report.pruned_steps == pruned
        assert (await _tombstones(ledger)) == report.events
        checked = await audit(ledger.engine)
        assert checked.ok, checked.divergences[:3]
        assert await _metrics(ledger) == before
        for step in range(steps):
            if step in pruned:
                with pytest.raises(BatchPruned) as caught:
                    await ledger.batch("train", step, run="r", timeout=5)
                assert caught.value.prune_id in str(caught.value)
                assert caught.value.steps == (step,)
            else:
                batch = await ledger.batch("train", step, run="r", timeout=5)
                assert batch.batch_size[0] > 0
        again = await prune(ledger, run="r", keep_last=keep_last)
        assert again.pruned_steps == [] and again.events == 0
        target = create_engine(replica)
        try:
            await upgrade(target)
            await replay(ledger.engine, target)
            assert await compare(ledger.engine, target) == []
            assert (await audit(target)).ok
        finally:
            await target.dispose()


@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.integers(1, 4), keep_last=st.integers(0, 4))
def test_prune_keeps_audit_metrics_and_replay(
    module_db_pair: tuple[str, str], steps: int, keep_last: int
) -> None:
    url, replica = module_db_pair
    asyncio.run(wipe(url))
    asyncio.run(wipe(replica))
    asyncio.run(_check(url, steps, keep_last, replica))


async def _tamper(url: str) -> None:
    async with _record(url, 2) as ledger:
        await prune(ledger, run="r", before_step=1)
        async with ledger.engine.begin() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT position, payload FROM events WHERE pruned_by IS NOT NULL LIMIT 1"
                    ),
                )
            ).one()
            forged = bytes(row[1])[:-1] + bytes([bytes(row[1])[-1] ^ 1])
            await conn.execute(
                text("UPDATE events SET payload = :p WHERE position = :q"),
                {"p": forged, "q": row[0]},
            )
        checked = await audit(ledger.engine)
        assert not checked.ok
        assert any("digest" in d.field for d in checked.divergences), checked.divergences


def test_a_forged_tombstone_fails_the_audit(db_url: str) -> None:
    asyncio.run(_tamper(db_url))


async def _policy(url: str) -> None:
    async with _record(url, 3, RetentionPolicy(keep_last_steps=1)) as ledger:
        assert (await retention.recorded_policy(ledger.engine, "r")).keep_last_steps == 1
        report = await prune(ledger, run="r", policy=True)
        assert report.pruned_steps == [0, 1]
        assert (await audit(ledger.engine)).ok
    # Reopening with the same configuration is accepted although a prune follows it in the stream.
    async with Ledger.open(url, run="r", retention=RetentionPolicy(keep_last_steps=1)) as again:
        await again.project()


def test_the_recorded_policy_is_applied(db_url: str) -> None:
    asyncio.run(_policy(db_url))


async def _budget(url: str) -> None:
    async with _record(url, 3) as ledger:
        async with ledger.engine.connect() as conn:
            sizes = await sql.step_sizes(conn, "r", "train")
        newest = sizes[-1][2]
        report = await prune(ledger, run="r", max_payload_bytes=newest)
        assert report.pruned_steps == [0, 1]
        assert (await audit(ledger.engine)).ok


def test_a_size_budget_keeps_the_newest_steps_that_fit(db_url: str) -> None:
    asyncio.run(_budget(db_url))


async def _vacuum(url: str) -> None:
    async with _record(url, 3) as ledger:
        assert await sql.auto_vacuum_mode(ledger.engine) == "incremental"
        report = await prune(ledger, run="r", keep_last=0)
        assert report.pages_freed > 0
        assert report.bytes_after < report.bytes_before


def test_sqlite_gives_the_space_back(tmp_path: Path) -> None:
    with fresh_database("sqlite", tmp_path) as url:
        asyncio.run(_vacuum(url))


def test_bad_bounds_are_refused(db_url: str) -> None:
    async def go() -> None:
        async with _record(db_url, 1) as ledger:
            with pytest.raises(InvalidArgument):
                await prune(ledger, run="r")
            with pytest.raises(ConfigError):
                await prune(ledger, run="r", keep_last=-1)

    asyncio.run(go())
    assert backend_of(db_url) in ("sqlite", "postgres")
