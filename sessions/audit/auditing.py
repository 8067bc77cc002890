"""Audit: check the log, replay it in isolation, and compare with what is stored.

The report names the first divergence precisely — table, session, event position, field,
expected (from replay) and found (stored) — so an auditor can go straight to it.

Memory stays bounded whatever the log's size: the log is checked in two streaming passes
(`sessions.audit.log_check`); the first one's pages are also folded into read models
(`sessions.projection.rebuild`, one read and one JSON parse per event for both), which are compared
with the stored ones read as a key-ordered stream (`sessions.audit.read_model_diff`). Up to
`MEMORY_SESSIONS` sessions the fold's rows stay in memory, compared as a SQLite database would
return them; past it, the rows of steps that look done move to a scratch file
(`sessions.audit.scratch`) and both sides are streamed. No read model depends on the payloads,
and queue-row content is resolved in the audited log itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sessions.audit.divergence import Divergence
from sessions.audit.log_check import check_log
from sessions.audit.parallel_fold import ParallelFold, workers_for
from sessions.audit.read_model_diff import compare, compare_rows
from sessions.audit.replay import prepare
from sessions.audit.scratch import Scratch
from sessions.errors import LedgerError
from sessions.gc_pause import gc_paused
from sessions.projection.rebuild import ReadModels, Rebuild, without_pruned
from store import AsyncEngine
from store import bulk_read_models as bulk
from store import read_models as rm

__all__ = [
    "MEMORY_SESSIONS",
    "SETTLE_MARGIN",
    "AuditReport",
    "Divergence",
    "audit",
    "check_log",
    "compare",
]


@dataclass
class AuditReport:
    sessions: int = 0
    events: int = 0
    seconds: float = 0.0
    divergences: list[Divergence] = field(default_factory=list)
    #: The stored projector checkpoint: read models are compared with a replay up to it.
    projected_through: int = 0
    #: Every event of the log the projection rules quarantine (docs/design.md §7), past the checkpoint
    #: too: `projection_errors` rows, in log order. Each is also a divergence.
    quarantined: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.divergences


#: Sessions the audit's fold holds in memory before it moves the rows of finished steps to a
#: scratch file (`sessions.audit.scratch`): about 4 KB a session, so ~200 MB at the bound. Below
#: it (most logs) everything stays in memory and nothing is written.
MEMORY_SESSIONS = 50_000
#: A step is moved out only once its last terminal event is this many positions behind the
#: fold: what usually follows an end (a placeholder) has been folded by then.
SETTLE_MARGIN = 10_000


async def audit(
    engine: AsyncEngine,
    *,
    on_progress: Callable[[str, int], None] | None = None,
    memory_sessions: int | None = MEMORY_SESSIONS,
    workers: int | None = None,
) -> AuditReport:
    """Check the log, rebuild it up to the stored checkpoint, compare.

    Every event is checked, also those appended after the stored checkpoint: the log check, and
    the projection rules over the whole log (an event they would quarantine is reported wherever
    it is). Read models are compared up to the checkpoint only, since they have not seen later
    events yet (run the projector first to compare those too). Audit a database whose projector is
    idle; one that advances meanwhile shows up as divergences. The rebuild reads the log in the
    same pass as the checks.

    Memory: past `memory_sessions` sessions in the fold (None: no bound), the rows of steps that
    look done move to a scratch file and are compared from there. A step that gets events after
    it was moved out (a late creation, an event after its sessions ended) makes those rows
    stale; the audit then folds the log again with no bound, so its verdict never depends on it.

    `workers`: processes the fold runs in, beside the checks in this one (1: all in this one);
    by default `sessions.audit.parallel_fold.workers_for`'s choice (1 on fewer than 3 cores or a
    short log). A parallel fold holds every session in memory: past `memory_sessions` of them
    it is given up for the bounded fold in this process. The verdict is the same either way.

    The cyclic GC is paused throughout (`sessions.gc_pause`): the audit makes no cycles, and the
    read models it folds, then their rows to compare, are a million young objects the collector
    would scan again and again (one full collection cost 0.4 s of an audit's 1.8 s at 100k events).
    """
    with gc_paused():
        count = await workers_for(engine, workers)
        report: AuditReport | None = None
        if count > 1:
            report = await _audit_apart(engine, on_progress, memory_sessions, count)
        if report is None:
            report = await _audit(engine, on_progress, memory_sessions)
        if report is None:  # an evicted step was reached again: fold it all in memory
            report = await _audit(engine, on_progress, None)
        assert report is not None
        return report


class _TooLarge(LedgerError):
    """More sessions than a parallel fold may hold: audit in one process, with its bound (caught
    inside the audit, never raised to a caller)."""


async def _audit_apart(
    engine: AsyncEngine,
    on_progress: Callable[[str, int], None] | None,
    memory_sessions: int | None,
    workers: int,
) -> AuditReport | None:
    """`_audit` with the fold in `workers` processes (no memory bound: every session is held);
    None when it must be done in one process (too many sessions, or steps not kept apart)."""
    started = time.perf_counter()
    report = AuditReport()
    async with engine.connect() as conn:
        report.projected_through = await rm.get_checkpoint(conn)
    replayed = None if on_progress is None else (lambda n: on_progress("replayed", n))

    def feed(rows: list[tuple[Any, ...]]) -> None:
        fold.feed(rows)
        if memory_sessions is not None and fold.sessions > memory_sessions:
            raise _TooLarge

    try:
        async with ParallelFold(
            workers, through=report.projected_through, on_folded=replayed
        ) as fold:
            checked = await check_log(engine, on_progress=on_progress, on_page=feed, page_text=True)
            early, whole = await fold.result()
    except _TooLarge:
        return None
    if whole is None:
        return None
    report.events, report.sessions = checked.events, checked.sessions
    report.divergences.extend(checked.divergences)
    report.divergences.extend(_quarantined(report, whole))
    models = early if early is not None else whole
    report.divergences.extend(await _compare(engine, models))
    report.seconds = time.perf_counter() - started
    return report


def _quarantined(report: AuditReport, whole: ReadModels) -> list[Divergence]:
    """The quarantined events of the whole log, kept on the report and each a divergence."""
    report.quarantined = whole.errors
    found = []
    for error in whole.errors:
        what = error["reason"] if error["field"] is None else f"{error['field']}: {error['reason']}"
        found.append(
            Divergence(
                "events",
                f"position {error['position']}",
                error["type"],
                "an event the projector can project",
                f"{what} (quarantined: {error['outcome']})",
                error["session_id"],
                error["position"],
            )
        )
    return found


async def _audit(
    engine: AsyncEngine,
    on_progress: Callable[[str, int], None] | None,
    memory_sessions: int | None,
) -> AuditReport | None:
    started = time.perf_counter()
    report = AuditReport()
    async with engine.connect() as conn:
        report.projected_through = await rm.get_checkpoint(conn)
    through = report.projected_through
    rebuilt = Rebuild()
    at_checkpoint: list[ReadModels] = []
    scratch: Scratch | None = None
    check_at = memory_sessions

    async def feed(rows: list[tuple[Any, ...]]) -> None:
        nonlocal scratch, check_at
        if not rows:
            return
        if not at_checkpoint and rows[-1][0] > through:
            upto = [row for row in rows if row[0] <= through]
            rebuilt.feed(upto)
            at_checkpoint.append(rebuilt.snapshot())
            if scratch is not None and not rebuilt.late_creation:
                await scratch.add(at_checkpoint[0])
            rebuilt.feed(rows[len(upto) :])
        else:
            rebuilt.feed(rows)
        if rebuilt.late_creation:  # this fold's moved rows are stale: it will be done again
            check_at = None
        if check_at is not None and len(rebuilt.state.sessions) > check_at:
            moved = rebuilt.evict_closed(before=rows[-1][0] - SETTLE_MARGIN)
            if not at_checkpoint and moved.sessions:  # past the checkpoint: nothing to compare
                scratch = scratch or Scratch(engine)
                await scratch.add(moved)
            bound = memory_sessions or 0
            check_at = max(bound, len(rebuilt.state.sessions)) + max(1, bound // 4)
        if on_progress is not None:
            on_progress("replayed", len(rows))

    try:
        checked = await check_log(engine, on_progress=on_progress, on_page=feed)
        if rebuilt.late_creation or await _evicted_sessions_reached(engine, rebuilt):
            return None
        report.events, report.sessions = checked.events, checked.sessions
        report.divergences.extend(checked.divergences)
        whole = rebuilt.result()
        report.divergences.extend(_quarantined(report, whole))
        if scratch is None:
            models = at_checkpoint[0] if at_checkpoint else whole
            # A prune drops its steps' queue rows when it commits, wherever the checkpoint is.
            models.queue = without_pruned(models.queue, rebuilt.pruned)
            report.divergences.extend(await _compare(engine, models))
        else:
            if not at_checkpoint:
                await scratch.add(whole)
            await scratch.drop_queue_rows(rebuilt.pruned)
            report.divergences.extend(await compare(scratch.engine, engine, sources=engine))
    finally:
        if scratch is not None:
            await scratch.close()
    report.seconds = time.perf_counter() - started
    return report


async def _evicted_sessions_reached(engine: AsyncEngine, rebuilt: Rebuild) -> bool:
    """Whether an event the rules found no session for belongs to a session moved out (its
    stream has a SessionCreated): then the rows moved out may be stale."""
    if not rebuilt.suspects:
        return False
    async with engine.connect() as conn:
        return bool(await rm.created_sessions(conn, sorted(rebuilt.suspects)))


async def _compare(engine: AsyncEngine, models: ReadModels) -> list[Divergence]:
    """Compare the stored read models with the rebuilt ones, held in memory as SQLite rows."""
    rows = prepare(models, engine, bulk.sqlite_shape())
    expected = {
        "sessions": rows.sessions,
        "groups": rows.groups,
        "metric_counts": rows.metrics,
        "queue_rows": rows.queue,
        "projection_errors": rows.errors,
    }
    # No log beside the rebuilt rows: queue-row content is resolved in the audited one.
    return await compare_rows(expected, engine, sources=engine)
