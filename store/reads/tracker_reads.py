"""Reads for the experiment-tracker sinks (issue 17): a sample of a step's failed sessions.

A tracker gets a small table of failed sessions beside the step's figures, so a reader of the
dashboard sees *why* sessions failed (reason, error, message) and how far they got (the
trajectories they had recorded, now discarded), without opening the database. The sample is
deterministic -- the first failures of each reason, in log order -- so logging a step twice, or
from two processes, shows the same rows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timezone
from typing import Any

from sqlalchemy import Text, cast, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from store.errors import StoreInputError
from store.faults import wraps_faults
from store.read_models.keys import equals
from store.schema.tables import events, sessions

__all__ = ["failed_session_samples"]

#: Session ids per IN list.
_CHUNK = 500
#: The session columns a sample row carries, in table order.
_SAMPLE_COLUMNS = (
    "session_id",
    "uid",
    "session_index",
    "data_source",
    "failure_reason",
    "error_type",
    "message",
    "num_trajectories",
    "created_at",
    "terminal_at",
    "terminal_position",
)


@wraps_faults()
async def failed_session_samples(
    conn: AsyncConnection,
    run: str,
    partition: str,
    global_step: int | None,
    *,
    per_reason: int = 3,
    limit: int = 20,
) -> list[dict[str, Any]]:
    """Up to `per_reason` failed sessions of each failure reason of one step (at most `limit` in
    all), ordered by reason, then by when they failed; global_step None selects the sessions
    recorded without a step.

    Each row has the `sessions` columns of `_SAMPLE_COLUMNS` (timestamps in UTC) and `trajectories`:
    the `data` of each TrajectoryRecorded event the session appended, in log order, parsed from
    its stored JSON (None for a row whose JSON is malformed: a sample is no place to stop over it;
    `rollout-ledger audit` names such rows).
    """
    if per_reason < 1 or limit < 1:
        raise StoreInputError(
            f"per_reason and limit must be >= 1, got per_reason={per_reason}, limit={limit}"
        )
    rank = (
        func.row_number()
        .over(
            partition_by=sessions.c.failure_reason,
            order_by=(sessions.c.terminal_position, sessions.c.session_id),
        )
        .label("rank")
    )
    ranked = (
        select(*(sessions.c[name] for name in _SAMPLE_COLUMNS), rank)
        .where(
            sessions.c.run == run, sessions.c.partition == partition, sessions.c.state == "failed"
        )
        .where(equals(sessions.c.global_step, global_step))
        .subquery()
    )
    query = (
        select(*(ranked.c[name] for name in _SAMPLE_COLUMNS))
        .where(ranked.c.rank <= per_reason)
        .order_by(ranked.c.failure_reason, ranked.c.terminal_position, ranked.c.session_id)
        .limit(limit)
    )
    rows = [dict(row) for row in (await conn.execute(query)).mappings()]
    for row in rows:
        for name in ("created_at", "terminal_at"):
            stamp = row[name]
            if (
                stamp is not None and stamp.tzinfo is None
            ):  # SQLite keeps no zone; we only ever write UTC
                row[name] = stamp.replace(tzinfo=timezone.utc)
        row["trajectories"] = []
    by_id = {row["session_id"]: row for row in rows}
    for session_id, data in await _trajectory_data(conn, list(by_id)):
        by_id[session_id]["trajectories"].append(data)
    return rows


async def _trajectory_data(
    conn: AsyncConnection, session_ids: Sequence[str]
) -> list[tuple[str, dict[str, Any] | None]]:
    """(session_id, parsed data) of the sessions' TrajectoryRecorded events, in log order. The data
    is read as text and parsed here, so one malformed row is a None, not a failed query."""
    found: list[tuple[int, str, dict[str, Any] | None]] = []
    for start in range(0, len(session_ids), _CHUNK):
        chunk = session_ids[start : start + _CHUNK]
        result = await conn.execute(
            select(events.c.position, events.c.session_id, cast(events.c.data, Text)).where(
                events.c.session_id.in_(chunk), events.c.type == "TrajectoryRecorded"
            )
        )
        for position, session_id, text in result:
            try:
                data = json.loads(text)
            except (TypeError, ValueError):
                data = None
            found.append((position, session_id, data if isinstance(data, dict) else None))
    found.sort(key=lambda item: item[0])
    return [(session_id, data) for _, session_id, data in found]
