"""Append throughput on PostgreSQL with 1, 4 and 8 writer processes, against raw asyncpg.

Each writer process opens its own `Ledger` and runs many sessions concurrently through the public
API — create (SessionCreated + SessionStarted) -> record_trajectory (a 256-token prompt and a
512-token response by default) -> post_reward -> complete: 5 events in 4 appends per session.
A configuration is timed from a common start signal (after every process has imported the
library and opened its ledger) until the last process is done; `--sessions` sessions in all
are split evenly across the processes. Each repetition runs on a fresh database; the figure is
the median of the repetitions.

Baseline, in the same run: the rows the ledger wrote (the events table of a 1-writer repetition,
read back byte for byte) inserted again by one process with raw asyncpg into a fresh, migrated
database — `copy_records_to_table` and `executemany` of the same INSERT, one transaction each —
the floor for what any PostgreSQL writer of these rows can do. `measure(..., copy_baseline=True)`
(what the suite's pg workload asks for its largest writer count) also times the same rows split
into `writers` shares and COPYed by as many processes at once, each with its own connection, from
a common start signal — issue 18's bar for the ledger's writer processes (>= 0.5x of it). The
command below prints it too, for the largest `--writers` count.

    python -m benchmarks.pg_append --sessions 2000 --reps 3 --json pg_append.json

The server is taken from ROLLOUT_LEDGER_BENCH_PG (or ROLLOUT_LEDGER_TEST_PG), by default the
local test server `postgresql://postgres@127.0.0.1:5432/test`; databases named
`rl_bench_<random>` are created there and dropped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import queue as queue_module
import statistics
import sys
import time
import uuid
from typing import Any

DEFAULT_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/test"
EVENTS_PER_SESSION = 5
COLUMNS = (
    "event_id",
    "session_id",
    "version",
    "type",
    "schema_version",
    "run",
    "uid",
    "partition",
    "global_step",
    "data",
    "payload",
    "recorded_at",
)


# ------------------------------------------------------------------------------ databases
def admin_url() -> str:
    return (
        os.environ.get("ROLLOUT_LEDGER_BENCH_PG")
        or os.environ.get("ROLLOUT_LEDGER_TEST_PG")
        or DEFAULT_ADMIN_URL
    )


def _dsn(url: str, database: str | None = None) -> str:
    from sqlalchemy.engine import make_url

    parsed = make_url(url).set(drivername="postgresql")
    if database:
        parsed = parsed.set(database=database)
    return parsed.render_as_string(hide_password=False)


async def _admin(url: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(_dsn(url), timeout=10)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def create_database(url: str) -> tuple[str, str]:
    """A fresh, migrated database; returns (name, async SQLAlchemy URL)."""
    from sqlalchemy.engine import make_url

    from store import create_engine, upgrade

    name = f"rl_bench_{uuid.uuid4().hex[:10]}"
    await _admin(url, f'CREATE DATABASE "{name}"')
    target = (
        make_url(_dsn(url, name))
        .set(drivername="postgresql+asyncpg")
        .render_as_string(hide_password=False)
    )
    engine = create_engine(target)
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()
    return name, target


async def drop_database(url: str, name: str) -> None:
    await _admin(url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _count(target: str) -> tuple[int, int]:
    import asyncpg

    conn = await asyncpg.connect(_dsn(target))
    try:
        # the sessions' events (the run's configuration fingerprint is one more, in a stream of its own)
        row = await conn.fetchrow(
            "SELECT count(*), count(DISTINCT session_id) FROM events WHERE type <> 'RunConfigured'"
        )
        return int(row[0]), int(row[1])
    finally:
        await conn.close()


# -------------------------------------------------------------------------- the writers
def writer_process(
    url: str,
    index: int,
    sessions: int,
    concurrency: int,
    prompt_tokens: int,
    response_tokens: int,
    go: Any,
    queue: Any,
) -> None:
    """One writer process: its own Ledger, `sessions` sessions, `concurrency` of them in flight."""
    try:
        result = asyncio.run(
            _write(url, index, sessions, concurrency, prompt_tokens, response_tokens, go, queue)
        )
        queue.put(("done", index, result))
    except BaseException as error:  # noqa: BLE001 - the parent must hear of it
        import traceback

        queue.put(("error", index, f"{error!r}\n{traceback.format_exc()}"))


async def _write(
    url: str,
    index: int,
    sessions: int,
    concurrency: int,
    prompt_tokens: int,
    response_tokens: int,
    go: Any,
    queue: Any,
) -> dict[str, Any]:
    import numpy as np

    from sessions import Ledger

    rng = np.random.default_rng(index)
    prompt = rng.integers(0, 32_000, prompt_tokens, dtype=np.int64)
    response = rng.integers(0, 32_000, response_tokens, dtype=np.int64)
    mask = np.ones(response_tokens, dtype=np.uint8)
    mask[response_tokens // 2 : response_tokens // 2 + response_tokens // 8] = (
        0  # a tool-output span
    )
    limit = asyncio.Semaphore(concurrency)

    # `config`: the run's fingerprint is checked (and recorded by the first writer) as it opens,
    # before the timed appends; its event is not counted among them
    async with Ledger.open(
        url, migrate=False, run="bench", config={"benchmark": "pg_append"}
    ) as ledger:
        fingerprint_events, fingerprint_batches = (
            ledger.store.events_committed,
            ledger.store.batches_committed,
        )

        async def one(i: int) -> None:
            async with limit:
                handle = await ledger.create_session(
                    f"b{index}-{i}",
                    uid=f"w{index}u{i // 4}",
                    session_index=i % 4,
                    group_size=4,
                    partition="train",
                    global_step=0,
                    data_source="bench",
                )
                await handle.record_trajectory(
                    prompt_ids=prompt, response_ids=response, response_mask=mask, num_turns=2
                )
                await handle.post_reward(float(i % 2), acc=float(i % 2))
                await handle.complete()

        holds = getattr(ledger.store, "lock_holds", None)
        holds_before = len(holds) if holds is not None else 0
        queue.put(("ready", index, os.getpid()))
        await asyncio.to_thread(go.wait)
        started, cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(one(i) for i in range(sessions)))
        ended, cpu = time.monotonic(), time.process_time() - cpu
        return {
            # seconds each timed group commit held the append lock (EventStore.lock_holds)
            "lock_holds": list(holds)[holds_before:] if holds is not None else [],
            "started": started,
            "ended": ended,
            "sessions": sessions,
            "cpu_seconds": cpu,
            "events": ledger.store.events_committed - fingerprint_events,
            "transactions": ledger.store.batches_committed - fingerprint_batches,
        }


def _collect(q: Any, procs: list[Any], kind: str, count: int, timeout: float) -> dict[int, Any]:
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < count:
        try:
            what, index, body = q.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue_module.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"writers did not report {kind!r} within {timeout:.0f}s"
                ) from None
            dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                raise RuntimeError(f"writer process exited with {dead[0].exitcode}") from None
            continue
        if what == "error":
            raise RuntimeError(f"writer {index} failed: {body}")
        if what == kind:
            got[index] = body
    return got


def _released_together(
    procs: list[Any], q: Any, go: Any, timeout: float
) -> tuple[float, dict[int, Any]]:
    """Start `procs`, wait until each reports ready, release them at once with `go`, and wait for
    each one's "done" report: (the release time, the reports). Any still alive after is killed."""
    for proc in procs:
        proc.start()
    try:
        _collect(q, procs, "ready", len(procs), timeout)
        start = time.monotonic()
        go.set()
        done = _collect(q, procs, "done", len(procs), timeout)
        for proc in procs:
            proc.join(30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return start, done


def run_config(
    target: str,
    writers: int,
    sessions: int,
    *,
    concurrency: int,
    prompt_tokens: int,
    response_tokens: int,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """One repetition: `writers` processes, `sessions` sessions in all, on the database `target`."""
    ctx = multiprocessing.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    shares = [sessions // writers + (1 if i < sessions % writers else 0) for i in range(writers)]
    procs = [
        ctx.Process(
            target=writer_process,
            args=(target, i, shares[i], concurrency, prompt_tokens, response_tokens, go, q),
            daemon=True,
        )
        for i in range(writers)
    ]
    start, done = _released_together(procs, q, go, timeout)
    seconds = max(d["ended"] for d in done.values()) - start
    events = sum(d["events"] for d in done.values())
    transactions = sum(d["transactions"] for d in done.values())
    stored, distinct = asyncio.run(_count(target))
    if stored != events or distinct != sessions or events != sessions * EVENTS_PER_SESSION:
        raise RuntimeError(
            f"{writers} writers: {events} events reported, {stored} stored, {distinct} sessions of {sessions}"
        )
    tokens = sessions * (prompt_tokens + response_tokens)
    holds = sorted(h for d in done.values() for h in d["lock_holds"])
    return {
        "writers": writers,
        "sessions": sessions,
        "events": events,
        "seconds": seconds,
        "writer_cpu_seconds": sum(d["cpu_seconds"] for d in done.values()),
        "cpu_ms_per_session": 1000 * sum(d["cpu_seconds"] for d in done.values()) / sessions,
        "events_per_s": events / seconds,
        "sessions_per_s": sessions / seconds,
        "tokens_per_s": tokens / seconds,
        "events_per_transaction": events / transactions if transactions else None,
        **_lock_figures(holds, seconds),
    }


def _lock_figures(holds: list[float], seconds: float) -> dict[str, Any]:
    """Per-commit lock hold times (sorted seconds) as ms figures, and the share of the wall time
    some writer held the lock (near 1: the lock, not the writers, sets the pace)."""
    if not holds:
        return {"lock_commits": 0}
    return {
        "lock_commits": len(holds),
        "lock_hold_ms_median": 1000 * statistics.median(holds),
        "lock_hold_ms_p90": 1000 * holds[min(len(holds) - 1, int(0.9 * len(holds)))],
        "lock_hold_ms_max": 1000 * holds[-1],
        "lock_held_share": sum(holds) / seconds,
    }


# --------------------------------------------------------------------------- the baseline
async def _fetch_rows(target: str) -> list[tuple[Any, ...]]:
    import asyncpg

    conn = await asyncpg.connect(_dsn(target))
    try:
        return [
            tuple(r)
            for r in await conn.fetch(f"SELECT {', '.join(COLUMNS)} FROM events ORDER BY position")
        ]
    finally:
        await conn.close()


async def _raw_insert(target: str, rows: list[tuple[Any, ...]], method: str) -> float:
    import asyncpg

    conn = await asyncpg.connect(_dsn(target))
    try:
        start = time.perf_counter()
        if method == "copy":
            await conn.copy_records_to_table("events", records=rows, columns=list(COLUMNS))
        else:
            placeholders = ", ".join(f"${i}" for i in range(1, len(COLUMNS) + 1))
            async with conn.transaction():
                await conn.executemany(
                    f"INSERT INTO events ({', '.join(COLUMNS)}) VALUES ({placeholders})", rows
                )
        seconds = time.perf_counter() - start
        stored = await conn.fetchval("SELECT count(*) FROM events")
    finally:
        await conn.close()
    if stored != len(rows):
        raise RuntimeError(f"baseline {method}: {stored} rows stored of {len(rows)}")
    return seconds


def copy_process(target: str, index: int, rows: list[tuple[Any, ...]], go: Any, queue: Any) -> None:
    """One raw COPY process of the parallel baseline: connect, wait for `go`, COPY its share."""

    async def copy() -> dict[str, Any]:
        import asyncpg

        conn = await asyncpg.connect(_dsn(target))
        try:
            queue.put(("ready", index, os.getpid()))
            await asyncio.to_thread(go.wait)
            started = time.monotonic()
            await conn.copy_records_to_table("events", records=rows, columns=list(COLUMNS))
            return {"started": started, "ended": time.monotonic(), "events": len(rows)}
        finally:
            await conn.close()

    try:
        queue.put(("done", index, asyncio.run(copy())))
    except BaseException as error:  # noqa: BLE001 - the parent must hear of it
        import traceback

        queue.put(("error", index, f"{error!r}\n{traceback.format_exc()}"))


def parallel_copy(
    url: str, rows: list[tuple[Any, ...]], processes: int, reps: int, timeout: float = 300.0
) -> dict[str, Any]:
    """Median seconds of `processes` processes COPYing `rows` (split in contiguous shares) into a
    fresh migrated database at once, from a common start signal until the last is done."""
    ctx = multiprocessing.get_context("spawn")
    # the timed appends' rows: the run's configuration fingerprint, written at open, is not one
    rows = [r for r in rows if r[COLUMNS.index("type")] != "RunConfigured"]
    size = -(-len(rows) // processes)
    shares = [rows[i * size : (i + 1) * size] for i in range(processes)]
    seconds = []
    for _ in range(reps):
        name, target = asyncio.run(create_database(url))
        try:
            q, go = ctx.Queue(), ctx.Event()
            procs = [
                ctx.Process(target=copy_process, args=(target, i, shares[i], go, q), daemon=True)
                for i in range(processes)
            ]
            start, done = _released_together(procs, q, go, timeout)
            seconds.append(max(d["ended"] for d in done.values()) - start)
            stored, _ = asyncio.run(_count(target))
            if stored != len(rows):
                raise RuntimeError(f"parallel COPY baseline: {stored} rows stored of {len(rows)}")
        finally:
            asyncio.run(drop_database(url, name))
    median = statistics.median(seconds)
    return {
        "processes": processes,
        "events": len(rows),
        "seconds": median,
        "reps_seconds": seconds,
        "events_per_s": len(rows) / median,
        "reps_events_per_s": [len(rows) / s for s in seconds],
    }


# ---------------------------------------------------------------------------------- driver
def _median_of(reps: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in reps)


def measure(
    writers: int,
    *,
    sessions_per_writer: int | None = None,
    sessions: int | None = None,
    url: str | None = None,
    reps: int = 3,
    concurrency: int = 64,
    prompt_tokens: int = 256,
    response_tokens: int = 512,
    copy_baseline: bool = False,
) -> dict[str, Any]:
    """Median of `reps` repetitions of one configuration, each on a fresh database.

    (Also the entry point `benchmarks/pg.py` calls from the benchmark suite.) With `copy_baseline`
    the rows of the first repetition are read back and COPYed again by `writers` processes at once
    (`parallel_copy`, `reps` repetitions): the result's "copy" entry.
    """
    url = url or admin_url()
    total = sessions if sessions is not None else (sessions_per_writer or 100) * writers
    runs = []
    rows: list[tuple[Any, ...]] | None = None
    for _ in range(reps):
        name, target = asyncio.run(create_database(url))
        try:
            runs.append(
                run_config(
                    target,
                    writers,
                    total,
                    concurrency=concurrency,
                    prompt_tokens=prompt_tokens,
                    response_tokens=response_tokens,
                )
            )
            if copy_baseline and rows is None:
                rows = asyncio.run(_fetch_rows(target))
        finally:
            asyncio.run(drop_database(url, name))
    summary = {
        key: _median_of(runs, key)
        for key in ("events_per_s", "sessions_per_s", "tokens_per_s", "seconds")
    }
    out = {
        "writers": writers,
        "sessions": total,
        "events": runs[0]["events"],
        **summary,
        "reps": runs,
    }
    if rows is not None:
        out["copy"] = parallel_copy(url, rows, writers, reps)
    return out


def baseline(url: str, rows: list[tuple[Any, ...]], sessions: int, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for method in ("copy", "executemany"):
        seconds = []
        for _ in range(reps):
            name, target = asyncio.run(create_database(url))
            try:
                seconds.append(asyncio.run(_raw_insert(target, rows, method)))
            finally:
                asyncio.run(drop_database(url, name))
        median = statistics.median(seconds)
        out[method] = {
            "events": len(rows),
            "seconds": median,
            "reps_seconds": seconds,
            "events_per_s": len(rows) / median,
            "sessions_per_s": sessions / median,
        }
    return out


def server_version(url: str) -> str:
    async def get() -> str:
        import asyncpg

        conn = await asyncpg.connect(_dsn(url))
        try:
            return str(await conn.fetchval("SHOW server_version"))
        finally:
            await conn.close()

    return asyncio.run(get())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pg_append", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--sessions",
        type=int,
        default=2000,
        help="sessions per configuration, split across the writers",
    )
    parser.add_argument(
        "--reps", type=int, default=3, help="repetitions per configuration (median reported)"
    )
    parser.add_argument(
        "--writers", default="1,4,8", help="writer-process counts to measure (default 1,4,8)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=64, help="sessions in flight per writer process"
    )
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument(
        "--json", metavar="OUT", help="write every figure and repetition to this file"
    )
    args = parser.parse_args(argv)
    writer_counts = [int(w) for w in args.writers.split(",") if w.strip()]
    if args.sessions < max(writer_counts) or args.reps < 1:
        parser.error("--sessions must be at least the largest writer count, --reps at least 1")
    url = admin_url()
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731

    load_before = os.getloadavg()
    configs = []
    rows: list[tuple[Any, ...]] | None = None
    for writers in writer_counts:
        log(
            f"pg_append: {writers} writer process(es), {args.sessions} sessions, {args.reps} rep(s)"
        )
        runs = []
        for rep in range(args.reps):
            name, target = asyncio.run(create_database(url))
            try:
                runs.append(
                    run_config(
                        target,
                        writers,
                        args.sessions,
                        concurrency=args.concurrency,
                        prompt_tokens=args.prompt_tokens,
                        response_tokens=args.response_tokens,
                    )
                )
                if rows is None and writers == min(writer_counts):
                    rows = asyncio.run(
                        _fetch_rows(target)
                    )  # the baseline re-inserts exactly these rows
            finally:
                asyncio.run(drop_database(url, name))
            last_rep = runs[-1]
            held = (
                f", lock held {last_rep['lock_hold_ms_median']:.2f} ms/commit (median), "
                f"{100 * last_rep['lock_held_share']:.0f}% of the wall"
                if last_rep.get("lock_commits")
                else ""
            )
            log(
                f"  rep {rep + 1}: {last_rep['events_per_s']:,.0f} events/s in {last_rep['seconds']:.2f}s{held}"
            )
        configs.append(
            {
                "writers": writers,
                "sessions": args.sessions,
                "events": runs[0]["events"],
                **{
                    key: _median_of(runs, key)
                    for key in ("events_per_s", "sessions_per_s", "tokens_per_s", "seconds")
                },
                "events_per_transaction": _median_of(runs, "events_per_transaction"),
                "cpu_ms_per_session": _median_of(runs, "cpu_ms_per_session"),
                **{
                    key: _median_of(runs, key)
                    for key in ("lock_hold_ms_median", "lock_hold_ms_p90", "lock_held_share")
                    if all(key in r for r in runs)
                },
                "reps": runs,
            }
        )
    assert rows is not None
    log(f"pg_append: baseline, raw asyncpg, 1 process, {len(rows)} identical rows")
    base = baseline(url, rows, args.sessions, args.reps)
    processes = max(writer_counts)
    parallel = None
    if processes > 1:
        log(f"pg_append: baseline, raw asyncpg COPY from {processes} processes at once")
        parallel = parallel_copy(url, rows, processes, args.reps)

    copy_rate, many_rate = base["copy"]["events_per_s"], base["executemany"]["events_per_s"]
    load_after = os.getloadavg()
    load = (load_before[0], load_after[0])
    loads = " / ".join(f"{x:.2f}" for x in load_before), " / ".join(f"{x:.2f}" for x in load_after)
    lines = [
        f"PostgreSQL {server_version(url)}; {os.cpu_count()} cores (load average 1/5/15 min {loads[0]} before, "
        f"{loads[1]} after); {args.sessions} sessions per configuration "
        f"({EVENTS_PER_SESSION} events each, {args.prompt_tokens}+{args.response_tokens} tokens), "
        f"{args.concurrency} in flight per process; median of {args.reps} (fresh database each), "
        "[min-max] of the repetitions; lock hold: per group commit, from LOCK TABLE's return to "
        "the commit's, median and p90 of the run's commits; lock held: the share of the wall time "
        "a writer held it",
        "",
        "| configuration | events/s [min-max] | sessions/s | events/transaction | writer CPU ms/session | lock hold ms/commit (p90) | lock held | vs raw COPY | vs raw executemany |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in configs:
        rates = [r["events_per_s"] for r in c["reps"]]
        hold = (
            f"{c['lock_hold_ms_median']:.2f} ({c['lock_hold_ms_p90']:.2f}) | {100 * c['lock_held_share']:.0f}%"
            if "lock_hold_ms_median" in c
            else "– | –"
        )
        lines.append(
            f"| ledger, {c['writers']} writer process{'es' if c['writers'] > 1 else ''} | {c['events_per_s']:,.0f} "
            f"[{min(rates):,.0f}-{max(rates):,.0f}] | "
            f"{c['sessions_per_s']:,.0f} | {c['events_per_transaction']:.1f} | {c['cpu_ms_per_session']:.1f} | "
            f"{hold} | {c['events_per_s'] / copy_rate:.2f}x | "
            f"{c['events_per_s'] / many_rate:.2f}x |"
        )
    labels = {
        "copy": "raw asyncpg copy_records_to_table, 1 process",
        "executemany": "raw asyncpg executemany, 1 process",
    }
    for method, label in labels.items():
        b = base[method]
        spread = [b["events"] / s for s in b["reps_seconds"]]
        lines.append(
            f"| {label} | {b['events_per_s']:,.0f} [{min(spread):,.0f}-{max(spread):,.0f}] | "
            f"{b['sessions_per_s']:,.0f} | {b['events']} | – | – | – | "
            f"{b['events_per_s'] / copy_rate:.2f}x | {b['events_per_s'] / many_rate:.2f}x |"
        )
    if parallel is not None:
        spread = [parallel["events"] / s for s in parallel["reps_seconds"]]
        lines.append(
            f"| raw asyncpg copy_records_to_table, {processes} processes at once | {parallel['events_per_s']:,.0f} "
            f"[{min(spread):,.0f}-{max(spread):,.0f}] | – | "
            f"{parallel['events']} | – | – | – | {parallel['events_per_s'] / copy_rate:.2f}x | {parallel['events_per_s'] / many_rate:.2f}x |"
        )
        last = next(c for c in configs if c["writers"] == processes)
        lines += [
            "",
            f"ledger {processes} writer processes / raw COPY from {processes} processes: "
            f"{last['events_per_s'] / parallel['events_per_s']:.2f}x (issue 18 target: >= 0.5x)",
        ]
    print("\n".join(lines))
    if args.json:
        import asyncpg
        import sqlalchemy

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "benchmark": "pg_append",
                    "sessions": args.sessions,
                    "reps": args.reps,
                    "concurrency": args.concurrency,
                    "prompt_tokens": args.prompt_tokens,
                    "response_tokens": args.response_tokens,
                    "events_per_session": EVENTS_PER_SESSION,
                    "configurations": configs,
                    "baseline": base,
                    "parallel_copy": parallel,
                    "machine": {
                        "cores": os.cpu_count(),
                        "load_average": load,
                        "load_average_1_5_15": [list(load_before), list(load_after)],
                        "python": platform.python_version(),
                        "postgresql": server_version(url),
                        "asyncpg": asyncpg.__version__,
                        "sqlalchemy": sqlalchemy.__version__,
                    },
                },
                f,
                indent=2,
            )
        log(f"pg_append: wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
