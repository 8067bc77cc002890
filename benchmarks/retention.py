"""Retention at scale (issue 28): a long run with a keep-last-K policy, pruned, then audited.

    python -m benchmarks.retention --steps 1000 --keep-last 50            # the issue's run
    python -m benchmarks.retention --steps 60 --keep-last 10 --prompts 8  # a quick one

Records `--steps` steps of `--prompts` groups of `--group-size` demo sessions into a fresh SQLite
file (or `--db URL`) with `RetentionPolicy(keep_last_steps=K)`, prunes by the recorded policy;
prints the database size before and after, the
file's size on disk, the audit's result and time, the metrics compared before and after the
audit, and this process's peak RSS. Also `--audit-only URL`: audit an existing ledger and print its
peak RSS (run it in a fresh process per size to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import tempfile
import time
from pathlib import Path


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _metrics(ledger: object, run: str) -> dict[tuple[object, ...], float]:
    rows = await ledger.metrics(run=run)  # type: ignore[attr-defined]
    return {(m.partition, m.global_step, m.data_source, m.metric): m.value for m in rows}


async def _run(args: argparse.Namespace) -> None:
    from sessions import Ledger, RetentionPolicy, prune
    from sessions.audit.auditing import audit
    from sessions.cli.demo import DemoConfig, run_demo
    from store import retention as sql

    folder = tempfile.mkdtemp(prefix="rl-retention-")
    url = args.db or f"sqlite+aiosqlite:///{Path(folder) / 'ledger.db'}"
    policy = RetentionPolicy(keep_last_steps=args.keep_last)
    started = time.perf_counter()
    async with Ledger.open(url, run="long", retention=policy) as ledger:
        # One demo run: it cannot extend a run at a later step yet (issue 28's `demo
        # --start-step`), so the run is recorded whole and pruned by its policy once.
        await run_demo(
            ledger, DemoConfig(steps=args.steps, prompts=args.prompts, group_size=args.group_size)
        )
        await ledger.project()
        unpruned = await sql.database_bytes(ledger.engine)
        pruned = None
        if not args.no_prune:
            t0 = time.perf_counter()
            pruned = await prune(ledger, run="long", policy=True)
            prune_s = time.perf_counter() - t0
        recorded = time.perf_counter() - started
        size = await sql.database_bytes(ledger.engine)
        before = await _metrics(ledger, "long")
        t0 = time.perf_counter()
        report = await audit(ledger.engine)
        audit_s = time.perf_counter() - t0
        after = await _metrics(ledger, "long")
        async with ledger.engine.connect() as conn:
            sizes = await sql.step_sizes(conn, "long", "train")
    on_disk = os.path.getsize(Path(folder) / "ledger.db") if args.db is None else float("nan")
    kept = [s for s, _o, b in sizes if b > 0]
    print(
        f"steps {args.steps} x {args.prompts} groups x {args.group_size}: recorded in "
        f"{recorded:.1f}s, {report.events} events, {report.sessions} sessions"
    )
    print(f"database in use before pruning: {unpruned} bytes")
    if pruned is not None:
        print(
            f"pruned {len(pruned.pruned_steps)} steps in {prune_s:.1f}s: {pruned.events} payloads, "
            f"{pruned.payload_bytes} payload bytes, {pruned.queue_rows} queue rows, "
            f"{pruned.pages_freed} pages freed"
        )
    print(f"after the last prune: {size} bytes in use, file {on_disk} bytes on disk")
    print(f"steps with payload bytes (tombstones count): {len(kept)}")
    print(
        f"audit: {'passed' if report.ok else 'FAILED'} in {audit_s:.2f}s "
        f"({len(report.divergences)} divergences); metrics equal after audit: {before == after}"
    )
    print(f"peak RSS of this process: {_peak_rss_mb():.0f} MB")


async def _audit_only(url: str) -> None:
    from sessions.audit.auditing import audit
    from store import create_engine

    engine = create_engine(url)
    try:
        t0 = time.perf_counter()
        report = await audit(engine)
        print(
            f"audit {'passed' if report.ok else 'FAILED'}: {report.events} events, "
            f"{report.sessions} sessions, {time.perf_counter() - t0:.2f}s, peak RSS "
            f"{_peak_rss_mb():.0f} MB"
        )
    finally:
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--keep-last", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--no-prune", action="store_true")
    parser.add_argument("--db", default=None)
    parser.add_argument("--audit-only", default=None, metavar="URL")
    args = parser.parse_args()
    if args.audit_only:
        asyncio.run(_audit_only(args.audit_only))
        return
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
