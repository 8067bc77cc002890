"""Append throughput on a SQLite file: the public recorder API vs two named baselines.

Workload: N sessions, all in flight at once (bounded by the concurrency), each
created+started -> 1..3 trajectories of 256..4096 tokens -> reward -> complete, through
`Ledger.session` (its trajectories and reward are staged and appended with `complete`, so a
session is two appends; each returns once its events are durable; the store group-commits
concurrent sessions' appends).

Baselines, on the very same tokens:

* ``eventsourcing`` (PyPI, the `bench` extra): an `Application` on its SQLite recorder, one
  `Aggregate` per session with the same events (token arrays as `bytes` attributes, through a
  registered base64 transcoding — its JSON transcoder has none for bytes), saved after every
  command like the ledger's appends, sessions interleaved in waves of the same concurrency. Its
  connections get ``PRAGMA synchronous=NORMAL``, the ledger's durability setting (its default,
  FULL, fsyncs every commit). It is synchronous: no group commit across aggregates.
* raw ``sqlite3`` ``executemany``: the exact rows the ledger wrote, re-inserted in one transaction
  into a fresh file with the same ``events`` table and indexes, WAL, ``synchronous=NORMAL``: the
  floor no ORM beats.

    python -m benchmarks.append --sessions 2000 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    Config,
    CpuProbe,
    Report,
    RssProbe,
    _version,
    add_memory,
    log,
    median,
    preset,
    scratch_dir,
)
from benchmarks.workload import Work, plan, tokens_of

WORKLOAD = "append"
GROUP = 4


# ------------------------------------------------------------------------------- the ledger
async def ledger_run(
    path: Path, work: list[Work], concurrency: int, probe: CpuProbe | None = None
) -> tuple[float, int, int]:
    """Record `work` through the public API; returns (seconds, events, tokens). `probe`, if given,
    measures the same span (CPU by thread, garbage collections)."""
    from sessions import Ledger

    limit = asyncio.Semaphore(concurrency)
    async with Ledger.open(f"sqlite+aiosqlite:///{path}", run="bench") as ledger:

        async def one(i: int) -> None:
            async with limit:
                async with ledger.session(
                    f"s{i}",
                    uid=f"u{i // GROUP}",
                    session_index=i % GROUP,
                    group_size=GROUP,
                    partition="train",
                    global_step=0,
                ) as s:
                    for prompt, response in work[i]:
                        await s.record_trajectory(prompt_ids=prompt, response_ids=response)
                    await s.post_reward(1.0)

        with probe or contextlib.nullcontext():
            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(len(work))))
            elapsed = time.perf_counter() - start
        events = ledger.store.events_committed
    return elapsed, events, tokens_of(work)


# --------------------------------------------------------------------------- raw sqlite3
_COLUMNS = "event_id, session_id, version, type, schema_version, run, uid, partition, global_step, data, payload, recorded_at"


def ledger_rows(source: Path) -> tuple[list[str], list[tuple[Any, ...]]]:
    """The `events` table's DDL (table and indexes) and every row the ledger wrote."""
    src = sqlite3.connect(source)
    try:
        ddl = [
            sql
            for (sql,) in src.execute(
                "SELECT sql FROM sqlite_master WHERE tbl_name = 'events' AND sql IS NOT NULL ORDER BY type DESC"
            )
        ]
        rows = src.execute(f"SELECT {_COLUMNS} FROM events ORDER BY position").fetchall()
    finally:
        src.close()
    return ddl, rows


def raw_sqlite(ddl: list[str], rows: list[tuple[Any, ...]], target: Path) -> float:
    """Insert `rows` with one executemany in one transaction; returns seconds (commit included)."""
    dst = sqlite3.connect(target, isolation_level=None)
    dst.execute("PRAGMA journal_mode=WAL")
    dst.execute("PRAGMA synchronous=NORMAL")
    for statement in ddl:
        dst.execute(statement)
    start = time.perf_counter()
    dst.execute("BEGIN")
    dst.executemany(f"INSERT INTO events ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    dst.execute("COMMIT")
    elapsed = time.perf_counter() - start
    dst.close()
    return elapsed


# ------------------------------------------------------------------------- eventsourcing
def _eventsourcing_app(db: Path) -> Any:
    """An eventsourcing Application on a SQLite file (imports kept local: optional extra)."""
    from eventsourcing.application import Application
    from eventsourcing.domain import Aggregate, event
    from eventsourcing.persistence import Transcoding

    global _ES_CLASSES
    if _ES_CLASSES is None:

        class BytesAsBase64(Transcoding):
            type = bytes
            name = "bytes_b64"

            def encode(self, obj: bytes) -> str:
                return base64.b64encode(obj).decode("ascii")

            def decode(self, data: str) -> bytes:
                return base64.b64decode(data)

        class RolloutSession(Aggregate):
            @event("Created")
            def __init__(
                self,
                session_id: str,
                uid: str,
                session_index: int,
                group_size: int,
                partition: str,
                global_step: int,
            ) -> None:
                self.session_id, self.uid = session_id, uid
                self.state = "created"
                self.trajectories: list[int] = []
                self.reward: float | None = None

            @event("Started")
            def start(self) -> None:
                self.state = "running"

            @event("TrajectoryRecorded")
            def record_trajectory(
                self,
                index: int,
                num_turns: int,
                prompt_len: int,
                response_len: int,
                prompt_ids: bytes,
                response_ids: bytes,
                response_mask: bytes,
            ) -> None:
                self.trajectories.append(index)

            @event("RewardPosted")
            def post_reward(self, reward: float) -> None:
                self.reward = reward

            @event("Succeeded")
            def succeed(self, selected: list[int], score: float) -> None:
                self.state = "succeeded"

        class Rollouts(Application):
            def register_transcodings(self, transcoder: Any) -> None:
                super().register_transcodings(transcoder)
                transcoder.register(BytesAsBase64())

        _ES_CLASSES = (Rollouts, RolloutSession)
    rollouts, _ = _ES_CLASSES
    app = rollouts(env={"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": str(db)})
    pool = app.factory.datastore.pool  # match the ledger's durability: synchronous=NORMAL
    create = pool._create_connection

    def create_normal() -> Any:
        conn = create()
        conn._sqlite_conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    pool._create_connection = create_normal
    for conn in list(pool._pool):
        conn._sqlite_conn.execute("PRAGMA synchronous=NORMAL")
    return app


_ES_CLASSES: tuple[Any, Any] | None = None


def eventsourcing_available() -> bool:
    try:
        import eventsourcing  # noqa: F401
    except ImportError:
        return False
    return True


def eventsourcing_run(db: Path, work: list[Work], concurrency: int) -> tuple[float, int]:
    """The same sessions as aggregates, one save per command; returns (seconds, events)."""
    app = _eventsourcing_app(db)
    _, session_cls = _ES_CLASSES  # type: ignore[misc]
    events = 0
    start = time.perf_counter()
    for wave in range(0, len(work), concurrency):
        ids = range(wave, min(wave + concurrency, len(work)))
        live = {}
        for i in ids:  # created + started: one save, like the ledger's one atomic append
            s = session_cls(f"s{i}", f"u{i // GROUP}", i % GROUP, GROUP, "train", 0)
            s.start()
            app.save(s)
            live[i] = s
            events += 2
        for t in range(max(len(work[i]) for i in ids)):
            for i in ids:
                if t < len(work[i]):
                    prompt, response = work[i][t]
                    live[i].record_trajectory(
                        t,
                        1,
                        len(prompt),
                        len(response),
                        prompt.astype("<i4", copy=False).tobytes(),
                        response.astype("<i4", copy=False).tobytes(),
                        np.ones(len(response), np.uint8).tobytes(),
                    )
                    app.save(live[i])
                    events += 1
        for i in ids:
            live[i].post_reward(1.0)
            app.save(live[i])
            live[i].succeed(list(range(len(work[i]))), 1.0)
            app.save(live[i])
            events += 2
    elapsed = time.perf_counter() - start
    app.close()
    return elapsed, events


# -------------------------------------------------------------------------------- suite
def run(cfg: Config, report: Report) -> None:
    work = plan(cfg.append_sessions, seed=cfg.seed)
    with_es = eventsourcing_available()
    if not with_es:
        report.note(
            WORKLOAD,
            "eventsourcing not installed (pip install -e '.[bench]'): that baseline skipped",
        )
    ledger_s, raw_s, es_s, rss, cpu = [], [], [], [], []
    events = tokens = es_events = 0
    with scratch_dir(cfg, WORKLOAD) as tmp:
        for rep in range(cfg.reps):
            db = tmp / f"ledger{rep}.db"
            cpu.append(CpuProbe())
            with RssProbe() as probe:
                elapsed, events, tokens = asyncio.run(
                    ledger_run(db, work, cfg.append_concurrency, cpu[-1])
                )
            rss.append(probe)
            ledger_s.append(elapsed)
            ddl, rows = ledger_rows(db)
            raw_s.append(raw_sqlite(ddl, rows, tmp / f"raw{rep}.db"))
            del rows
            if with_es:
                elapsed, es_events = eventsourcing_run(
                    tmp / f"es{rep}.db", work, cfg.append_concurrency
                )
                es_s.append(elapsed)
            for name in os.listdir(tmp):
                (tmp / name).unlink()
            log(
                f"  append rep {rep + 1}/{cfg.reps}: ledger {events / ledger_s[-1]:,.0f} events/s, raw "
                f"{events / raw_s[-1]:,.0f}"
                + (f", eventsourcing {es_events / es_s[-1]:,.0f}" if with_es else "")
            )
        led, raw = median(ledger_s), median(raw_s)
        report.add(
            WORKLOAD,
            f"ledger public API ({cfg.append_sessions} sessions, {events} events)",
            events / led,
            "events/s",
        )
        report.add(WORKLOAD, "ledger public API", tokens / led, "tokens/s")
        if with_es:
            es = median(es_s)
            label = f"eventsourcing {_version('eventsourcing')} app, SQLite recorder"
            if es_events != events:
                report.note(
                    WORKLOAD, f"eventsourcing stored {es_events} events, the ledger {events}"
                )
            report.add(WORKLOAD, label, es_events / es, "events/s")
            report.add(WORKLOAD, label, tokens / es, "tokens/s")
        report.add(WORKLOAD, "raw sqlite3 executemany, 1 txn", events / raw, "events/s")
        report.add(WORKLOAD, "raw sqlite3 executemany, 1 txn", tokens / raw, "tokens/s")
        if with_es:
            report.add(
                WORKLOAD,
                "ratio ledger / eventsourcing (events/s)",
                (events / led) / (es_events / es),
                "x",
                kind="ratio",  # a baseline, no target: issue 30 retired ">= 10x"
            )
        report.add(
            WORKLOAD,
            "ratio ledger / raw sqlite3 (events/s)",
            raw / led,
            "x",
            target=">= 0.5x",
            goal=(">=", 0.5),
            kind="ratio",
        )
        # Where the ledger's time goes: wall ~= loop CPU + SQLite thread CPU means the two do not overlap.
        per_event = 1e6 / events
        report.add(WORKLOAD, "  ledger: wall per event", led * per_event, "µs/event")
        report.add(
            WORKLOAD,
            "  ledger: event-loop thread CPU per event",
            median(p.loop_cpu for p in cpu) * per_event,
            "µs/event",
        )
        report.add(
            WORKLOAD,
            "  ledger: other threads' CPU per event (SQLite)",
            median(p.other_threads_cpu for p in cpu) * per_event,
            "µs/event",
        )
        report.add(
            WORKLOAD,
            "  ledger: cyclic GC time per event",
            median(p.gc_seconds for p in cpu) * per_event,
            "µs/event",
        )
        report.add(WORKLOAD, "  raw sqlite3: wall per event", raw * per_event, "µs/event")
        add_memory(
            report,
            cfg,
            WORKLOAD,
            "ledger",
            rss,
            lambda: asyncio.run(ledger_run(tmp / "traced.db", work, cfg.append_concurrency)),
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args(argv)
    from benchmarks.common import table

    cfg = preset(
        "quick",
        reps=args.reps,
        append_sessions=args.sessions,
        append_concurrency=args.concurrency,
        tracemalloc=False,
    )
    report = Report()
    run(cfg, report)
    print(table(report.figures))
    for note in report.notes:
        print(f"note: {note}")
    result = {"figures": [f.as_dict() for f in report.figures], "notes": report.notes}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
