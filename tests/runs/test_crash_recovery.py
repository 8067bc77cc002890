"""Crashes with real processes: a writer and a projector SIGKILLed at random points lose nothing.

Each cycle forks a writer (a `Ledger` running many concurrent sessions through `run_session` and
`session()`, some failing, some timing out, some cancelled) and a projector (`Projector.follow`,
small pages, with or without an external file sink) from a preloaded zygote
(tests/crash_workers.py) and SIGKILLs each at its own random moment (seeded). After every kill:

1. the database opens (SQLite: `PRAGMA integrity_check` is ok);
2. `audit` passes (it compares the read models with a replay up to the killed projector's
   checkpoint) and the read models at that checkpoint agree with the log and with themselves;
3. every session is terminal with all the events of its plan, or open with a prefix of them;
   everything the writer was told had committed is in the log;
4. `recover` fails exactly the open sessions (reason `orphaned`, placeholder), the restarted
   projector runs to the end, and `audit` passes again with the checkpoint at the end of the log;
5. every queue row is there exactly once (unique keys; as many as the sessions table and the log
   call for), every group whose sessions all exist is settled with its tag after its rows, metric
   counters equal a brute-force count, and the external sink holds every key (re-deliveries
   allowed, by key), never a tag before its group's rows.

`ROLLOUT_LEDGER_CRASH_CYCLES` (default 70 per backend) and `ROLLOUT_LEDGER_CRASH_SEED` change the
run; each cycle kills two processes. Up to half as many cycles again run while no cycle has yet
left sessions open or killed the projector behind the log (both asserted; which cycles reach them
depends on timing).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from sessions import Ledger
from sessions.audit.auditing import audit
from sessions.runs.recovery import recover
from tests import crash_workers as cw

pytestmark = pytest.mark.slow

CYCLES = int(os.environ.get("ROLLOUT_LEDGER_CRASH_CYCLES", "70"))
SEED = int(os.environ.get("ROLLOUT_LEDGER_CRASH_SEED", "20240611"))
TABLES = "events, sessions, groups, metric_counts, queue_rows, queue_claims, checkpoints"


class Zygote:
    """The preloaded process that forks (and kills) the workers."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=cw.zygote, args=(child,), name="crash-zygote", daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(180):
            raise AssertionError("the crash zygote did not start")
        kind, _pid = self.conn.recv()
        assert kind == "ready"

    def run(
        self,
        jobs: list[tuple[str, dict[str, Any], float | None]],
        errors: Path,
        limit: float = 60.0,
    ) -> list[dict[str, Any]]:
        self.conn.send((jobs, str(errors), limit))
        if not self.conn.poll(limit + 60):
            raise AssertionError(f"the zygote did not report on {[j for j, _, _ in jobs]}")
        kind, body = self.conn.recv()
        if kind != "done":
            raise AssertionError(f"zygote failed:\n{body}")
        for result in body:
            if not result["killed"] and result["exit"] != 0 and result["exit"] != -signal.SIGKILL:
                raise AssertionError(
                    f"{result['job']} exited {result['exit']}:\n{errors.read_text() if errors.exists() else ''}"
                )
        return body

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    started = Zygote()
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty, migrated SQLite file; each cycle starts from a copy."""
    path = tmp_path_factory.mktemp("crash-template") / "template.db"

    async def make() -> None:
        async with Ledger.open(f"sqlite+aiosqlite:///{path}"):
            pass

    asyncio.run(make())
    return path


async def reset_postgres(url: str) -> None:
    from store import create_engine

    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("SET LOCAL lock_timeout = '20s'"))
            await conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY"))
    finally:
        await engine.dispose()


async def last_position(engine: Any) -> int:
    async with engine.connect() as conn:
        return int(
            (await conn.execute(text("SELECT coalesce(max(position), 0) FROM events"))).scalar_one()
        )


# ------------------------------------------------------------------------------ after a kill
async def check_after_kill(
    url: str, journal: Path, sink: Path | None, stats: dict[str, int]
) -> None:
    sinks = [cw.FileSink(str(sink))] if sink is not None else []
    try:
        async with Ledger.open(url, migrate=False, run="crash", sinks=sinks) as ledger:
            engine = ledger.engine
            if engine.dialect.name == "sqlite":
                async with engine.connect() as conn:
                    assert (await conn.execute(text("PRAGMA integrity_check"))).scalar_one() == "ok"
            report = await audit(engine)
            assert report.ok, f"audit after the kill: {[str(d) for d in report.divergences[:3]]}"
            streams = await cw.log_streams(engine)
            facts = cw.check_streams(streams, plans=True)
            stats["acks"] += cw.check_journal(str(journal), streams)
            at_kill = await cw.check_projection(engine, streams)
            end = await last_position(engine)
            stats["projector_behind"] += at_kill["checkpoint"] < end
            stats["events"] += end
            stats["empty"] += end == 0  # the writer died before its first commit

            recovered = await recover(
                ledger, timedelta(0)
            )  # projects first: the restarted projector
            assert sorted(recovered) == sorted(facts["open"]), (
                "recover must fail exactly the open sessions"
            )
            stats["recovered"] += len(recovered)
            stats["cycles_with_open"] += bool(recovered)
            await ledger.project()

            report = await audit(engine)
            assert report.ok, f"audit after recovery: {[str(d) for d in report.divergences[:3]]}"
            assert report.projected_through == await last_position(engine)
            streams = await cw.log_streams(engine)
            after = cw.check_streams(streams, plans=True)
            assert after["open"] == []
            for sid in recovered:
                tail = streams[sid][-2:]
                assert [t for _, _, t, _ in tail] == ["SessionFailed", "PlaceholderEmitted"], sid
                assert tail[0][3]["reason"] == "orphaned" and tail[1][3]["reason"] == "orphaned", (
                    tail
                )
            projection = await cw.check_projection(engine, streams)
            assert projection["checkpoint"] == report.projected_through
            stats["rows"] += projection["rows"]
            stats["pending_groups"] += projection[
                "pending_groups"
            ]  # never fully created: writer died first
            if sink is not None:
                stats["redelivered"] += cw.check_sink(str(sink), projection)
    finally:
        for s in sinks:
            s.close()


async def crash_cycles(
    zygote: Zygote, backend: str, url_for_cycle: Any, folder: Path, cycles: int, seed: int
) -> dict[str, int]:
    """Run the cycles pipelined: while this process checks cycle k's database, the zygote's
    children already write (and die) in cycle k+1's — `url_for_cycle` hands out a database no
    earlier cycle still uses."""
    rng = random.Random(seed)
    stats = dict.fromkeys(
        (
            "cycles",
            "writer_kills",
            "projector_kills",
            "exited",
            "acks",
            "events",
            "rows",
            "recovered",
            "cycles_with_open",
            "projector_behind",
            "pending_groups",
            "redelivered",
            "sink_cycles",
            "empty",
        ),
        0,
    )
    errors = folder / "errors.txt"

    async def launch(k: int) -> tuple[Any, ...]:
        url = await url_for_cycle(k)
        journal, sink = (
            folder / f"journal-{k}",
            (folder / f"sink-{k}" if rng.random() < 0.5 else None),
        )
        jobs = [
            (
                "writer",
                {
                    "url": url,
                    "prefix": f"k{k}",
                    "seed": rng.randrange(2**32),
                    "journal": str(journal),
                    "concurrency": rng.choice((4, 12, 24)),
                },
                rng.uniform(0.05, 0.8),
            ),
            (
                "projector",
                {
                    "url": url,
                    "page_size": rng.choice((1, 4, 16, 64)),
                    "sink": None if sink is None else str(sink),
                },
                rng.uniform(0.05, 0.6),
            ),
        ]
        return (
            url,
            journal,
            sink,
            jobs,
            asyncio.ensure_future(asyncio.to_thread(zygote.run, jobs, errors)),
        )

    # Up to half as many cycles again while a kind of coverage the tests assert is still missing
    # (a cycle that leaves sessions open, one that kills the projector behind the log): which
    # cycles reach them depends on timing, and a loaded machine shifts it.
    total, most = cycles, cycles + cycles // 2
    running: Any = await launch(0)
    k = 0
    while running is not None:
        url, journal, sink, jobs, future = running
        results = await future
        running = await launch(k + 1) if k + 1 < total else None
        for result in results:
            if result["killed"]:
                stats[f"{result['job']}_kills"] += 1
            else:
                stats["exited"] += 1
        try:
            await check_after_kill(url, journal, sink, stats)
        except AssertionError as error:
            if running is not None:
                await running[-1]
            raise AssertionError(
                f"{backend} cycle {k} (seed {seed}, jobs {jobs}, results {results}): {error}"
            ) from error
        stats["cycles"] += 1
        stats["sink_cycles"] += sink is not None
        for leftover in (journal, sink):
            if leftover is not None and leftover.exists():
                leftover.unlink()
        k += 1
        covered = stats["cycles_with_open"] > 0 and stats["projector_behind"] > 0
        if running is None and not covered and k < most:
            total = k + 1
            running = await launch(k)
    return stats


def report(
    capsys: pytest.CaptureFixture[str], backend: str, stats: dict[str, int], seconds: float
) -> None:
    with capsys.disabled():
        print(
            f"\n[crash {backend}] {stats['writer_kills'] + stats['projector_kills']} kills "
            f"({stats['writer_kills']} writer, {stats['projector_kills']} projector; {stats['exited']} exited first) in "
            f"{stats['cycles']} cycles, {seconds:.1f}s, {stats['events']} events ({stats['empty']} cycles with none); "
            f"after each: open+audit+streams+journal ({stats['acks']} acks) "
            f"+projection, recover ({stats['recovered']} orphans in {stats['cycles_with_open']} cycles), audit, "
            f"exactly-once ({stats['rows']} rows; projector killed behind the log in {stats['projector_behind']} cycles), "
            f"sink in {stats['sink_cycles']} cycles ({stats['redelivered']} re-deliveries by key)"
        )


def test_sqlite_writer_and_projector_killed_at_random_points(
    zygote: Zygote, sqlite_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def url_for_cycle(k: int) -> str:
        for done in tmp_path.glob(f"c{k - 2}.db*"):  # checked by now
            done.unlink()
        target = tmp_path / f"c{k}.db"
        shutil.copyfile(sqlite_template, target)
        return f"sqlite+aiosqlite:///{target}"

    started = time.monotonic()
    stats = asyncio.run(crash_cycles(zygote, "sqlite", url_for_cycle, tmp_path, CYCLES, SEED))
    report(capsys, "sqlite", stats, time.monotonic() - started)
    assert stats["writer_kills"] + stats["projector_kills"] >= CYCLES  # most children die mid-work
    assert stats["cycles_with_open"] > 0 and stats["projector_behind"] > 0


@pytest.mark.postgres
def test_postgres_writer_and_projector_killed_at_random_points(
    zygote: Zygote,
    pg_url: str,
    second_pg_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    urls = (
        pg_url,
        second_pg_url,
    )  # alternate: one is checked while the next cycle runs on the other

    async def migrate() -> None:
        for url in urls:
            async with Ledger.open(url):
                pass

    async def url_for_cycle(k: int) -> str:
        url = urls[k % 2]
        if k >= 2:
            await reset_postgres(url)
        return url

    asyncio.run(migrate())
    started = time.monotonic()
    stats = asyncio.run(crash_cycles(zygote, "postgres", url_for_cycle, tmp_path, CYCLES, SEED + 1))
    report(capsys, "postgres", stats, time.monotonic() - started)
    assert stats["writer_kills"] + stats["projector_kills"] >= CYCLES
    assert stats["cycles_with_open"] > 0 and stats["projector_behind"] > 0


# ------------------------------------------------------------------------------ stale sessions
async def _leave_stale_sessions(zygote: Zygote, url: str, folder: Path) -> None:
    async with Ledger.open(url):  # migrate
        pass
    (result,) = await asyncio.to_thread(
        zygote.run, [("stale", {"url": url}, None)], folder / "errors.txt"
    )
    assert result["exit"] == -signal.SIGKILL, result


async def _types(ledger: Ledger, sid: str) -> list[tuple[str, dict[str, Any]]]:
    return [(s.type, s.data) for s in await ledger.store.read_stream(sid)]


async def test_recover_fails_what_a_killed_writer_left_open_and_releases_the_trainer(
    db_url: str, zygote: Zygote, tmp_path: Path
) -> None:
    await _leave_stale_sessions(zygote, db_url, tmp_path)
    killed_at = time.monotonic()
    async with Ledger.open(db_url, run="stale") as ledger:
        trainer = asyncio.create_task(ledger.batch("val", 0, timeout=30, poll_interval=0.05))
        await asyncio.sleep(0.3)
        assert not trainer.done(), (
            "the batch cannot be complete: two sessions of its group are open"
        )
        await asyncio.sleep(max(0.0, 1.6 - (time.monotonic() - killed_at)))
        # a live session with recent activity, in another step
        live = await ledger.create_session(
            "live-0", uid="live", session_index=0, group_size=1, partition="val", global_step=1
        )
        await live.record_trajectory(prompt_ids=[1, 2], response_ids=[3])

        failed = await recover(ledger, timedelta(seconds=1))
        assert sorted(failed) == ["old-0", "old-1"]
        batch = await asyncio.wait_for(trainer, 10)  # released
        assert batch.batch_size[0] == 3
        by_sid = dict(zip(batch["session_id"], batch["is_placeholder"].tolist()))
        assert by_sid == {"old-0": True, "old-1": True, "old-2": False}
        assert sorted(r for r in batch["failure_reason"] if r) == ["orphaned", "orphaned"]
        assert batch["rm_scores"].sum(-1).tolist() == [
            0.0 if p else 1.0 for p in batch["is_placeholder"].tolist()
        ]

        assert [t for t, _ in await _types(ledger, "old-0")] == [
            "SessionCreated",
            "SessionFailed",
            "PlaceholderEmitted",
        ]
        old1 = await _types(ledger, "old-1")
        assert [t for t, _ in old1] == [
            "SessionCreated",
            "SessionStarted",
            "TrajectoryRecorded",
            "SessionFailed",
            "PlaceholderEmitted",
        ]
        assert old1[3][1]["reason"] == "orphaned" and "recovery sweep" in old1[3][1]["message"]
        assert old1[3][1]["discarded_trajectories"] == 1
        assert [t for t, _ in await _types(ledger, "old-2")][-1] == "SessionSucceeded"

        # the live session is left alone, now and on a second sweep; nothing is failed twice
        assert live.state == "running" and (await ledger.load_session("live-0")).state == "running"
        assert await recover(ledger, timedelta(seconds=1)) == []
        async with ledger.engine.connect() as conn:
            status = (
                await conn.execute(text("SELECT status FROM groups WHERE uid = 'old'"))
            ).scalar_one()
        assert status == "finished"
        metrics = {
            m.metric: m.value for m in await ledger.metrics("val", 0) if m.data_source is None
        }
        assert (
            metrics["failed/orphaned"] == 2
            and metrics["placeholders"] == 2
            and metrics["groups/unsettled"] == 0
        )
        await live.complete()
        assert (await audit(ledger.engine)).ok


def test_recover_rejects_a_negative_age() -> None:
    from sessions.runs.recovery import parse_duration

    for bad in ("-5m", "nan", "inf"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)

    async def negative() -> None:
        async with Ledger.open("sqlite+aiosqlite://") as ledger:
            with pytest.raises(ValueError, match="negative"):
                await recover(ledger, timedelta(seconds=-1))

    asyncio.run(negative())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("rollout-ledger")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "sessions.cli.main"]
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    return subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=120)


def test_recover_cli_fails_orphans_and_spares_recent_sessions(
    db_url: str, zygote: Zygote, tmp_path: Path
) -> None:
    asyncio.run(_leave_stale_sessions(zygote, db_url, tmp_path))
    spared = _cli("recover", "--db", db_url, "--older-than", "1h")
    assert spared.returncode == 0, spared.stderr
    assert "failed 0 orphaned session(s)" in spared.stdout
    time.sleep(0.3)
    result = _cli("recover", "--db", db_url, "--older-than", "0.2s")
    assert result.returncode == 0, result.stderr
    assert (
        "failed 2 orphaned session(s)" in result.stdout
        and "old-0" in result.stdout
        and "old-1" in result.stdout
    )
    bad = _cli("recover", "--db", db_url, "--older-than=-5m")
    assert (
        bad.returncode != 0
        and "duration" in bad.stderr
        and len(bad.stderr.strip().splitlines()) == 1
    ), bad.stderr

    async def check() -> None:
        async with Ledger.open(db_url, run="stale") as ledger:
            states = {
                sid: (await ledger.load_session(sid)).state for sid in ("old-0", "old-1", "old-2")
            }
            assert states == {"old-0": "failed", "old-1": "failed", "old-2": "succeeded"}
            assert (await ledger.load_session("old-1")).view.failure_reason == "orphaned"
            assert (await ledger.batch("val", 0, timeout=5)).batch_size[0] == 3
            assert (await audit(ledger.engine)).ok

    asyncio.run(check())
