"""Audit: check the log, replay it in isolation, and compare with what is stored.

The report names the first divergence precisely — table, session, event position, field,
expected (from replay) and found (stored) — so an auditor can go straight to it.

Memory stays bounded by one page of events or one session's stream, whatever the log's size:
the log is checked in two streaming passes (`sessions.audit.log_check`); the first one's pages are also
folded into read models (`sessions.projection.rebuild`, one read and one JSON parse per event for both), which
go to a scratch SQLite file in a temporary folder; the two sets of read models are compared as
key-ordered streams (`sessions.audit.read_model_diff`). The scratch database gets no copy of the log: no
read model depends on the payloads, and queue-row content is resolved in the audited log itself.
The fold itself holds the read models in memory: O(sessions), never the payloads.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sessions.audit.divergence import Divergence
from sessions.errors import UnknownEventError
from sessions.audit.log_check import check_log
from sessions.errors import ProjectionError
from sessions.audit.read_model_diff import compare
from sessions.projection.rebuild import Rebuild
from sessions.audit.replay import prepare
from store import bulk_read_models as bulk
from store import AsyncEngine, create_engine, upgrade
from store import read_models as rm

__all__ = ["REPLAY_FAILURES", "AuditReport", "Divergence", "audit", "check_log", "compare"]


@dataclass
class AuditReport:
    sessions: int = 0
    events: int = 0
    seconds: float = 0.0
    divergences: list[Divergence] = field(default_factory=list)
    #: The stored projector checkpoint: read models are compared with a replay up to it.
    projected_through: int = 0

    @property
    def ok(self) -> bool:
        return not self.divergences


#: What replaying a damaged log can raise; reported as a divergence, not a crash.
REPLAY_FAILURES = (UnknownEventError, ProjectionError, LookupError, TypeError, ValueError)


async def audit(engine: AsyncEngine, *, on_progress: Callable[[str, int], None] | None = None) -> AuditReport:
    """Check the log, fold it up to the stored checkpoint into a scratch database, compare.

    Every event is checked, also those appended after the stored checkpoint; only the read models
    are compared up to it, since they have not seen later events yet (run the projector first to
    compare those too). Audit a database whose projector is idle; one that advances meanwhile
    shows up as divergences. The fold reads the log in the same pass as the checks.
    """
    started = time.perf_counter()
    report = AuditReport()
    async with engine.connect() as conn:
        report.projected_through = await rm.get_checkpoint(conn)
    through = report.projected_through
    folded = Rebuild()
    failure: list[BaseException] = []

    def fold(rows: list[tuple[Any, ...]]) -> None:
        if failure or not rows or rows[0][0] > through:
            return
        upto = rows if rows[-1][0] <= through else [row for row in rows if row[0] <= through]
        try:
            folded.feed(upto)
        except REPLAY_FAILURES as error:  # the log is damaged: reported below, the checks go on
            failure.append(error)
        if on_progress is not None:
            on_progress("replayed", len(upto))

    checked = await check_log(engine, on_progress=on_progress, on_page=fold)
    report.events, report.sessions = checked.events, checked.sessions
    report.divergences.extend(checked.divergences)
    if failure:
        found = " ".join(str(failure[0]).split()) or type(failure[0]).__name__
        report.divergences.append(Divergence("events", "replay", "projection", "a log the projector can replay", found))
    else:
        report.divergences.extend(await _compare_with_fold(engine, folded))
    report.seconds = time.perf_counter() - started
    return report


async def _compare_with_fold(engine: AsyncEngine, folded: Rebuild) -> list[Divergence]:
    """Write the fold's read models to a scratch SQLite file and compare the stored ones with them."""
    try:
        models = folded.result()
    except REPLAY_FAILURES as error:
        found = " ".join(str(error).split()) or type(error).__name__
        return [Divergence("events", "replay", "projection", "a log the projector can replay", found)]
    with tempfile.TemporaryDirectory(prefix="rollout-ledger-audit-") as folder:
        scratch = create_engine(f"sqlite+aiosqlite:///{Path(folder) / 'replay.db'}")
        try:
            await upgrade(scratch)
            await bulk.insert_read_models(scratch, prepare(models, engine, scratch))
            # The scratch database holds no log: queue-row content is resolved in the audited one.
            return await compare(scratch, engine, sources=engine)
        finally:
            await scratch.dispose()
