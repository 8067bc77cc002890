"""Cost curves as the log grows (issue 28): one log grown through 10^4 -> 10^5 -> 10^6 events.

At each size, on SQLite and (if the server answers) PostgreSQL, it times the per-step and
per-session operations on the grown log and reports each as a curve with its log-log slope
(`d log(time) / d log(events)`): work proportional to a step or a session must be flat (≈ 0).

Measured at each size (median of `cfg.reps`, each on the log as grown so far):

* `append one step`   recording one more step of `STEP_SESSIONS` sessions through `Ledger.session`
* `project one step`  `Ledger.project()` of that new step (the projector's pages of it)
* `batch`             `Ledger.batch` of the latest step
* `metrics`           `Ledger.metrics(partition, step)` of one step
* `history`           `session_history` of one session of the latest step (the `history` verb)
* `export-dataset`    `export_dataset` of the latest step to Parquet (needs the `export` extra)
* `recover`           `recover(ledger, 1 h)`: the sweep for sessions left open, over `OPEN`
                      sessions created (and started) at the start and never ended, in a step of
                      their own; none is an hour idle, so the sweep reads them all and fails none
* `report data`       the report's reads of the whole run (`sessions.report.data.gather`): a
                      whole-run read, expected to grow with the run's steps, not to be flat
* `open`              `Ledger.open` + close of the grown database (at every size)
* `db size / session` the database's size over its sessions

The log is grown by the recorder itself (valid events by construction) in steps of small token
arrays; the growth is not what is measured. Sizes: `ROLLOUT_LEDGER_SCALE_MAX` (default 1e6; 1e7 is
the opt-in full-size run) caps the largest size, each size a power of ten from 1e4.

    ROLLOUT_LEDGER_SCALE_MAX=1e5 python -m benchmarks --only scale
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Config, Report, atimed, log, median, scratch_dir

WORKLOAD = "scale"
STEP_SESSIONS = 256
GROUP = 4
TOKENS = 32
#: Sessions left open for `recover` to sweep (their step, `OPEN_STEP`, is no other figure's).
OPEN = 256
OPEN_STEP = 10**9


def sizes() -> list[int]:
    top = float(os.environ.get("ROLLOUT_LEDGER_SCALE_MAX", "1e6"))
    out, size = [], 10_000
    while size <= top:
        out.append(size)
        size *= 10
    return out


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.maximum(np.asarray(ys, float), 1e-9))
    if len(lx) < 2:
        return float("nan")
    return float(np.polyfit(lx, ly, 1)[0])


async def _record_step(ledger: Any, step: int, rng: np.random.Generator) -> None:
    async def one(i: int) -> None:
        uid = f"g{step}x{i // GROUP}"
        async with ledger.session(
            f"s{step}-{i}",
            uid=uid,
            session_index=i % GROUP,
            group_size=GROUP,
            partition="train",
            global_step=step,
        ) as s:
            await s.record_trajectory(
                prompt_ids=rng.integers(0, 32_000, TOKENS, dtype=np.int32),
                response_ids=rng.integers(0, 32_000, TOKENS, dtype=np.int32),
            )
            await s.post_reward(float(i % 2))

    await asyncio.gather(*(one(i) for i in range(STEP_SESSIONS)))


async def _db_bytes(ledger: Any, url: str) -> int:
    if url.startswith("sqlite"):
        path = Path(url.split("///", 1)[1])
        return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
    from sqlalchemy import text

    async with ledger.engine.connect() as conn:
        return int(
            (await conn.execute(text("SELECT pg_database_size(current_database())"))).scalar()
        )


async def curve(url: str, cfg: Config, folder: Path) -> dict[str, list[tuple[int, float]]]:
    from datetime import timedelta

    from sessions import Ledger
    from sessions.audit.history import session_history
    from sessions.report.data import gather
    from sessions.runs.recovery import recover

    try:
        import pyarrow  # noqa: F401 - export_dataset writes Parquet with it

        from sessions.export import export_dataset
    except ImportError:
        export_dataset = None

    rng = np.random.default_rng(cfg.seed)
    out: dict[str, list[tuple[int, float]]] = {}
    step = 0
    async with Ledger.open(url, run="scale") as ledger:
        for i in range(OPEN):
            await ledger.create_session(
                f"open-{i}",
                uid=f"open{i // GROUP}",
                session_index=i % GROUP,
                group_size=GROUP,
                partition="train",
                global_step=OPEN_STEP,
            )
        for target in cfg.scale_sizes or sizes():
            grow_started = time.perf_counter()
            while await ledger.store.last_position() < target:
                await _record_step(ledger, step, rng)
                step += 1
                await ledger.project()
            events = await ledger.store.last_position()
            log(
                f"  {url.split(':')[0]}: grown to {events} events in {time.perf_counter() - grow_started:.1f}s"
            )
            figures: dict[str, list[float]] = {}
            for _ in range(cfg.reps):
                t, _r = await atimed(lambda s=step: _record_step(ledger, s, rng))
                figures.setdefault("append one step (s)", []).append(t)
                t, _r = await atimed(ledger.project)
                figures.setdefault("project one step (s)", []).append(t)
                t, _r = await atimed(lambda s=step: ledger.batch("train", s))
                figures.setdefault("batch of the latest step (s)", []).append(t)
                t, _r = await atimed(lambda s=step: ledger.metrics("train", s, project=False))
                figures.setdefault("metrics of one step (s)", []).append(t)
                t, _r = await atimed(lambda s=step: session_history(ledger.store, f"s{s}-0"))
                figures.setdefault("history of one session (s)", []).append(t)
                if export_dataset is not None:
                    parquet = folder / f"step{step}.parquet"
                    t, _r = await atimed(
                        lambda s=step, o=parquet: export_dataset(
                            ledger, o, partition="train", steps=s
                        )
                    )
                    parquet.unlink(missing_ok=True)
                    figures.setdefault("export-dataset of one step (s)", []).append(t)
                t, failed = await atimed(lambda: recover(ledger, timedelta(hours=1)))
                if failed:
                    raise RuntimeError(f"recover failed {len(failed)} sessions that were not idle")
                figures.setdefault(f"recover, {OPEN} sessions open (s)", []).append(t)
                t, _r = await atimed(lambda: gather(ledger.engine, "scale"))
                figures.setdefault("report data of the whole run (s)", []).append(t)
                started = time.perf_counter()
                async with Ledger.open(url, run="scale"):
                    pass
                figures.setdefault("Ledger.open (s)", []).append(time.perf_counter() - started)
                step += 1
            sessions_now = step * STEP_SESSIONS
            for name, values in figures.items():
                out.setdefault(name, []).append((events, median(values)))
            out.setdefault("db size per session (KB)", []).append(
                (events, await _db_bytes(ledger, url) / sessions_now / 1000)
            )
    return out


def _report(report: Report, backend: str, curves: dict[str, list[tuple[int, float]]]) -> None:
    for name, points in curves.items():
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        for events, value in points:
            report.add(WORKLOAD, f"{backend}: {name} at {events:,} events", value, "")
        if len(points) > 1:
            report.add(WORKLOAD, f"{backend}: {name}: log-log slope", slope(xs, ys), "slope")
        log(
            f"  {backend} {name}: "
            + ", ".join(f"{v:.4g}" for v in ys)
            + (f"  slope {slope(xs, ys):.2f}" if len(points) > 1 else "")
        )


async def _pg_database(admin_url: str, sql: str) -> None:
    import asyncpg
    from sqlalchemy.engine import make_url

    dsn = make_url(admin_url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def run(cfg: Config, report: Report) -> None:
    with scratch_dir(cfg, WORKLOAD) as folder:
        _report(
            report,
            "sqlite",
            asyncio.run(curve(f"sqlite+aiosqlite:///{folder / 'scale.db'}", cfg, folder)),
        )
    from benchmarks import pg

    why = pg.server_answers()
    if why:
        report.note(WORKLOAD, f"PostgreSQL curve skipped: {why}")
        return
    from sqlalchemy.engine import make_url

    name = f"bench_scale_{uuid.uuid4().hex[:8]}"
    asyncio.run(_pg_database(pg.pg_url(), f'CREATE DATABASE "{name}"'))
    try:
        url = (
            make_url(pg.pg_url())
            .set(drivername="postgresql+asyncpg", database=name)
            .render_as_string(hide_password=False)
        )
        with scratch_dir(cfg, WORKLOAD) as folder:
            _report(report, "postgres", asyncio.run(curve(url, cfg, folder)))
    finally:
        asyncio.run(_pg_database(pg.pg_url(), f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
