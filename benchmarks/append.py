"""Append throughput on a SQLite file: the public recorder API vs raw sqlite3 on identical rows.

Workload: N sessions, all in flight at once (bounded by --concurrency), each
created+started -> 1..3 trajectories of 256..4096 tokens -> reward -> complete, through
`Ledger.session`. Baseline: the very rows the ledger wrote, re-inserted with raw `sqlite3`
`executemany` in one transaction into a fresh copy of the schema (the floor no ORM beats).

    python -m benchmarks.append --sessions 2000 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from sessions import Ledger


def plan(sessions: int, seed: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(sessions):
        trajectories = []
        for _ in range(int(rng.integers(1, 4))):
            total = int(rng.integers(256, 4097))
            prompt_len = max(16, total // 4)
            trajectories.append((rng.integers(0, 32000, prompt_len, dtype=np.int32), rng.integers(0, 32000, total - prompt_len, dtype=np.int32)))
        out.append(trajectories)
    return out


async def ledger_run(path: Path, work: list, concurrency: int) -> tuple[float, int, int]:
    limit = asyncio.Semaphore(concurrency)
    async with Ledger.open(f"sqlite+aiosqlite:///{path}", run="bench") as ledger:
        async def one(i: int) -> None:
            async with limit:
                async with ledger.session(f"s{i}", uid=f"u{i // 4}", session_index=i % 4, group_size=4, partition="train", global_step=0) as s:
                    for prompt, response in work[i]:
                        await s.record_trajectory(prompt_ids=prompt, response_ids=response)
                    await s.post_reward(1.0)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(work))))
        elapsed = time.perf_counter() - start
        events = ledger.store.events_committed
    tokens = sum(len(p) + len(r) for t in work for p, r in t)
    return elapsed, events, tokens


def raw_sqlite(source: Path, target: Path) -> float:
    src = sqlite3.connect(source)
    schema = src.execute("SELECT sql FROM sqlite_master WHERE name = 'events'").fetchone()[0]
    rows = src.execute(
        "SELECT event_id, session_id, version, type, schema_version, run, uid, partition, global_step, data, payload, recorded_at FROM events ORDER BY position"
    ).fetchall()
    src.close()
    dst = sqlite3.connect(target, isolation_level=None)
    dst.execute("PRAGMA journal_mode=WAL")
    dst.execute("PRAGMA synchronous=NORMAL")
    dst.execute(schema)
    start = time.perf_counter()
    dst.execute("BEGIN")
    dst.executemany(
        "INSERT INTO events (event_id, session_id, version, type, schema_version, run, uid, partition, global_step, data, payload, recorded_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        rows,
    )
    dst.execute("COMMIT")
    elapsed = time.perf_counter() - start
    dst.close()
    return elapsed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args(argv)
    work = plan(args.sessions, seed=0)
    ledger_times, raw_times = [], []
    events = tokens = 0
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            db = Path(tmp) / "ledger.db"
            elapsed, events, tokens = asyncio.run(ledger_run(db, work, args.concurrency))
            ledger_times.append(elapsed)
            raw_times.append(raw_sqlite(db, Path(tmp) / "raw.db"))
    ledger_s, raw_s = statistics.median(ledger_times), statistics.median(raw_times)
    result = {
        "machine": f"{platform.machine()} {platform.python_implementation()} {platform.python_version()}",
        "sessions": args.sessions, "events": events, "tokens": tokens, "reps": args.reps,
        "ledger_events_per_s": events / ledger_s, "ledger_tokens_per_s": tokens / ledger_s,
        "raw_sqlite3_events_per_s": events / raw_s, "ratio_to_raw_sqlite3": raw_s / ledger_s,
    }
    print(f"append, SQLite file, {args.sessions} sessions / {events} events / {tokens} tokens, median of {args.reps}")
    print(f"  ledger (public API, group commit): {result['ledger_events_per_s']:>10,.0f} events/s {result['ledger_tokens_per_s']:>14,.0f} tokens/s")
    print(f"  raw sqlite3 executemany (floor):   {result['raw_sqlite3_events_per_s']:>10,.0f} events/s")
    print(f"  ratio ledger / raw sqlite3:        {result['ratio_to_raw_sqlite3']:.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
