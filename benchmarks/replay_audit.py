"""Replay and audit over a recorded log.

The log (sessions of the append workload's token sizes over several steps of `train` and `val`,
a share of them failed with placeholders) is recorded once through the public API into a
template file and projected there; every repetition copies the template.

* `sessions.audit.replay.replay(source, target)`: copy the events into a fresh, migrated SQLite file
  (migration not timed) and build the read models there from scratch. Besides the end-to-end
  figure, its three steps get rows of their own, since different things bound them: the copy
  (SQLite writing the rows, indexes and token payloads) and, at the same time, the fold of the
  log into read-model rows (Python, per event), each timed from the replay's start; then the
  insert of those rows and the commit.
* `sessions.audit.audit(engine)`: check the log, fold it into read models in memory and compare
  every read model and queue row with the stored ones (it must find no divergence).

Each is run twice per repetition, in alternating order: as a user runs it (the default workers,
`sessions.audit.parallel_fold.workers_for`: one process on fewer than 3 cores) and with the fold
in two worker processes (`workers=2`), so their ratio is a same-run, same-load pair; beside each,
the CPU seconds of the calling process and of its fold workers.

Targets (issue 44): replay >= 100,000 and audit >= 80,000 events/s on the `--full` log (~100k
events). Their MB/s of token payloads are set against the disk's write speed, measured in the same run
(`benchmarks.common.disk_write_speed`: write + fdatasync a file of `disk_mib` MiB in the scratch
folder, median of 3) — a replay must write those bytes again, so the disk bounds it.
"""

from __future__ import annotations

import asyncio
import resource
import sqlite3
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Config,
    Report,
    RssProbe,
    add_memory,
    copy_db,
    disk_write_speed,
    log,
    median,
    scratch_dir,
)
from benchmarks.workload import layout_for, plan, tokens_of

WORKLOAD = "replay/audit"


def _children_cpu() -> float:
    """CPU seconds of this process's ended children (the fold's workers, once joined)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


async def replay_once(
    source: Path, target: Path, workers: int | None = None, cpu: list[Any] | None = None
) -> tuple[float, Any]:
    from sessions.audit.replay import replay
    from store import create_engine
    from store.schema.migrate import upgrade

    src, dst = (
        create_engine(f"sqlite+aiosqlite:///{source}"),
        create_engine(f"sqlite+aiosqlite:///{target}"),
    )
    try:
        await upgrade(dst)
        own, children = time.process_time(), _children_cpu()
        start = time.perf_counter()
        result = await replay(src, dst, workers=workers)
        elapsed = time.perf_counter() - start
        if cpu is not None:
            cpu.append((time.process_time() - own, _children_cpu() - children))
    finally:
        await src.dispose()
        await dst.dispose()
    return elapsed, result


async def audit_once(
    db: Path, workers: int | None = None, cpu: list[Any] | None = None
) -> tuple[float, int]:
    from sessions.audit.auditing import audit
    from store import create_engine

    engine = create_engine(f"sqlite+aiosqlite:///{db}")
    try:
        own, children = time.process_time(), _children_cpu()
        start = time.perf_counter()
        result = await audit(engine, workers=workers)
        elapsed = time.perf_counter() - start
        if cpu is not None:
            cpu.append((time.process_time() - own, _children_cpu() - children))
    finally:
        await engine.dispose()
    if not result.ok:
        raise AssertionError(
            f"audit found divergences in an untouched log: {result.divergences[0]}"
        )
    return elapsed, result.events


def _payload_bytes(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(
            conn.execute("SELECT coalesce(sum(length(payload)), 0) FROM events").fetchone()[0]
        )
    finally:
        conn.close()


def _overlap(report: Report, walls: list[float], parts: list[Any]) -> None:
    """Whether the copy and the fold overlap (issue 30), per repetition: the replay's wall time
    beside the sum of its three steps (no overlap at all) and beside the slower of copy and fold
    plus the insert (perfect overlap), and the share of the shorter step hidden behind the other
    (1: all of it, 0: none)."""
    serial = [p.copy_seconds + p.fold_seconds + p.write_seconds for p in parts]
    ideal = [max(p.copy_seconds, p.fold_seconds) + p.write_seconds for p in parts]
    hidden = [
        min(1.0, max(0.0, (s - w) / min(p.copy_seconds, p.fold_seconds)))
        if min(p.copy_seconds, p.fold_seconds) > 0
        else 0.0
        for s, w, p in zip(serial, walls, parts)
    ]
    report.add(WORKLOAD, "replay overlap: wall time", median(walls), "s")
    report.add(
        WORKLOAD, "replay overlap: copy + fold + insert (none overlapped)", median(serial), "s"
    )
    report.add(
        WORKLOAD, "replay overlap: max(copy, fold) + insert (fully overlapped)", median(ideal), "s"
    )
    report.add(
        WORKLOAD,
        "replay overlap: share of the shorter of copy and fold hidden behind the other",
        median(hidden),
        "x",
    )


def _baseline(
    report: Report,
    what: str,
    events: int,
    walls: list[float],
    two: list[float],
    cpu: list[Any],
    two_cpu: list[Any],
) -> None:
    """The fold in two worker processes beside the default, their per-repetition ratio, and where
    the CPU went: the calling process (the critical path when the workers keep up) and the
    workers."""
    report.add(
        WORKLOAD,
        f"{what}, fold in two worker processes (workers=2)",
        median(events / w for w in two),
        "events/s",
    )
    report.add(
        WORKLOAD,
        f"ratio {what} workers=2 / default (wall, per repetition)",
        median(w / t for w, t in zip(walls, two)),
        "x",
        kind="ratio",
    )
    for label, pairs in (("default", cpu), ("workers=2", two_cpu)):
        report.add(
            WORKLOAD,
            f"{what} {label}: CPU of the calling process",
            median(p[0] for p in pairs),
            "s",
        )
        workers_cpu = median(p[1] for p in pairs)
        if workers_cpu > 0:  # the default folds in one process on a machine with < 3 cores
            report.add(WORKLOAD, f"{what} {label}: CPU of the fold workers", workers_cpu, "s")


def run(cfg: Config, report: Report) -> None:
    from benchmarks.workload import projected_template

    specs = layout_for(
        cfg.replay_sessions, cfg.group_size, fail_rate=cfg.fail_rate, seed=cfg.seed, prefix="r"
    )
    work = plan(len(specs), seed=cfg.seed + 3)
    tokens = tokens_of(work)
    with scratch_dir(cfg, "replay") as tmp:
        template = tmp / "template.db"
        events = projected_template(template, specs, work, "replay/audit")
        payload_mb = _payload_bytes(template) / 1e6
        replay_s, audit_s, replay_rss, audit_rss = [], [], [], []
        two_replay_s, two_audit_s = [], []
        replay_cpu: list[Any] = []
        two_replay_cpu: list[Any] = []
        audit_cpu: list[Any] = []
        two_audit_cpu: list[Any] = []
        parts: list[Any] = []
        for rep in range(cfg.reps):
            source = tmp / f"source{rep}.db"
            copy_db(template, source)
            # Alternate which goes first, so neither always meets the other's after-effects.
            for workers in (None, 2) if rep % 2 == 0 else (2, None):
                target = tmp / f"target{rep}-{workers}.db"
                if workers is None:
                    with RssProbe() as probe:
                        elapsed, result = asyncio.run(replay_once(source, target, cpu=replay_cpu))
                    replayed = result.events
                    parts.append(result)
                    replay_rss.append(probe)
                    replay_s.append(elapsed)
                else:
                    elapsed, _ = asyncio.run(replay_once(source, target, 2, two_replay_cpu))
                    two_replay_s.append(elapsed)
            for workers in (None, 2) if rep % 2 == 0 else (2, None):
                if workers is None:
                    with RssProbe() as probe:
                        elapsed, audited = asyncio.run(audit_once(source, cpu=audit_cpu))
                    audit_rss.append(probe)
                    audit_s.append(elapsed)
                else:
                    elapsed, _ = asyncio.run(audit_once(source, 2, two_audit_cpu))
                    two_audit_s.append(elapsed)
            for path in tmp.iterdir():
                if path.name != template.name:
                    path.unlink()
            log(
                f"  replay/audit rep {rep + 1}/{cfg.reps}: replay {replayed / replay_s[-1]:,.0f} events/s "
                f"(two workers {replayed / two_replay_s[-1]:,.0f}), "
                f"audit {audited / audit_s[-1]:,.0f} events/s (two workers {audited / two_audit_s[-1]:,.0f})"
            )
        if replayed != events or audited != events:
            report.note(
                WORKLOAD, f"log has {events} events; replay saw {replayed}, audit {audited}"
            )
        disk = disk_write_speed(tmp, cfg.disk_mib) / 1e6
        r, a = median(replay_s), median(audit_s)
        report.add(
            WORKLOAD,
            f"replay into a fresh SQLite file ({events} events, {len(specs)} sessions)",
            replayed / r,
            "events/s",
            target=">= 100,000 events/s",
            goal=(">=", 100_000),
        )
        _baseline(report, "replay", replayed, replay_s, two_replay_s, replay_cpu, two_replay_cpu)
        report.add(WORKLOAD, "replay into a fresh SQLite file", tokens / r, "tokens/s")
        copy_s, fold_s = (
            median([p.copy_seconds for p in parts]),
            median([p.fold_seconds for p in parts]),
        )
        report.add(
            WORKLOAD,
            f"replay step 1: copy of the log ({payload_mb:,.1f} MB of token payloads)",
            replayed / copy_s,
            "events/s",
        )
        report.add(WORKLOAD, "replay step 1: copy of the log", payload_mb / copy_s, "MB/s")
        report.add(
            WORKLOAD,
            "replay step 2: fold of the log into read-model rows (beside step 1)",
            replayed / fold_s,
            "events/s",
        )
        report.add(
            WORKLOAD,
            "replay step 3: insert of the read models and checkpoint, commit",
            median([p.write_seconds for p in parts]),
            "s",
        )
        _overlap(report, replay_s, parts)
        report.add(
            WORKLOAD,
            "audit (check log + fold + compare in memory)",
            audited / a,
            "events/s",
            target=">= 80,000 events/s",
            goal=(">=", 80_000),
        )
        _baseline(report, "audit", audited, audit_s, two_audit_s, audit_cpu, two_audit_cpu)
        report.add(WORKLOAD, "audit", tokens / a, "tokens/s")
        report.add(
            WORKLOAD,
            f"disk write speed (write + fdatasync {cfg.disk_mib} MiB in the scratch folder)",
            disk,
            "MB/s",
        )
        report.add(WORKLOAD, "replay, token payloads", payload_mb / r, "MB/s")
        report.add(WORKLOAD, "audit, token payloads", payload_mb / a, "MB/s")
        report.add(
            WORKLOAD,
            "ratio replay MB/s / disk write speed",
            payload_mb / r / disk,
            "x",
            target="against the disk (<= 1x: the disk bounds it)",
            kind="ratio",
        )
        report.add(
            WORKLOAD,
            "ratio audit MB/s / disk write speed",
            payload_mb / a / disk,
            "x",
            target="against the disk",
            kind="ratio",
        )

        def traced_replay() -> None:
            copy_db(template, tmp / "traced.db")
            asyncio.run(replay_once(tmp / "traced.db", tmp / "traced-target.db"))

        trace = cfg.traced_events_max is None or events <= cfg.traced_events_max
        if cfg.tracemalloc and not trace:
            report.note(
                WORKLOAD,
                f"tracemalloc repetitions skipped above {cfg.traced_events_max:,} events (traced, "
                "replay and audit run 2-3x slower): RSS growth only",
            )
        add_memory(report, cfg, WORKLOAD, "replay", replay_rss, traced_replay if trace else None)
        add_memory(
            report,
            cfg,
            WORKLOAD,
            "audit",
            audit_rss,
            (lambda: asyncio.run(audit_once(template))) if trace else None,
        )
