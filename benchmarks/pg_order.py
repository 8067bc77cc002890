"""PostgreSQL: the append table lock against ordering by transaction id (issue 18's evaluation).

The ledger's appends on PostgreSQL take `LOCK TABLE events IN EXCLUSIVE MODE` for each group
commit, so positions become visible in commit order and a reader tailing `position > checkpoint`
never skips a later-committing event (docs/design.md §8). The lock also serialises the commits themselves,
and with them the server's WAL flushes. The alternative measured here takes no lock: each row also
records its transaction id (`tx xid8 DEFAULT pg_current_xact_id()`), and a tailing reader orders by
`(tx, position)` and reads only transactions older than its snapshot's xmin
(`pg_snapshot_xmin(pg_current_snapshot())`), which are all finished. A transaction that commits
later is still running at the read, so its id is at or above that xmin, above every id the reader
has passed: nothing is skipped, though the global order is `(tx, position)` rather than `position`.

Both designs run here on raw asyncpg, on the ledger's migrated `events` table with the `tx` column
and an index on `(tx, position)` added, with the same rows (`EVENTS_PER_TX` events a transaction,
each with a `PAYLOAD_BYTES` payload, like a group commit of trajectories). During every run two
tailing readers follow the log: one by position, one by `(tx, position)` under xmin; each must see
every row exactly once when the writers hold the lock, and the position reader's misses without
the lock are the hazard the lock exists for. The bar beside them: the same rows COPYed by as many
processes at once (`benchmarks.pg_append.parallel_copy`).

    python -m benchmarks.pg_order --writers 1,8 --transactions 200 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing
import statistics
import time
import uuid
from typing import Any

from benchmarks.pg_append import (
    COLUMNS,
    _collect,
    _dsn,
    _released_together,
    admin_url,
    create_database,
    drop_database,
    parallel_copy,
)

EVENTS_PER_TX = 64
PAYLOAD_BYTES = 3072
#: How long the (xid, position) reader may wait at the end for the cluster's xmin to pass the last rows.
CATCH_UP_S = 30.0
MODES = ("lock", "xid")
_INSERT = f"INSERT INTO events ({', '.join(COLUMNS)}) VALUES ({', '.join(f'${i}' for i in range(1, len(COLUMNS) + 1))})"
#: The two tailing readers' queries: (name, SQL taking the checkpoint, checkpoint of a row)
_POSITION_READ = "SELECT position, tx FROM events WHERE position > $1 ORDER BY position LIMIT 2000"
_XID_READ = (
    "SELECT position, tx FROM events WHERE (tx, position) > ($1::xid8, $2) "
    "AND tx < pg_snapshot_xmin(pg_current_snapshot()) ORDER BY tx, position LIMIT 2000"
)


def rows_for(writer: int, transactions: int) -> list[list[tuple[Any, ...]]]:
    """`transactions` batches of `EVENTS_PER_TX` event rows, each session's versions 1..n."""
    now = dt.datetime.now(dt.timezone.utc)
    payload = bytes(PAYLOAD_BYTES)
    batches = []
    for t in range(transactions):
        batch = []
        for e in range(EVENTS_PER_TX):
            batch.append(
                (
                    str(uuid.uuid4()),
                    f"w{writer}-t{t}-e{e}",
                    1,
                    "TrajectoryRecorded",
                    1,
                    "bench",
                    f"u{writer}",
                    "train",
                    0,
                    '{"index": 0}',
                    payload,
                    now,
                )
            )
        batches.append(batch)
    return batches


async def _prepare(target: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(_dsn(target))
    try:
        await conn.execute(
            "ALTER TABLE events ADD COLUMN tx xid8 NOT NULL DEFAULT pg_current_xact_id()"
        )
        await conn.execute("CREATE INDEX ix_events_tx_position ON events (tx, position)")
    finally:
        await conn.close()


def writer_process(
    target: str, index: int, mode: str, transactions: int, go: Any, queue: Any
) -> None:
    async def write() -> dict[str, Any]:
        import asyncpg

        batches = rows_for(index, transactions)
        conn = await asyncpg.connect(_dsn(target))
        try:
            queue.put(("ready", index, None))
            await asyncio.to_thread(go.wait)
            for batch in batches:
                async with conn.transaction():
                    if mode == "lock":
                        await conn.execute("SET LOCAL lock_timeout = '10s'")
                        await conn.execute("LOCK TABLE events IN EXCLUSIVE MODE")
                    await conn.executemany(_INSERT, batch)
            return {"ended": time.monotonic(), "events": sum(len(b) for b in batches)}
        finally:
            await conn.close()

    _report(queue, index, write)


def reader_process(target: str, index: int, total: int, go: Any, stop: Any, queue: Any) -> None:
    """Both tailing readers, polling until `stop`, then once more to the end: what each saw."""

    async def read() -> dict[str, Any]:
        import asyncpg

        by_position, by_xid = (
            await asyncpg.connect(_dsn(target)),
            await asyncpg.connect(_dsn(target)),
        )
        seen: dict[str, list[int]] = {"position": [], "xid": []}
        checkpoints: dict[str, Any] = {"position": 0, "xid": (0, 0)}

        async def poll() -> int:
            rows = await by_position.fetch(_POSITION_READ, checkpoints["position"])
            if rows:
                seen["position"].extend(r[0] for r in rows)
                checkpoints["position"] = rows[-1][0]
            tx, position = checkpoints["xid"]
            more = await by_xid.fetch(_XID_READ, tx, position)
            if more:
                seen["xid"].extend(r[0] for r in more)
                checkpoints["xid"] = (more[-1][1], more[-1][0])
            return len(rows) + len(more)

        try:
            queue.put(("ready", index, None))
            await asyncio.to_thread(go.wait)
            while not stop.is_set():
                if not await poll():
                    await asyncio.sleep(0.001)
            # To the end. The xmin bound is the whole cluster's: a transaction open anywhere on the
            # server (another database's too) holds the (xid, position) reader back until it ends,
            # so that reader is given up to CATCH_UP_S to see the last rows.
            deadline = time.monotonic() + CATCH_UP_S
            while await poll() or (len(set(seen["xid"])) < total and time.monotonic() < deadline):
                await asyncio.sleep(0.01)
            return seen
        finally:
            await by_position.close()
            await by_xid.close()

    _report(queue, index, read)


def _report(queue: Any, index: int, work: Any) -> None:
    try:
        queue.put(("done", index, asyncio.run(work())))
    except BaseException as error:  # noqa: BLE001 - the parent must hear of it
        import traceback

        queue.put(("error", index, f"{error!r}\n{traceback.format_exc()}"))


def run_once(
    url: str, mode: str, writers: int, transactions: int, timeout: float = 600.0
) -> dict[str, Any]:
    """One repetition on a fresh database: writers released together, the readers tailing."""
    ctx = multiprocessing.get_context("spawn")
    name, target = asyncio.run(create_database(url))
    try:
        asyncio.run(_prepare(target))
        q, go, stop, rq = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Queue()
        total = writers * transactions * EVENTS_PER_TX
        reader = ctx.Process(
            target=reader_process, args=(target, 0, total, go, stop, rq), daemon=True
        )
        reader.start()
        _collect(rq, [reader], "ready", 1, timeout)
        procs = [
            ctx.Process(
                target=writer_process, args=(target, i, mode, transactions, go, q), daemon=True
            )
            for i in range(writers)
        ]
        start, done = _released_together(procs, q, go, timeout)
        stop.set()
        seen = _collect(rq, [reader], "done", 1, timeout)[0]
        reader.join(30)
        events = sum(d["events"] for d in done.values())
        seconds = max(d["ended"] for d in done.values()) - start
        return {
            "mode": mode,
            "writers": writers,
            "events": events,
            "seconds": seconds,
            "events_per_s": events / seconds,
            **{f"{kind}_reader": _verdict(positions, events) for kind, positions in seen.items()},
        }
    finally:
        asyncio.run(drop_database(url, name))


def _verdict(positions: list[int], events: int) -> dict[str, int]:
    """What a tailing reader saw of `events` rows: distinct rows, repeats, and rows it never saw."""
    distinct = len(set(positions))
    return {"seen": distinct, "repeated": len(positions) - distinct, "skipped": events - distinct}


def measure(url: str, writers: int, transactions: int, reps: int) -> dict[str, Any]:
    """Both modes, alternating repetition by repetition (a noisy machine hits both alike), and
    the parallel-COPY bar for the same rows."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(reps):
        for mode in MODES:
            runs[mode].append(run_once(url, mode, writers, transactions))
    rows = [row for i in range(writers) for batch in rows_for(i, transactions) for row in batch]
    copy = parallel_copy(url, rows, writers, reps)
    out: dict[str, Any] = {
        "writers": writers,
        "events": len(rows),
        "copy_events_per_s": copy["events_per_s"],
        "copy_reps_events_per_s": copy["reps_events_per_s"],
    }
    for mode, reps_ in runs.items():
        out[f"{mode}_events_per_s"] = statistics.median(r["events_per_s"] for r in reps_)
        out[f"{mode}_reps_events_per_s"] = [r["events_per_s"] for r in reps_]
        out[f"{mode}_position_reader_skipped"] = max(r["position_reader"]["skipped"] for r in reps_)
        out[f"{mode}_xid_reader_skipped"] = max(r["xid_reader"]["skipped"] for r in reps_)
        out[f"{mode}_repeated"] = max(
            r["position_reader"]["repeated"] + r["xid_reader"]["repeated"] for r in reps_
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pg_order",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--writers", default="1,8", help="comma-separated writer process counts")
    parser.add_argument(
        "--transactions",
        type=int,
        default=200,
        help=f"transactions per writer ({EVENTS_PER_TX} events each)",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args(argv)
    url = admin_url()
    results = [measure(url, int(w), args.transactions, args.reps) for w in args.writers.split(",")]
    print(
        "| writers | table lock events/s | xid order events/s | xid / lock | parallel COPY events/s | lock / COPY | xid / COPY "
        "| position reader skipped (lock / xid) | xid reader skipped (lock / xid) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        lock, xid, copy = r["lock_events_per_s"], r["xid_events_per_s"], r["copy_events_per_s"]
        print(
            f"| {r['writers']} | {lock:,.0f} | {xid:,.0f} | {xid / lock:.2f}x | {copy:,.0f} | {lock / copy:.2f}x | {xid / copy:.2f}x "
            f"| {r['lock_position_reader_skipped']} / {r['xid_position_reader_skipped']} "
            f"| {r['lock_xid_reader_skipped']} / {r['xid_xid_reader_skipped']} |"
        )
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
