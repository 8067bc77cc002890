"""The reads behind the dataset export: sessions page by page, their trajectories, their payloads.

Every read is bounded by a snapshot position (the projector's checkpoint when the export began),
so an export of a run still being written is one consistent cut of it, and by a page size, so no
read holds the whole log in memory. Session columns are read from the database itself, not only
from `tables.py`: a column a newer revision adds (e.g. `attempts`) is exported where it exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Text, and_, case, cast, column, func, inspect, literal_column, select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection

from store.faults import wraps_faults
from store.read_models import get_checkpoint
from store.read_models.queries import log_end
from store.schema.tables import events, sessions

__all__ = [
    "SessionFilter",
    "count_sessions",
    "payloads",
    "run_has_events",
    "session_columns",
    "session_page",
    "snapshot",
    "trajectory_events",
]

_CHUNK = 500
TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class SessionFilter:
    """Which sessions: one run, optionally one partition and a step range (both ends included)."""

    run: str
    partition: str | None = None
    step_min: int | None = None
    step_max: int | None = None

    def where(self) -> list[Any]:
        conditions = [sessions.c.run == self.run]
        if self.partition is not None:
            conditions.append(sessions.c.partition == self.partition)
        if self.step_min is not None:
            conditions.append(sessions.c.global_step >= self.step_min)
        if self.step_max is not None:
            conditions.append(sessions.c.global_step <= self.step_max)
        return conditions


@wraps_faults()
async def snapshot(conn: AsyncConnection) -> tuple[int, int]:
    """(projector checkpoint, last log position): the export reads up to the first."""
    return await get_checkpoint(conn), await log_end(conn)


@wraps_faults()
async def run_has_events(conn: AsyncConnection, run: str) -> bool:
    found = await conn.execute(select(events.c.position).where(events.c.run == run).limit(1))
    return found.first() is not None


@wraps_faults()
async def session_columns(conn: AsyncConnection) -> list[str]:
    """The columns the database's `sessions` table has, in table order."""
    names = await conn.run_sync(
        lambda sync: [c["name"] for c in inspect(sync).get_columns("sessions")]
    )
    return list(names)


def _done(up_to: int) -> Any:
    """Terminal as of the snapshot: a later end is not seen (the session still counts as open)."""
    return and_(
        sessions.c.state.in_(TERMINAL),
        sessions.c.terminal_position.is_not(None),
        sessions.c.terminal_position <= up_to,
    )


@wraps_faults()
async def count_sessions(conn: AsyncConnection, which: SessionFilter, up_to: int) -> dict[str, int]:
    """Sessions of the filter created by the snapshot: state -> count for those terminal by then,
    and 'open' for the rest (still created or running, or ended after the snapshot)."""
    done = _done(up_to)
    state = case((done, sessions.c.state), else_="open")
    query = (
        select(state.label("s"), func.count())
        .where(*which.where(), sessions.c.created_position <= up_to)
        .group_by(literal_column("s"))
    )
    return {str(s): int(n) for s, n in await conn.execute(query)}


@wraps_faults()
async def session_page(
    conn: AsyncConnection,
    which: SessionFilter,
    *,
    states: Sequence[str],
    up_to: int,
    after: tuple[str, str] | None,
    limit: int,
    columns: Sequence[str],
) -> list[dict[str, Any]]:
    """Up to `limit` sessions terminal by `up_to` in `states`, ordered by (uid, session_id) and
    after the key `after` (None: from the start); `columns` names the columns wanted (those
    `tables.py` lacks are read as plain columns, without type processing).

    Keyed on (uid, session_id), not on creation order: the index on (run, uid) serves that order,
    so each page walks only its own rows (creation order has no index, and every page would sort
    the whole run)."""
    picked = [sessions.c[name] if name in sessions.c else column(name) for name in columns]
    for name in ("uid", "session_id"):
        if name not in columns:
            picked.append(sessions.c[name])
    conditions = [*which.where(), _done(up_to), sessions.c.state.in_(tuple(states))]
    if after is not None:
        conditions.append(tuple_(sessions.c.uid, sessions.c.session_id) > tuple_(*after))
    query = (
        select(*picked)
        .where(*conditions)
        .order_by(sessions.c.uid, sessions.c.session_id)
        .limit(limit)
    )
    out = []
    for row in (await conn.execute(query)).mappings():
        item = dict(row)
        for name in ("created_at", "terminal_at"):
            value = item.get(name)
            if (
                isinstance(value, datetime) and value.tzinfo is None
            ):  # SQLite keeps no zone; we write UTC
                item[name] = value.replace(tzinfo=timezone.utc)
        out.append(item)
    return out


@wraps_faults()
async def trajectory_events(
    conn: AsyncConnection, session_ids: Sequence[str], up_to: int
) -> list[tuple[int, str, str, int, str]]:
    """(position, session_id, type, schema_version, data as stored text) of the sessions'
    TrajectoryRecorded and SessionSucceeded events at positions <= `up_to`, in log order; no
    payloads (the caller fetches only those it exports). `data` stays text so one malformed
    event is one trajectory the caller cannot decode, not a page that cannot be read."""
    out: list[tuple[int, str, str, int, str]] = []
    for start in range(0, len(session_ids), _CHUNK):
        chunk = list(session_ids[start : start + _CHUNK])
        query = select(
            events.c.position,
            events.c.session_id,
            events.c.type,
            events.c.schema_version,
            cast(events.c.data, Text),
        ).where(
            events.c.session_id.in_(chunk),
            events.c.type.in_(("TrajectoryRecorded", "SessionSucceeded")),
            events.c.position <= up_to,
        )
        out.extend(tuple(row) for row in await conn.execute(query))  # type: ignore[misc]
    out.sort(key=lambda row: row[0])
    return out


@wraps_faults()
async def payloads(conn: AsyncConnection, positions: Sequence[int]) -> dict[int, bytes | None]:
    """position -> the event's binary payload."""
    out: dict[int, bytes | None] = {}
    wanted = sorted(set(positions))
    for start in range(0, len(wanted), _CHUNK):
        chunk = wanted[start : start + _CHUNK]
        result = await conn.execute(
            select(events.c.position, events.c.payload).where(events.c.position.in_(chunk))
        )
        for position, payload in result:
            out[int(position)] = bytes(payload) if payload is not None else None
    return out
