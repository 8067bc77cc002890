"""PostgreSQL append with 1, 4, 8 writer processes: a thin adapter over `benchmarks/pg_append.py`.

`pg_append.py` belongs to another workstream; this adapter only calls into it, and only when
the module exists, exposes a function it can call, and PostgreSQL answers at 127.0.0.1:5432.
Otherwise the workload is skipped with a note saying why.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
import socket

from benchmarks.common import Config, Report, Sampled, log, median

WORKLOAD = "pg append"
HOST, PORT = "127.0.0.1", 5432
#: the server the PostgreSQL tests use (tests/conftest.py); override with ROLLOUT_LEDGER_BENCH_PG
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


def pg_url() -> str:
    return (
        os.environ.get("ROLLOUT_LEDGER_BENCH_PG")
        or os.environ.get("ROLLOUT_LEDGER_TEST_PG")
        or DEFAULT_URL
    )


def server_answers(timeout: float = 2.0) -> str | None:
    """None if a PostgreSQL server answers a query at 127.0.0.1:5432, else why not."""
    try:
        with socket.create_connection((HOST, PORT), timeout=timeout):
            pass
    except OSError as error:
        return f"nothing listens at {HOST}:{PORT} ({error})"
    try:
        import asyncpg
    except ImportError:
        return "asyncpg is not installed"

    async def ping() -> None:
        from sqlalchemy.engine import make_url

        dsn = make_url(pg_url()).set(drivername="postgresql").render_as_string(hide_password=False)
        conn = await asyncpg.connect(dsn, timeout=timeout)
        try:
            await conn.execute("SELECT 1")
        finally:
            await conn.close()

    try:
        asyncio.run(ping())
    except Exception as error:  # noqa: BLE001
        return (
            f"PostgreSQL at {HOST}:{PORT} did not answer a query ({type(error).__name__}: {error})"
        )
    return None


def run(cfg: Config, report: Report) -> None:
    if importlib.util.find_spec("benchmarks.pg_append") is None:
        report.note(WORKLOAD, "skipped: benchmarks/pg_append.py does not exist (yet)")
        return
    why = server_answers()
    if why is not None:
        report.note(WORKLOAD, f"skipped: {why}")
        return
    module = importlib.import_module("benchmarks.pg_append")
    measure = getattr(module, "measure", None)
    if not callable(measure) or not {"writers", "sessions_per_writer", "url", "reps"} <= set(
        inspect.signature(measure).parameters
    ):
        report.note(
            WORKLOAD,
            "skipped: benchmarks/pg_append.py has no measure(writers, *, sessions_per_writer, url, reps)",
        )
        return
    results = []
    reps = cfg.pg_reps or cfg.reps
    # issue 18: the largest writer count against raw asyncpg COPY of the same rows from as many processes
    copy_for = max(cfg.pg_writers)
    can_copy = "copy_baseline" in inspect.signature(measure).parameters
    if not can_copy:
        report.note(
            WORKLOAD, "benchmarks/pg_append.py has no copy_baseline: no parallel COPY baseline"
        )
    for writers in cfg.pg_writers:
        log(
            f"  pg append: {writers} writer process(es), {cfg.pg_sessions_per_writer * writers} sessions, {reps} reps"
        )
        extra = {"copy_baseline": True} if can_copy and writers == copy_for else {}
        results.append(
            measure(
                writers,
                sessions_per_writer=cfg.pg_sessions_per_writer,
                url=pg_url(),
                reps=reps,
                **extra,
            )
        )
    base = results[0]
    base_eps = _per_rep(base, "events_per_s")
    for result in results:
        w = result["writers"]
        eps = _per_rep(result, "events_per_s")
        label = f"ledger, {w} writer process{'es' if w > 1 else ''} ({result['sessions']} sessions, {result['events']} events)"
        report.add(WORKLOAD, label, eps, "events/s")
        report.add(
            WORKLOAD,
            f"ledger, {w} writer process{'es' if w > 1 else ''}",
            _per_rep(result, "tokens_per_s"),
            "tokens/s",
        )
        if result is not base:
            report.add(
                WORKLOAD,
                f"scaling {w} writers / {base['writers']} writer (events/s)",
                every_pairing(eps, base_eps),
                "x",
                kind="ratio",
            )
        copy = result.get("copy")
        if copy:
            p = copy["processes"]
            copy_eps = median(copy["reps_events_per_s"])
            report.add(
                WORKLOAD,
                f"raw asyncpg COPY of the same {copy['events']} rows from {p} processes",
                copy_eps,
                "events/s",
            )
            report.add(
                WORKLOAD,
                f"ratio ledger {w} writer processes / raw COPY from {p} processes (events/s)",
                every_pairing(eps, copy_eps),
                "x",
                target=">= 0.5x",
                goal=(">=", 0.5),
                kind="ratio",
            )
    _order_evaluation(report, copy_for, cfg.pg_sessions_per_writer, reps)
    report.note(
        WORKLOAD,
        "per session: create+start, one 256+512-token trajectory, reward, complete (5 events, "
        "pg_append.measure defaults; 64 sessions in flight per process); raw asyncpg baselines: "
        "`python -m benchmarks.pg_append`",
    )


def _per_rep(result: dict, key: str) -> Sampled:
    """A configuration's median with its repetitions (`pg_append.measure` keeps each one)."""
    return median(r[key] for r in result["reps"])


def every_pairing(a: Sampled, b: Sampled) -> Sampled:
    """a / b with the spread of every pairing of their repetitions: the two ran one after the
    other, not side by side, so no repetition of one belongs with a repetition of the other."""
    return Sampled(float(a) / float(b), [x / y for x in a.samples for y in b.samples], paired=False)


def _order_evaluation(report: Report, writers: int, transactions: int, reps: int) -> None:
    """Issue 18's evaluation, not the ledger's design: the append table lock against ordering by
    transaction id under the snapshot's xmin (`benchmarks/pg_order.py`), on raw asyncpg."""
    from benchmarks import pg_order

    log(
        f"  pg order evaluation: {writers} writer process(es), {transactions} transactions each, {reps} reps"
    )
    r = pg_order.measure(pg_url(), writers, transactions, reps)
    # the two modes alternate repetition by repetition: their ratio pairs them; COPY ran after
    lock, xid = (median(r[f"{mode}_reps_events_per_s"]) for mode in ("lock", "xid"))
    copy = median(r["copy_reps_events_per_s"])
    per = f"{writers} writer process{'es' if writers > 1 else ''}, {pg_order.EVENTS_PER_TX} events a transaction"
    report.add(
        WORKLOAD,
        f"evaluation (raw asyncpg, {per}): LOCK TABLE per transaction, as the ledger",
        lock,
        "events/s",
    )
    report.add(
        WORKLOAD,
        "evaluation: no lock, readers ordered by (xid, position) under the snapshot's xmin",
        xid,
        "events/s",
    )
    report.add(
        WORKLOAD,
        "evaluation: xid order / table lock (events/s)",
        xid / lock,
        "x",
        kind="ratio",
    )
    report.add(
        WORKLOAD,
        "evaluation: xid order / raw COPY from as many processes",
        every_pairing(xid, copy),
        "x",
        kind="ratio",
    )
    report.note(
        WORKLOAD,
        f"evaluation readers, rows never seen of {r['events']}: by position {r['lock_position_reader_skipped']} "
        f"with the lock, {r['xid_position_reader_skipped']} without it; by (xid, position) under xmin "
        f"{r['lock_xid_reader_skipped']} and {r['xid_xid_reader_skipped']}",
    )
