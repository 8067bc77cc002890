"""A run's launches: a job killed mid-step and resumed from its checkpoint re-runs the step under
the same run with new uids; the ledger records the launch, fails the dead launch's open sessions
at once, and settles, batches and measures the re-run step on the new launch's sessions only,
keeping the earlier ones in the log, counted (`sessions/superseded`) and visible in SQL.

Both backends. Replay and audit of logs with launches are the property of
tests/audit/test_replay_equivalence.py (its generator draws launches); here, each scenario's
database is audited and replayed too.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from sessions import Ledger, SessionHandle
from sessions import events as ev
from sessions.audit.auditing import audit
from sessions.audit.read_model_diff import compare
from sessions.audit.replay import replay
from sessions.errors import ConfigError
from sessions.projection.settled import settled_step
from sessions.report.data import gather
from sessions.report.page import render_page
from sessions.runs.fingerprint import run_stream
from sessions.runs.launches import LAUNCH_ENV
from store import create_engine, upgrade
from tests.conftest import fresh_database

RUN = "resumed"


async def _session(
    ledger: Ledger, sid: str, uid: str, index: int, step: int, reward: float | None, size: int = 2
) -> SessionHandle:
    """A train session of a group of `size`; ended with `reward`, or left open when None."""
    handle = await ledger.create_session(
        sid, uid=uid, session_index=index, group_size=size, partition="train", global_step=step
    )
    if reward is not None:
        await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4, 5])
        await handle.post_reward(reward)
        await handle.complete()
    return handle


async def _crashed_launch(url: str) -> None:
    """Launch `job-a`: step 1 whole; step 2 killed midway (one session open, one ended)."""
    async with Ledger.open(url, run=RUN, launch="job-a") as ledger:
        for g in range(2):
            for i in range(2):
                await _session(ledger, f"a1-{g}-{i}", f"a1g{g}", i, 1, 1.0)
        await _session(ledger, "a2-0", "a2g0", 0, 2, 1.0)
        await _session(ledger, "a2-1", "a2g0", 1, 2, None)  # the worker died here


async def _run_stream(ledger: Ledger) -> list[ev.Event]:
    return [ev.decode(s).event for s in await ledger.store.read_stream(run_stream(RUN))]


async def _metrics(ledger: Ledger, step: int) -> dict[str, float]:
    return {
        row.metric: row.value
        for row in await ledger.metrics("train", step)
        if row.data_source is None
    }


async def test_a_resumed_launch_fails_the_orphans_and_counts_the_re_run_step_on_its_own_sessions(
    db_url: str,
) -> None:
    await _crashed_launch(db_url)
    async with Ledger.open(db_url, run=RUN, launch="job-b") as ledger:
        # Opening recorded the resume and failed the dead launch's open session at once.
        launched = [e for e in await _run_stream(ledger) if isinstance(e, ev.RunLaunched)]
        assert [(e.launch, e.number, e.resumed, e.last_steps) for e in launched] == [
            ("job-a", 1, False, {}),
            ("job-b", 2, True, {"train": 2}),
        ]
        orphan = await ledger.load_session("a2-1")
        assert (orphan.state, orphan.view.failure_reason) == ("failed", "orphaned")
        # The step re-run with new uids, as verl does after loading its checkpoint.
        await _session(ledger, "b2-0", "b2g0", 0, 2, 0.5)
        await _session(ledger, "b2-1", "b2g0", 1, 2, 0.0)

        batch = await ledger.batch("train", 2, timeout=5)
        assert list(batch["session_id"]) == ["b2-0", "b2-1"]
        assert batch["rm_scores"].sum(-1).tolist() == [0.5, 0.0]
        figures = await ledger.metrics_dict("train", 2, timeout=5)
        assert figures["critic/score/mean"] == pytest.approx(0.25)  # verl's own, on its rows
        step2 = await _metrics(ledger, 2)
        assert step2["sessions/total"] == 2
        assert step2["reward/mean"] == pytest.approx(0.25)
        assert step2["groups/total"] == 1
        assert step2["sessions/superseded"] == 2
        assert step2["launch"] == 2
        assert "failed/orphaned" not in step2  # the orphan is the dead launch's, out of the step
        step1 = await _metrics(ledger, 1)  # a step the new launch did not re-run is untouched
        assert (step1["sessions/total"], step1["reward/mean"]) == (4, 1.0)
        assert "sessions/superseded" not in step1

        async with ledger.engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT session_id, launch, superseded FROM session_launches "
                        "WHERE global_step = 2 ORDER BY session_id"
                    )
                )
            ).all()
        assert [tuple(r) for r in rows] == [
            ("a2-0", 1, 1),
            ("a2-1", 1, 1),
            ("b2-0", 2, 0),
            ("b2-1", 2, 0),
        ]
        # A step the launch runs first is held by the projector as without launches: its batch
        # is not read back.
        await _session(ledger, "b3-0", "b3g0", 0, 3, 1.0, size=1)
        fresh = await settled_step(ledger.projector, ledger.store, RUN, "train", 3, timeout=5)
        assert fresh.held and [q["session_id"] for q in fresh.rows] == ["b3-0"]
        # The report counts them (the summary's note; the sessions figure draws the count).
        page = render_page(await gather(ledger.engine, RUN), [], max_points=100, failure_limit=5)
        assert "The run was resumed" in page and "sessions/superseded; train: 2" in page
    await _audited_and_replayed(db_url)


async def test_every_process_of_one_launch_agrees_and_none_fails_another_s_sessions(
    db_url: str,
) -> None:
    """Two workers of one job open their ledgers at different moments: one launch, one number,
    and the later one leaves the earlier one's running session alone."""
    async with (
        Ledger.open(db_url, run=RUN, launch="job-a") as first,
        Ledger.open(db_url, run=RUN, launch="job-a") as second,
    ):
        running = await _session(first, "w1", "g", 0, 1, None)
        await _session(second, "w2", "g", 1, 1, 1.0)
        assert running.state == "running"
        await running.record_trajectory(prompt_ids=[1], response_ids=[2])
        await running.post_reward(0.0)
        await running.complete()
        launched = [e for e in await _run_stream(second) if isinstance(e, ev.RunLaunched)]
        assert [(e.launch, e.number) for e in launched] == [("job-a", 1)]
        assert (await _metrics(second, 1))["sessions/total"] == 2
        assert (await second.batch("train", 1, timeout=5)).batch_size[0] == 2


async def test_a_straggler_of_a_dead_launch_is_superseded_at_once_and_never_waited_for(
    db_url: str,
) -> None:
    """A process of the earlier launch still writing after the resume took its step: its
    sessions count as superseded from their creation, and the re-run step does not wait on them."""
    async with Ledger.open(db_url, run=RUN, launch="job-a") as old:
        await _session(old, "a1-0", "a1", 0, 1, 1.0, size=1)
        async with Ledger.open(db_url, run=RUN, launch="job-b") as new:
            await _session(new, "b1-0", "b1", 0, 1, 0.25, size=1)
            await _session(old, "a1-late", "a1late", 0, 1, None, size=1)  # left open
            batch = await new.batch("train", 1, timeout=5)
            assert list(batch["session_id"]) == ["b1-0"]
            step = await _metrics(new, 1)
            assert (step["sessions/total"], step["sessions/superseded"]) == (1, 2)
            assert step["reward/mean"] == pytest.approx(0.25)
            assert step["groups/unsettled"] == 0
    await _audited_and_replayed(db_url)


async def test_a_ledger_without_a_launch_records_none_and_supersedes_nothing(
    db_url: str,
) -> None:
    async with Ledger.open(db_url, run=RUN) as ledger:
        await _session(ledger, "s0", "g0", 0, 1, 1.0, size=1)
    async with Ledger.open(db_url, run=RUN) as ledger:  # the same step again: one step, as before
        await _session(ledger, "s1", "g1", 0, 1, 0.0, size=1)
        assert not [e for e in await _run_stream(ledger) if isinstance(e, ev.RunLaunched)]
        step = await _metrics(ledger, 1)
        assert step["sessions/total"] == 2 and "launch" not in step


async def test_a_launch_after_launchless_sessions_takes_over_only_the_steps_it_re_runs(
    db_url: str,
) -> None:
    async with Ledger.open(db_url, run=RUN) as ledger:
        await _session(ledger, "s0", "g0", 0, 1, 1.0, size=1)
        await _session(ledger, "s1", "g1", 0, 2, 1.0, size=1)
    async with Ledger.open(db_url, run=RUN, launch="resume-2") as ledger:
        await _session(ledger, "t1", "h1", 0, 2, 0.0, size=1)
        assert (await _metrics(ledger, 1))["sessions/total"] == 1
        step2 = await _metrics(ledger, 2)
        assert (step2["sessions/total"], step2["sessions/superseded"], step2["launch"]) == (1, 1, 1)
    await _audited_and_replayed(db_url)


async def test_the_launch_comes_from_the_environment_and_is_checked(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LAUNCH_ENV, "slurm-4242")
    async with Ledger.open(db_url, run=RUN) as ledger:
        assert ledger.launch == "slurm-4242"
        launched = [e for e in await _run_stream(ledger) if isinstance(e, ev.RunLaunched)]
        assert [e.launch for e in launched] == ["slurm-4242"]
    async with Ledger.open(db_url, run=RUN, launch="explicit") as ledger:
        assert ledger.launch == "explicit"  # the option wins over the environment
    for bad in ("", "x" * 129, "tab\there", 7):
        with pytest.raises(ConfigError, match="launch"):
            async with Ledger.open(db_url, run=RUN, launch=bad):  # type: ignore[arg-type]
                pass


async def _audited_and_replayed(url: str) -> None:
    """The database's audit passes, and a replay of its log rebuilds every read model equal."""
    source = create_engine(url)
    try:
        report = await audit(source)
        assert report.ok, report.divergences[:3]
        with fresh_database("sqlite") as target_url:
            target = create_engine(target_url)
            try:
                await upgrade(target)
                await replay(source, target)
                diff: list[Any] = await compare(source, target)
                assert not diff, diff[:3]
            finally:
                await target.dispose()
    finally:
        await source.dispose()
