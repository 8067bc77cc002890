"""Issue 40, cases 2, 3, 4 and 5: a pruned step is closed; a prune never touches an open session
and never re-uses an id; two prunes at once take turns; a prune cut between its record and its
rewrite is named by `audit` and finished by the next prune.

Every window is reached on purpose: a wrapper around the prune's record
(`store.retention.record_prune`) or the prune's own seam between record and rewrite
(`sessions.runs.pruning.between_record_and_rewrite`), never a sleep. Both backends.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from sessions import Ledger, StepPrunedError, prune
from sessions.audit.auditing import audit
from sessions.runs import pruning
from store import retention as sql

INCOMPLETE = "is incomplete: run `rollout-ledger prune` again to finish it"


async def _session(ledger: Ledger, sid: str, step: int, *, end: bool = True) -> Any:
    handle = await ledger.create_session(
        sid, uid=sid, session_index=0, group_size=1, partition="train", global_step=step
    )
    await handle.record_trajectory(prompt_ids=[1, 2, 3], response_ids=[4, 5], response_mask=[1, 1])
    if end:
        await handle.complete(score=1.0)
    return handle


async def _steps(ledger: Ledger, steps: int, per_step: int = 2) -> None:
    for step in range(steps):
        for index in range(per_step):
            await _session(ledger, f"s{step}-{index}", step)
    await ledger.project()


async def _count(ledger: Ledger, where: str = "") -> int:
    async with ledger.engine.connect() as conn:
        return int((await conn.execute(text(f"SELECT count(*) FROM events {where}"))).scalar_one())


async def _records(ledger: Ledger) -> int:
    return await _count(ledger, "WHERE type = 'PayloadsPruned'")


async def _audited(ledger: Ledger) -> None:
    checked = await audit(ledger.engine)
    assert checked.ok, [str(d) for d in checked.divergences[:3]]


def _wrap_record(
    monkeypatch: pytest.MonkeyPatch, before: Callable[[], Awaitable[None]]
) -> list[tuple[str, Any]]:
    """Run `before` each time a prune is about to record (after it read the step); returns the
    outcomes the real record gave."""
    real = sql.record_prune
    outcomes: list[tuple[str, Any]] = []

    async def record(*args: Any, **kwargs: Any) -> tuple[str, Any]:
        await before()
        outcome = await real(*args, **kwargs)
        outcomes.append(outcome)
        return outcome

    monkeypatch.setattr(sql, "record_prune", record)
    return outcomes


# ---------------------------------------------------------------------- case 1: a closed step
async def _closed(url: str) -> None:
    async with Ledger.open(url, run="r") as ledger:
        await _steps(ledger, 2)
        report = await prune(ledger, run="r", before_step=1)
        assert report.pruned_steps == [0]
        (prune_id,) = report.prune_ids
        before = await _count(ledger)
        with pytest.raises(StepPrunedError) as caught:
            await _session(ledger, "late", 0)
        assert caught.value.prune_id == prune_id and prune_id in str(caught.value)
        assert (caught.value.run, caught.value.partition, caught.value.global_step) == (
            "r",
            "train",
            0,
        )

        async def runner(handle: Any) -> None:
            raise AssertionError("a session in a pruned step must not run")

        with pytest.raises(StepPrunedError):
            await ledger.run_session(
                runner,
                "late-run",
                uid="late-run",
                session_index=0,
                group_size=1,
                partition="train",
                global_step=0,
            )
        assert await _count(ledger) == before  # nothing written
        # The same step of the other partition, and the next step, are open.
        handle = await ledger.create_session(
            "val-0", uid="val-0", session_index=0, group_size=1, partition="val", global_step=0
        )
        await handle.cancel("done")
        await _session(ledger, "next", 1)
        await ledger.project()
        await _audited(ledger)


def test_a_session_in_a_pruned_step_is_refused_naming_the_prune(db_url: str) -> None:
    asyncio.run(_closed(db_url))


# -------------------------------------------------------------- case 3: an open session
async def _straggler(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with Ledger.open(url, run="r") as ledger:
        await _steps(ledger, 2)
        late: list[Any] = []

        async def straggle() -> None:
            # The prune read step 0 as settled; a late session of it arrives before the record.
            if not late:
                late.append(await _session(ledger, "late", 0, end=False))

        outcomes = _wrap_record(monkeypatch, straggle)
        report = await prune(ledger, run="r", before_step=1)
        assert outcomes == [(sql.OPEN_SESSIONS, 1)]
        assert report.pruned_steps == [] and report.skipped_open == [0]
        assert await _records(ledger) == 0  # nothing recorded, nothing replaced
        assert await _count(ledger, "WHERE pruned_by IS NOT NULL") == 0
        await late[0].record_trajectory(prompt_ids=[7], response_ids=[8], response_mask=[1])
        await late[0].complete(score=0.5)
        await ledger.project()
        await _audited(ledger)
        report = await prune(ledger, run="r", before_step=1)
        assert report.pruned_steps == [0] and report.events == 4
        await _audited(ledger)


def test_a_prune_never_touches_a_session_opened_after_it_read_the_step(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(_straggler(db_url, monkeypatch))


# ---------------------------------------------------------------- case 4: two prunes at once
async def _two_at_once(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with Ledger.open(url, run="r") as first, Ledger.open(url, run="r") as second:
        await _steps(first, 2)
        await second.project()
        both_read = asyncio.Barrier(2)
        outcomes = _wrap_record(monkeypatch, both_read.wait)
        reports = await asyncio.gather(
            prune(first, run="r", before_step=1), prune(second, run="r", before_step=1)
        )
        assert sorted(status for status, _ in outcomes) == [sql.ALREADY_PRUNED, "recorded"]
        winner, loser = sorted(reports, key=lambda r: -len(r.pruned_steps))
        assert winner.pruned_steps == [0] and loser.pruned_steps == []
        assert loser.skipped_pruned == [0] and loser.prune_ids == []
        assert await _records(first) == 1
        await _audited(first)


def test_two_prunes_of_one_step_take_turns(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(_two_at_once(db_url, monkeypatch))


async def _finished_by_the_other(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with Ledger.open(url, run="r") as first, Ledger.open(url, run="r") as second:
        await _steps(first, 2)
        await second.project()
        recorded, resume = asyncio.Event(), asyncio.Event()
        held: list[str] = []

        async def hold(prune_id: str) -> None:
            if not held:  # the first prune stops between its record and its rewrite
                held.append(prune_id)
                recorded.set()
                await resume.wait()

        monkeypatch.setattr(pruning, "between_record_and_rewrite", hold)
        stopped = asyncio.create_task(prune(first, run="r", before_step=1))
        await recorded.wait()
        other = await prune(second, run="r", keep_last=0)  # finishes the first's, prunes step 1
        assert other.finished_prune_ids == held
        assert other.pruned_steps == [1] and held[0] not in other.prune_ids
        resume.set()
        report = await stopped
        assert report.pruned_steps == [0] and report.prune_ids == held
        await _audited(first)
        async with first.engine.connect() as conn:
            owners = {
                step: {owner for (owner,) in rows}
                for step in (0, 1)
                for rows in [
                    await conn.execute(
                        text(
                            "SELECT DISTINCT pruned_by FROM events WHERE global_step = :s "
                            "AND payload IS NOT NULL"
                        ),
                        {"s": step},
                    )
                ]
            }
        assert owners == {0: set(held), 1: set(other.prune_ids)}  # no id re-used for new work


def test_a_prune_finished_by_another_keeps_its_own_id_only(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(_finished_by_the_other(db_url, monkeypatch))


# ------------------------------------------------------------- case 5: a prune cut midway
class _Cut(Exception):
    """Stands for the process dying between the prune's record and its rewrite."""


async def _cut(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with Ledger.open(url, run="r") as ledger:
        await _steps(ledger, 2)
        cut: list[str] = []

        async def die(prune_id: str) -> None:
            cut.append(prune_id)
            raise _Cut(prune_id)

        monkeypatch.setattr(pruning, "between_record_and_rewrite", die)
        with pytest.raises(_Cut):
            await prune(ledger, run="r", before_step=1)
        monkeypatch.setattr(pruning, "between_record_and_rewrite", None)
        await _incomplete_then_finished(ledger, cut[0])


async def _incomplete_then_finished(ledger: Ledger, prune_id: str) -> None:
    checked = await audit(ledger.engine)
    assert not checked.ok
    assert str(checked.divergences[0]).endswith(f"'prune {prune_id} {INCOMPLETE}'")
    with pytest.raises(StepPrunedError):  # recorded: the step is closed already
        await _session(ledger, "late", 0)
    report = await prune(ledger, run="r", before_step=1)
    assert report.finished_prune_ids == [prune_id] and report.pruned_steps == []
    await _audited(ledger)


def test_a_prune_cut_before_its_rewrite_is_named_and_finished(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(_cut(db_url, monkeypatch))


_KILLED_WORKER = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from sessions import Ledger, prune
    from sessions.runs import pruning

    async def die(prune_id):
        print(prune_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    async def main():
        pruning.between_record_and_rewrite = die
        async with Ledger.open(sys.argv[1], run="r") as ledger:
            await prune(ledger, run="r", before_step=1)

    asyncio.run(main())
    """
)


async def _record_two_steps(url: str) -> None:
    async with Ledger.open(url, run="r") as ledger:
        await _steps(ledger, 2)


def test_a_prune_killed_before_its_rewrite_is_named_and_finished(db_url: str) -> None:
    asyncio.run(_record_two_steps(db_url))
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WORKER, db_url],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == -9, done.stderr[-2000:]
    prune_id = done.stdout.strip()
    # What the user does: audit names the cut prune, prune finishes it, audit is clean.
    audited = _cli("audit", "--db", db_url)
    assert audited.returncode == 1, audited.stdout + audited.stderr
    assert f"prune {prune_id} {INCOMPLETE}" in audited.stdout + audited.stderr
    pruned = _cli("prune", "--db", db_url, "--run", "r", "--before-step", "1")
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert f"finished prunes cut midway: {prune_id}" in pruned.stdout
    audited = _cli("audit", "--db", db_url)
    assert audited.returncode == 0, audited.stdout + audited.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sessions.cli", *args], capture_output=True, text=True, timeout=300
    )


_RACING_WORKER = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    from sessions import Ledger, prune
    from store import retention as sql

    url, folder, workers, me = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    real = sql.record_prune

    async def record(*args, **kwargs):
        # Every worker has read the step before any records it: a file barrier, not a sleep.
        (folder / f"ready-{me}").touch()
        deadline = time.monotonic() + 120
        while len(list(folder.glob("ready-*"))) < workers:
            if time.monotonic() > deadline:
                raise SystemExit("the other workers never came to record")
            await asyncio.sleep(0.01)
        return await real(*args, **kwargs)

    async def main():
        sql.record_prune = record
        async with Ledger.open(url, run="r") as ledger:
            report = await prune(ledger, run="r", before_step=1)
        print(report.pruned_steps, report.skipped_pruned, flush=True)

    asyncio.run(main())
    """
)


def test_three_prune_processes_at_once_record_one_prune(db_url: str, tmp_path: Path) -> None:
    """Issue 40's case 4 across processes: every worker reads the step, then all race to record
    it; one records, the others write nothing and exit 0 (no ConcurrencyError)."""
    asyncio.run(_record_two_steps(db_url))
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACING_WORKER, db_url, str(tmp_path), "3", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    outputs = [worker.communicate(timeout=300) for worker in workers]
    assert [w.returncode for w in workers] == [0, 0, 0], [err[-1500:] for _out, err in outputs]
    said = sorted(out.strip() for out, _err in outputs)
    assert said == ["[0] []", "[] [0]", "[] [0]"], said

    async def check() -> None:
        async with Ledger.open(db_url, run="r") as ledger:
            assert await _records(ledger) == 1
            await _audited(ledger)

    asyncio.run(check())
