"""Batch ready when the step ends: from the step's last terminal append to `ledger.batch` returning.

One step of N sessions (4,096 in `--full`; groups of 4, 10% failed with a placeholder, one
256-token prompt + 768-token response trajectory each) is recorded through the public API
(`Ledger.open`, `Ledger.session`: create+start, record_trajectory, post_reward, complete) on a
fresh SQLite file, all sessions in flight, while a projector follows the log in a task of the same
loop (`ledger.projector.follow(stop)`, what `rollout-ledger project --follow` runs; in-process
appends wake it at once). The figure is the time from the last session's terminal append
returning to `ledger.batch("train", 0)` returning the padded batch: what a trainer waits between
the end of the rollout phase and the start of its update.

Baseline, same run: `sessions.batches.build_padded` alone over the same step's BatchRows,
materialised beforehand from the projected file (as benchmarks/projection.py does). Target
(issue 18): the wait <= 1.5x build_padded alone — the ledger's part of the wait (projecting the
last pages, reading the queue rows and their source events) at most half the building.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Config, Report, RssProbe, add_memory, log, median, scratch_dir
from benchmarks.workload import SimulatedFailure, layout

WORKLOAD = "batch ready"
PROMPT, RESPONSE = 256, 768


def draw(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed + 5)
    return rng.integers(0, 32_000, PROMPT, dtype=np.int32), rng.integers(
        0, 32_000, RESPONSE, dtype=np.int32
    )


async def step_once(
    db: Path, specs: list, prompt: np.ndarray, response: np.ndarray
) -> tuple[float, float, int, tuple]:
    """(seconds recording the step, seconds from its last terminal append to the batch, batch rows,
    (events, pages, seconds to its last page) the follower projected after the last terminal append,
    and the events still unprojected then — the follower's lag, which `ledger.batch` may finish)."""
    from sessions import Ledger
    from store import read_models as rm

    async with Ledger.open(f"sqlite+aiosqlite:///{db}", run="bench") as ledger:
        stop = asyncio.Event()
        pages: list[
            tuple[float, int, int]
        ] = []  # (when the follower finished a page, its events, its last position)
        follower = asyncio.create_task(
            ledger.projector.follow(
                stop,
                poll_interval=0.05,
                on_page=lambda page: pages.append(
                    (time.perf_counter(), page.events, page.last_position)
                ),
            )
        )
        last_terminal = 0.0

        async def one(spec) -> None:
            nonlocal last_terminal
            try:
                async with ledger.session(
                    spec.session_id,
                    uid=spec.uid,
                    session_index=spec.session_index,
                    group_size=spec.group_size,
                    partition=spec.partition,
                    global_step=spec.global_step,
                ) as s:
                    await s.record_trajectory(prompt_ids=prompt, response_ids=response, num_turns=1)
                    if spec.fails:
                        raise SimulatedFailure("simulated runner error")
                    await s.post_reward(1.0 if spec.session_index % 2 == 0 else 0.0)
            except SimulatedFailure:
                pass
            last_terminal = max(
                last_terminal, time.perf_counter()
            )  # the terminal append has returned

        try:
            start = time.perf_counter()
            await asyncio.gather(*(one(spec) for spec in specs))
            batch = await ledger.batch("train", 0, timeout=120)
            ready = time.perf_counter()
        finally:
            stop.set()
            await follower
        rows = batch.batch_size[0]
        del batch
        async with ledger.engine.connect() as conn:  # after the timed part
            end = await rm.log_end(conn)
    late = [(t, e) for t, e, _ in pages if last_terminal < t <= ready]
    done = max((p for t, _, p in pages if t <= last_terminal), default=0)
    tail = (
        sum(e for _, e in late),
        len(late),
        (late[-1][0] - last_terminal) if late else 0.0,
        end - done,
    )
    return last_terminal - start, ready - last_terminal, rows, tail


def run(cfg: Config, report: Report) -> None:
    from benchmarks.projection import materialised_rows
    from sessions.batches import build_padded

    n = cfg.batch_ready_sessions
    specs = layout(
        1,
        max(1, n // cfg.group_size),
        cfg.group_size,
        fail_rate=cfg.fail_rate,
        seed=cfg.seed,
        prefix="s",
    )
    prompt, response = draw(cfg.seed)
    record_s, wait_s, build_s, rss, build_rss, tails = [], [], [], [], [], []
    with scratch_dir(cfg, "batch-ready") as tmp:
        for rep in range(cfg.reps):
            db = tmp / f"rep{rep}.db"
            with RssProbe() as probe:
                recorded, waited, n_rows, tail = asyncio.run(step_once(db, specs, prompt, response))
            tails.append(tail)
            rss.append(probe)
            record_s.append(recorded)
            wait_s.append(waited)
            rows = asyncio.run(materialised_rows(db, 1))[
                0
            ]  # the same step's rows (setup: not timed)
            build_padded(rows)  # warm-up, as the ledger's batch had its own first call above
            with RssProbe() as probe:
                start = time.perf_counter()
                build_padded(rows)
                build_s.append(time.perf_counter() - start)
            build_rss.append(probe)
            del rows
            for path in tmp.iterdir():
                path.unlink()
            log(
                f"  batch ready rep {rep + 1}/{cfg.reps}: recorded {len(specs)} sessions in {recorded:.2f}s, "
                f"batch ready {waited * 1e3:.0f} ms after the last terminal append, build_padded alone "
                f"{build_s[-1] * 1e3:.0f} ms"
            )
        wait, build = median(wait_s), median(build_s)
        report.add(
            WORKLOAD,
            f"step of {len(specs)} sessions ({n_rows} rows): recorded with a follower",
            median(record_s),
            "s",
        )
        report.add(WORKLOAD, "last terminal append -> ledger.batch returned", wait * 1e3, "ms")
        report.add(WORKLOAD, "build_padded alone on the same rows", build * 1e3, "ms")
        report.add(
            WORKLOAD,
            "ratio batch-ready wait / build_padded alone",
            wait / build,
            "x",
            target="<= 1.5x",
            goal=("<=", 1.5),
            kind="ratio",
        )
        report.note(
            WORKLOAD,
            "at the last terminal append, events not yet projected / after it the follower projected "
            + "; ".join(
                f"{lag} / "
                + (
                    f"{e} events in {p} page(s), the last done {t * 1e3:.0f} ms after it"
                    if p
                    else "nothing"
                )
                for e, p, t, lag in tails
            )
            + " (per repetition; the rest of the wait is ledger.batch's own project, reads and build)",
        )
        # RSS only: a traced repetition of the whole step would add its recording's time again, slowed
        add_memory(report, cfg, WORKLOAD, "step recorded + batch", rss, None)
        add_memory(report, cfg, WORKLOAD, "build_padded", build_rss, None)
