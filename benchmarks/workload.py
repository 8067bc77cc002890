"""Synthetic rollout sessions shared by the workloads: token plans and recording through the API."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 32_000

#: One session's trajectories: (prompt_ids, response_ids) as int32 arrays.
Work = list[tuple[np.ndarray, np.ndarray]]


def plan(sessions: int, seed: int, *, min_tokens: int = 256, max_tokens: int = 4096) -> list[Work]:
    """Per session 1-3 trajectories of min..max tokens each, a quarter of them prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(sessions):
        trajectories = []
        for _ in range(int(rng.integers(1, 4))):
            total = int(rng.integers(min_tokens, max_tokens + 1))
            prompt_len = max(16, total // 4)
            trajectories.append(
                (
                    rng.integers(0, VOCAB, prompt_len, dtype=np.int32),
                    rng.integers(0, VOCAB, total - prompt_len, dtype=np.int32),
                )
            )
        out.append(trajectories)
    return out


def tokens_of(work: list[Work]) -> int:
    return sum(len(p) + len(r) for trajectories in work for p, r in trajectories)


@dataclass(frozen=True)
class Spec:
    session_id: str
    uid: str
    session_index: int
    group_size: int
    partition: str
    global_step: int
    fails: bool = False


def layout(
    steps: int,
    uids: int,
    group_size: int,
    *,
    partitions: tuple[str, ...] = ("train",),
    fail_rate: float = 0.0,
    seed: int = 0,
    prefix: str = "b",
) -> list[Spec]:
    """steps x partitions x uids groups of `group_size` sessions; a `fail_rate` share fail."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for step in range(steps):
        for partition in partitions:
            for g in range(uids):
                uid = f"{prefix}{partition[0]}{step}x{g}"
                for i in range(group_size):
                    out.append(
                        Spec(
                            f"{uid}-{i}",
                            uid,
                            i,
                            group_size,
                            partition,
                            step,
                            bool(rng.random() < fail_rate),
                        )
                    )
    return out


def layout_for(
    sessions: int,
    group_size: int,
    *,
    partitions: tuple[str, ...] = ("train", "val"),
    fail_rate: float = 0.0,
    seed: int = 0,
    prefix: str = "b",
) -> list[Spec]:
    """About `sessions` sessions in groups, spread over steps of 64 groups per partition."""
    groups = max(1, sessions // group_size)
    per_step = min(64, groups)
    steps = max(1, -(-groups // (per_step * len(partitions))))
    return layout(
        steps,
        per_step,
        group_size,
        partitions=partitions,
        fail_rate=fail_rate,
        seed=seed,
        prefix=prefix,
    )[: max(sessions, group_size)]


class SimulatedFailure(RuntimeError):
    """Raised inside a session the workload wants failed (becomes `runner_error` + placeholder)."""


async def record(ledger, specs: list[Spec], work: list[Work], *, concurrency: int = 1000) -> None:
    """Record every spec through `Ledger.session`, up to `concurrency` sessions in flight."""
    limit = asyncio.Semaphore(concurrency)

    async def one(spec: Spec, trajectories: Work) -> None:
        async with limit:
            try:
                async with ledger.session(
                    spec.session_id,
                    uid=spec.uid,
                    session_index=spec.session_index,
                    group_size=spec.group_size,
                    partition=spec.partition,
                    global_step=spec.global_step,
                ) as s:
                    for n, (prompt, response) in enumerate(trajectories):
                        await s.record_trajectory(
                            prompt_ids=prompt, response_ids=response, num_turns=n + 1
                        )
                        if spec.fails:
                            raise SimulatedFailure("simulated runner error")
                    await s.post_reward(1.0 if spec.session_index % 2 == 0 else 0.0)
            except SimulatedFailure:
                pass

    await asyncio.gather(*(one(spec, work[i]) for i, spec in enumerate(specs)))


def projected_template(path: Path, specs: list[Spec], work: list[Work], what: str) -> int:
    """Record and project a log into a new SQLite file whose main file alone then holds it (the
    WAL folded in, so it can be copied per repetition); logs the time under `what`; the event count."""
    from benchmarks.common import checkpoint_sqlite, log

    started = time.perf_counter()
    events = asyncio.run(record_template(path, specs, work, project=True))
    checkpoint_sqlite(path)
    log(
        f"  {what}: recorded and projected {len(specs)} sessions / {events} events in {time.perf_counter() - started:.1f}s"
    )
    return events


async def record_template(
    path: Path, specs: list[Spec], work: list[Work], *, project: bool, run: str = "bench"
) -> int:
    """Record a log into a new SQLite file (optionally projected); returns the event count."""
    from sessions import Ledger

    async with Ledger.open(f"sqlite+aiosqlite:///{path}", run=run) as ledger:
        await record(ledger, specs, work)
        if project:
            await ledger.project()
        return await ledger.store.last_position()
