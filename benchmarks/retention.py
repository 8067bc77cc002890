"""Retention at scale (issue 28): a long run grown step by step under a keep-last-K policy.

    python -m benchmarks.retention --steps 1000 --keep-last 50            # the issue's run
    python -m benchmarks.retention --steps 60 --keep-last 10 --prompts 8  # a quick one

Grows one run of `--prompts` groups of `--group-size` demo sessions a step (train and val) in a
fresh SQLite file (or `--db URL`) with `RetentionPolicy(keep_last_steps=K)`, `--prune-every`
steps at a time (`demo --start-step`'s path), pruning by the recorded policy after each chunk, as
a long run would. The size budget is what the policy promises: payloads of at most
K + prune-every steps, every other step down to its tombstones. Prints the database in use per
chunk (peak, final, and the unpruned size of the first chunk scaled to the run), the payload
bytes held against the budget, the audit's result, time and peak RSS, and whether every step's
metrics and report figures of a replay into a fresh database equal the live ones (the pruned
steps' batches excepted: asking for one is `BatchPruned`).

Also `--audit-only URL`: audit an existing ledger and print its peak RSS (run it in a fresh process
per size to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _figures(ledger: Any, run: str) -> tuple[dict[tuple[Any, ...], float], Any, Any]:
    """Every step's metric counts and the report's per-step tables of the run."""
    from sessions.report.data import gather

    rows = await ledger.metrics(run=run)
    counts = {(m.partition, m.global_step, m.data_source, m.metric): m.value for m in rows}
    page = await gather(ledger.engine, run)
    return counts, page.tables, page.stepless


async def _payload_steps(ledger: Any, run: str, pruned: set[int]) -> tuple[list[int], int, int]:
    """(steps not pruned, their payload bytes, the largest one step holds)."""
    from store import retention as sql

    held: set[int] = set()
    total = largest = 0
    async with ledger.engine.connect() as conn:
        for partition in ("train", "val"):
            for step, _open, size in await sql.step_sizes(conn, run, partition):
                if step not in pruned:
                    held.add(step)
                    total += size
                    largest = max(largest, size)
    return sorted(held), total, largest


async def _run(args: argparse.Namespace) -> None:
    from sessions import BatchPruned, Ledger, RetentionPolicy, prune
    from sessions.audit.auditing import audit
    from sessions.audit.replay import replay
    from sessions.cli.demo import DemoConfig, run_demo
    from store import create_engine, upgrade
    from store import retention as sql

    folder = tempfile.mkdtemp(prefix="rl-retention-")
    url = args.db or f"sqlite+aiosqlite:///{Path(folder) / 'ledger.db'}"
    replica_url = args.replica or f"sqlite+aiosqlite:///{Path(folder) / 'replica.db'}"
    policy = RetentionPolicy(keep_last_steps=args.keep_last)
    started = time.perf_counter()
    sizes: list[int] = []
    first_chunk = pruned_events = pruned_bytes = 0
    pruned_steps: set[int] = set()
    async with Ledger.open(url, run="long", retention=policy) as ledger:
        for start in range(0, args.steps, args.prune_every):
            steps = min(args.prune_every, args.steps - start)
            # The chunk's steps side by side: each demo step waits out its timed-out sessions,
            # which is wall time, not work (one step at a time, 1,000 steps took half an hour).
            await asyncio.gather(
                *(
                    run_demo(
                        ledger,
                        DemoConfig(
                            steps=1, prompts=args.prompts, group_size=args.group_size, start_step=s
                        ),
                    )
                    for s in range(start, start + steps)
                )
            )
            await ledger.project()
            if start == 0:
                first_chunk = await sql.database_bytes(ledger.engine)
            report = await prune(ledger, run="long", policy=True)
            pruned_events += report.events
            pruned_bytes += report.payload_bytes
            pruned_steps.update(report.pruned_steps)
            sizes.append(await sql.database_bytes(ledger.engine))
            print(
                f"  steps {start}-{start + steps - 1}: {sizes[-1]:,} bytes in use, pruned "
                f"{len(report.pruned_steps)} steps ({report.payload_bytes:,} payload bytes)",
                flush=True,
            )
        recorded = time.perf_counter() - started
        held, held_bytes, largest = await _payload_steps(ledger, "long", pruned_steps)
        t0 = time.perf_counter()
        checked = await audit(ledger.engine)
        audit_s = time.perf_counter() - t0
        live = await _figures(ledger, "long")
        replica = create_engine(replica_url)
        try:
            await upgrade(replica)
            t0 = time.perf_counter()
            await replay(ledger.engine, replica)
            replay_s = time.perf_counter() - t0
        finally:
            await replica.dispose()
    async with Ledger.open(replica_url, run="long", retention=policy) as again:
        replayed = await _figures(again, "long")
        try:
            await again.batch("train", 0)
            pruned_batch = "returned a batch (WRONG: step 0 was pruned)"
        except BatchPruned as error:
            pruned_batch = f"BatchPruned: {error}"
    on_disk = os.path.getsize(Path(folder) / "ledger.db") if args.db is None else float("nan")
    budget_steps = args.keep_last + args.prune_every
    print(
        f"steps {args.steps} x {args.prompts} groups x {args.group_size} (train and val), "
        f"keep the last {args.keep_last}, prune every {args.prune_every}: recorded in "
        f"{recorded:.1f}s, {checked.events} events, {checked.sessions} sessions"
    )
    scaled = first_chunk * args.steps / min(args.prune_every, args.steps)
    print(
        f"database in use: peak {max(sizes):,} bytes, final {sizes[-1]:,} (file {on_disk:,} "
        f"on disk); unpruned, the first chunk scaled to the run: {scaled:,.0f}"
    )
    growth = sorted(b - a for a, b in zip(sizes, sizes[1:]))
    if growth:
        print(
            f"growth per chunk of {args.prune_every} steps after pruning: median "
            f"{growth[len(growth) // 2]:,} bytes (min {growth[0]:,}, max {growth[-1]:,}); the "
            f"first chunk unpruned: {first_chunk:,} (what stays is the log without payloads: "
            "events, sessions, metrics)"
        )
    print(
        f"payloads held: {len(held)} steps per partition at most {budget_steps} "
        f"(policy {args.keep_last} + prune-every {args.prune_every}): "
        f"{'within' if len(held) <= budget_steps else 'OVER'} budget; {held_bytes:,} bytes "
        f"(<= 2 partitions x {budget_steps} steps x the largest step's {largest:,}: "
        f"{'yes' if held_bytes <= 2 * budget_steps * largest else 'NO'}); pruned "
        f"{len(pruned_steps)} steps, {pruned_events:,} payloads, {pruned_bytes:,} bytes"
    )
    print(
        f"audit: {'passed' if checked.ok else 'FAILED'} in {audit_s:.2f}s "
        f"({len(checked.divergences)} divergences); peak RSS {_peak_rss_mb():.0f} MB"
    )
    same = [name for name, a, b in zip(("metrics", "report", "stepless"), live, replayed) if a == b]
    print(
        f"replay in {replay_s:.1f}s: {len(live[0]):,} metric counts over every step; equal to the "
        f"live ones: {'yes' if len(same) == 3 else 'NO (' + ', '.join(same) + ' equal)'}; "
        f"a pruned step's batch: {pruned_batch}"
    )


async def _audit_only(url: str, memory_sessions: int | None) -> None:
    from sessions.audit.auditing import audit
    from store import create_engine

    engine = create_engine(url)
    try:
        t0 = time.perf_counter()
        report = await audit(engine, memory_sessions=memory_sessions)
        print(
            f"audit (memory bound {memory_sessions} sessions) "
            f"{'passed' if report.ok else 'FAILED'}: {report.events} events, "
            f"{report.sessions} sessions, {time.perf_counter() - t0:.2f}s, peak RSS "
            f"{_peak_rss_mb():.0f} MB"
        )
    finally:
        await engine.dispose()


def _bound(text: str) -> int | None:
    if text == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of sessions >= 0 or none, got {text!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--keep-last", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prune-every", type=int, default=10, metavar="STEPS")
    parser.add_argument("--db", default=None)
    parser.add_argument("--replica", default=None, metavar="URL", help="replay target (empty)")
    parser.add_argument("--audit-only", default=None, metavar="URL")
    parser.add_argument(
        "--memory-sessions",
        type=_bound,
        default=50_000,
        metavar="N|none",
        help="with --audit-only: the audit's memory bound in sessions (none: unbounded)",
    )
    args = parser.parse_args()
    if args.audit_only:
        asyncio.run(_audit_only(args.audit_only, args.memory_sessions))
        return
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
