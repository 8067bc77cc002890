"""The reads behind `rollout-ledger report`: one run's step metrics, its latest failures, and
how far the projector had read the log when they were taken.

Only reads, in plain SQL that runs the same on SQLite and PostgreSQL; the report never writes.
"""

from __future__ import annotations

from datetime import timezone
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from store.faults import wraps_faults
from store.read_models.keys import PROJECTOR
from store.read_models.queries import log_end
from store.schema.tables import checkpoints, events, metric_counts, sessions

__all__ = ["report_failures", "report_positions", "report_step_metrics"]


@wraps_faults()
async def report_step_metrics(
    conn: AsyncConnection, run: str
) -> list[tuple[str, int | None, str, float]]:
    """(partition, global_step, metric, value) of the run's all-data-sources scopes (data_source
    NULL), ordered by partition and step; step-less rows (global_step NULL) come too."""
    c = metric_counts.c
    query = (
        select(c.partition, c.global_step, c.metric, c.value)
        .where(c.run == run, c.data_source.is_(None))
        .order_by(c.partition, c.global_step, c.metric)
    )
    return [(p, s, m, float(v)) for p, s, m, v in await conn.execute(query)]


@wraps_faults()
async def report_failures(conn: AsyncConnection, run: str, *, limit: int) -> list[dict[str, Any]]:
    """The run's `limit` most recent failed sessions (by terminal position, newest first), with
    `terminal_at` in UTC (NULL for a session failed by the projector itself)."""
    c = sessions.c
    query = (
        select(
            c.session_id,
            c.uid,
            c.partition,
            c.global_step,
            c.data_source,
            c.failure_reason,
            c.error_type,
            c.message,
            c.placeholder,
            c.terminal_position,
            c.terminal_at,
        )
        .where(c.run == run, c.state == "failed")
        .order_by(c.terminal_position.desc())
        .limit(limit)
    )
    out = []
    for row in (await conn.execute(query)).mappings():
        item = dict(row)
        when = item["terminal_at"]
        if when is not None and when.tzinfo is None:  # SQLite keeps no zone; only UTC is written
            item["terminal_at"] = when.replace(tzinfo=timezone.utc)
        out.append(item)
    return out


@wraps_faults()
async def report_positions(conn: AsyncConnection, run: str) -> dict[str, int]:
    """`projected` (the projector's checkpoint), `log_end` (the last position of the whole log),
    and the run's own `run_events` and `run_last` (its last position; 0 when it has none)."""
    projected = (
        await conn.execute(select(checkpoints.c.position).where(checkpoints.c.name == PROJECTOR))
    ).scalar()
    count, last = (
        await conn.execute(
            select(func.count(), func.max(events.c.position)).where(events.c.run == run)
        )
    ).one()
    return {
        "projected": int(projected or 0),
        "log_end": await log_end(conn),
        "run_events": int(count or 0),
        "run_last": int(last or 0),
    }
