"""Per-session overhead of the recorder inside an asyncio loop of simulated rollouts.

N sessions run concurrently on one loop; each awaits 3 "model turns" (`asyncio.sleep` of
1-5 ms, drawn once so both variants sleep identically), then ends. With the ledger each session
runs inside `ledger.session(...)` and records one trajectory (256 prompt + 768 response tokens,
num_turns=3) and a reward before completing: 5 events in 2 appends on a SQLite file (the session
context stages the trajectory and the reward for its end's append, docs/design.md §8). Without it
the loop only sleeps. Overhead per session = (wall with ledger - wall without) / N, the
amortised cost the recorder adds to a training loop's rollout phase.

Baseline, in the same run (issue 18): what a user does instead of recording — the same loop, the
same sessions (the same token arrays, the same count), each ending with `json.dumps` of the
session (ids, tokens as lists, reward, info) and a write of that line to one JSONL file, on the
event loop's thread. Its cost is timed around the dump+write of every session (plus opening and
closing the file) rather than as a wall-clock difference, so it stays positive and free of the
sleeps' jitter; µs per session.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import numpy as np

from benchmarks.common import (
    Config,
    CpuProbe,
    Report,
    RssProbe,
    add_memory,
    log,
    median,
    scratch_dir,
)

WORKLOAD = "overhead"
T = TypeVar("T")
#: Repetitions at least (each about a second at 1,000 sessions).
MIN_REPS = 7
TURNS = 3


def draw(sessions: int, seed: int) -> tuple[list[list[float]], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed + 4)
    sleeps = [list(rng.uniform(0.001, 0.005, TURNS)) for _ in range(sessions)]
    prompt = rng.integers(0, 32_000, 256, dtype=np.int32)
    response = rng.integers(0, 32_000, 768, dtype=np.int32)
    return sleeps, prompt, response


async def plain_loop(sleeps: list[list[float]], probe: CpuProbe | None = None) -> float:
    """Wall seconds of the loop without the ledger; `probe`, if given, measures the same span."""

    async def one(turns: list[float]) -> None:
        for delay in turns:
            await asyncio.sleep(delay)

    with probe or contextlib.nullcontext():
        start = time.perf_counter()
        await asyncio.gather(*(one(turns) for turns in sleeps))
        return time.perf_counter() - start


async def ledger_loop(
    db: Path,
    sleeps: list[list[float]],
    prompt: np.ndarray,
    response: np.ndarray,
    probe: CpuProbe | None = None,
) -> tuple[float, int]:
    """(wall seconds, events) for the loop with the ledger; `probe`, if given, measures the same
    span (CPU by thread, garbage collections)."""
    from sessions import Ledger

    async with Ledger.open(f"sqlite+aiosqlite:///{db}", run="bench") as ledger:

        async def one(i: int, turns: list[float]) -> None:
            async with ledger.session(
                f"o{i}",
                uid=f"o{i // 4}",
                session_index=i % 4,
                group_size=4,
                partition="train",
                global_step=0,
            ) as s:
                for delay in turns:
                    await asyncio.sleep(delay)
                await s.record_trajectory(prompt_ids=prompt, response_ids=response, num_turns=TURNS)
                await s.post_reward(1.0)

        with probe or contextlib.nullcontext():
            start = time.perf_counter()
            await asyncio.gather(*(one(i, turns) for i, turns in enumerate(sleeps)))
            elapsed = time.perf_counter() - start
        events = ledger.store.events_committed
    return elapsed, events


async def jsonl_loop(
    path: Path, sleeps: list[list[float]], prompt: np.ndarray, response: np.ndarray
) -> float:
    """Seconds spent dumping and writing every session as one JSONL line (the baseline); the loop
    around it sleeps as the ledger's does."""
    spent = 0.0
    start = time.perf_counter()
    f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed below, its time counted
    spent += time.perf_counter() - start
    try:

        async def one(i: int, turns: list[float]) -> None:
            nonlocal spent
            for delay in turns:
                await asyncio.sleep(delay)
            t0 = time.perf_counter()
            f.write(
                json.dumps(
                    {
                        "session_id": f"o{i}",
                        "uid": f"o{i // 4}",
                        "session_index": i % 4,
                        "group_size": 4,
                        "partition": "train",
                        "global_step": 0,
                        "prompt_ids": prompt.tolist(),
                        "response_ids": response.tolist(),
                        "reward": 1.0,
                        "info": {"num_turns": TURNS},
                    }
                )
                + "\n"
            )
            spent += time.perf_counter() - t0

        await asyncio.gather(*(one(i, turns) for i, turns in enumerate(sleeps)))
    finally:
        t0 = time.perf_counter()
        f.close()
        spent += time.perf_counter() - t0
    return spent


async def _frozen(loop: Awaitable[T]) -> T:
    """Run `loop` with the heap as it is now moved out of the collector's sight (gc.freeze)."""
    gc.collect()
    gc.freeze()
    try:
        return await loop
    finally:
        gc.unfreeze()


def run(cfg: Config, report: Report) -> None:
    n = cfg.overhead_sessions
    sleeps, prompt, response = draw(n, cfg.seed)
    from benchmarks.append import ledger_rows, raw_sqlite

    # A repetition takes about a second, and whether a full garbage collection lands in it moves
    # the figure by half: take the median of more of them than the other workloads do.
    reps = max(cfg.reps, MIN_REPS)
    # What a full collection scans: the heap this process holds before the loop (in one process
    # after other workloads, what they left; in a process of its own, the imports), counted
    # without a clock, so a run under load still shows which it was.
    gc.collect()
    report.add(
        WORKLOAD,
        "  objects the collector tracks when the workload starts (its process's heap)",
        len(gc.get_objects()),
        "objects",
    )
    plain_s, plain_probes, ledger_s, probes, floor_s, jsonl_s, rss = [], [], [], [], [], [], []
    with scratch_dir(cfg, WORKLOAD) as tmp:
        for rep in range(reps):
            plain_probes.append(CpuProbe())
            plain_s.append(asyncio.run(plain_loop(sleeps, plain_probes[-1])))
            probes.append(CpuProbe())
            with RssProbe() as probe:
                elapsed, events = asyncio.run(
                    ledger_loop(tmp / f"rep{rep}.db", sleeps, prompt, response, probes[-1])
                )
            rss.append(probe)
            ledger_s.append(elapsed)
            # The database's own share: the very rows this loop wrote, re-inserted by raw sqlite3.
            ddl, rows = ledger_rows(tmp / f"rep{rep}.db")
            floor_s.append(raw_sqlite(ddl, rows, tmp / f"floor{rep}.db"))
            jsonl_s.append(
                asyncio.run(jsonl_loop(tmp / f"rep{rep}.jsonl", sleeps, prompt, response))
            )
            log(
                f"  overhead rep {rep + 1}/{reps}: plain {plain_s[-1]:.3f}s, with ledger {elapsed:.3f}s "
                f"(loop thread CPU {probes[-1].loop_cpu:.3f}s; raw sqlite3 insert of its rows {floor_s[-1]:.3f}s; "
                f"JSONL dump {jsonl_s[-1]:.3f}s)"
            )
        plain, led = median(plain_s), median(ledger_s)
        report.add(
            WORKLOAD, f"loop of {n} concurrent sessions without the ledger", plain * 1e3, "ms"
        )
        report.add(WORKLOAD, f"same loop with the ledger ({events} events)", led * 1e3, "ms")
        overhead = (led - plain) / n * 1e6
        if overhead <= 0:
            report.note(
                WORKLOAD,
                f"the ledger loop was not slower than the plain one ({overhead:.1f} µs/session): noise",
            )
        report.add(
            WORKLOAD,
            "recorder overhead per session (amortised)",
            overhead,
            "µs/session",
            target="<= 100 µs/session (moonshot)",
            goal=("<=", 100.0),
        )
        # A full collection of the process's heap lands in some repetitions and not others, so the
        # median flips between the two; the mean counts each collection once over all the sessions.
        report.add(
            WORKLOAD,
            f"  recorder overhead per session, mean of the {reps} repetitions (amortises full collections)",
            (sum(ledger_s) - sum(plain_s)) / (n * reps) * 1e6,
            "µs/session",
        )
        jsonl = median(jsonl_s) / n * 1e6
        report.add(
            WORKLOAD,
            "baseline: json.dumps + write of each session to a JSONL file, per session",
            jsonl,
            "µs/session",
        )
        report.add(
            WORKLOAD,
            "ratio recorder overhead / JSONL-dump baseline (per session)",
            overhead / jsonl,
            "x",
            target="<= 1.5x the JSONL-dump baseline (issue 44)",
            goal=("<=", 1.5),
            kind="ratio",
        )
        report.add(
            WORKLOAD,
            "  event-loop thread CPU added by the ledger, per session",
            (median(p.loop_cpu for p in probes) - median(p.loop_cpu for p in plain_probes))
            / n
            * 1e6,
            "µs/session",
        )
        report.add(
            WORKLOAD,
            "  cyclic GC time in the ledger loop, per session",
            median(p.gc_seconds for p in probes) / n * 1e6,
            "µs/session",
        )
        report.add(
            WORKLOAD,
            "  floor: raw sqlite3 executemany of the same rows (1 txn), per session",
            median(floor_s) / n * 1e6,
            "µs/session",
        )
        # The same loop in a process that froze its start-up heap (gc.freeze(): an application's
        # choice, common in large training processes), so collections set off by the loop's own
        # allocations no longer scan torch's and everything else's objects. Not the headline.
        frozen_s = []
        for rep in range(reps):
            frozen_s.append(
                asyncio.run(
                    _frozen(ledger_loop(tmp / f"frozen{rep}.db", sleeps, prompt, response))
                )[0]
            )
            log(
                f"  overhead rep {rep + 1}/{reps} after gc.freeze(): with ledger {frozen_s[-1]:.3f}s"
            )
        report.add(
            WORKLOAD,
            "  overhead per session with gc.freeze() after set-up (application setting)",
            (median(frozen_s) - plain) / n * 1e6,
            "µs/session",
        )
        add_memory(
            report,
            cfg,
            WORKLOAD,
            "ledger loop",
            rss,
            lambda: asyncio.run(ledger_loop(tmp / "traced.db", sleeps, prompt, response)),
        )
