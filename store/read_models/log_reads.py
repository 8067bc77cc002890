"""The projector's and the batches' reads of the log: events after a position as the projection
decoder takes them, a step's trajectories, and the events queue rows point at (with payloads)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timezone
from typing import Any

from sqlalchemy import Text, cast, select
from sqlalchemy.ext.asyncio import AsyncConnection

from store.faults import wraps_faults
from store.read_models.keys import chunks
from store.schema.tables import events

#: The columns the projection decoder reads from `events`, in its order.
DECODER_COLUMNS = (
    "position",
    "session_id",
    "version",
    "type",
    "schema_version",
    "data",
    "recorded_at",
)


@wraps_faults()
async def events_after(
    conn: AsyncConnection, after: int, limit: int, *, payloads: dict[int, bytes] | None = None
) -> list[tuple[Any, ...]]:
    """Up to `limit` events after a position, as the projection decoder reads them:
    (position, session_id, version, type, schema_version, data, recorded_at), no payloads.

    With `payloads`, the same read also fills it with position -> payload of the events that have
    one (the token arrays a follower keeps for the batch, read once, as they land).
    """
    columns = _decoder_columns() + ([events.c.payload] if payloads is not None else [])
    result = await conn.execute(
        select(*columns).where(events.c.position > after).order_by(events.c.position).limit(limit)
    )
    if payloads is None:
        return [_utc_row(row) for row in result]
    out = []
    for *row, payload in result:
        if payload is not None:
            payloads[row[0]] = bytes(payload)
        out.append(_utc_row(row))
    return out


@wraps_faults()
async def run_ends_after(
    conn: AsyncConnection, run: str, types: Sequence[str], after: int, limit: int
) -> list[tuple[int, str, str, str]]:
    """Up to `limit` events of `run` of the given types after a position, in log order:
    (position, session_id, type, data as stored JSON). The range on `position` keeps the read to
    the log's tail since the caller's last one (the circuit breaker's)."""
    result = await conn.execute(
        select(events.c.position, events.c.session_id, events.c.type, cast(events.c.data, Text))
        .where(events.c.position > after, events.c.run == run, events.c.type.in_(list(types)))
        .order_by(events.c.position)
        .limit(limit)
    )
    return [(int(r[0]), str(r[1]), str(r[2]), str(r[3])) for r in result]


def _decoder_columns() -> list[Any]:
    """`DECODER_COLUMNS`, with `data` as its stored text: the decoder parses it, so a row of
    malformed JSON is one event to quarantine, not a page that cannot be read."""
    return [
        cast(events.c.data, Text) if name == "data" else events.c[name] for name in DECODER_COLUMNS
    ]


def _utc_row(row: Any) -> tuple[Any, ...]:
    *head, recorded_at = row
    if recorded_at.tzinfo is None:  # SQLite keeps no zone; we only ever write UTC
        recorded_at = recorded_at.replace(tzinfo=timezone.utc)
    return (*head, recorded_at)


@wraps_faults()
async def trajectory_events(
    conn: AsyncConnection, session_ids: Sequence[str], up_to: int
) -> list[tuple[Any, ...]]:
    """The TrajectoryRecorded events of some sessions at positions <= `up_to`, and the
    AttemptFailed events that supersede them, in log order, as `events_after` returns them."""
    out: list[tuple[Any, ...]] = []
    for chunk in chunks(list(session_ids)):
        result = await conn.execute(
            select(*_decoder_columns()).where(
                events.c.session_id.in_(chunk),
                events.c.type.in_(("TrajectoryRecorded", "AttemptFailed")),
                events.c.position <= up_to,
            )
        )
        out.extend(_utc_row(row) for row in result)
    out.sort(key=lambda row: row[0])
    return out


@wraps_faults()
async def created_sessions(conn: AsyncConnection, session_ids: Sequence[str]) -> set[str]:
    """Those of the sessions whose stream holds a SessionCreated (found by session, as the
    trajectory reads are)."""
    out: set[str] = set()
    for chunk in chunks(sorted(set(session_ids))):
        result = await conn.execute(
            select(events.c.session_id).where(
                events.c.session_id.in_(chunk), events.c.type == "SessionCreated"
            )
        )
        out.update(result.scalars())
    return out


SourceEvent = tuple[str, int, dict[str, Any], "bytes | None"]  # type, schema_version, data, payload


@wraps_faults()
async def source_events(conn: AsyncConnection, positions: Sequence[int]) -> dict[int, SourceEvent]:
    """position -> (type, schema_version, data, payload) for the events queue rows point at."""
    out: dict[int, SourceEvent] = {}
    for chunk in chunks(sorted(set(positions))):
        result = await conn.execute(
            select(
                events.c.position,
                events.c.type,
                events.c.schema_version,
                events.c.data,
                events.c.payload,
            ).where(events.c.position.in_(chunk))
        )
        for position, type_, schema_version, data, payload in result:
            out[position] = (
                type_,
                schema_version,
                data,
                bytes(payload) if payload is not None else None,
            )
    return out


@wraps_faults()
async def read_source_events(engine: Any, positions: Sequence[int]) -> dict[int, SourceEvent]:
    """`source_events` on a connection of its own."""
    async with engine.connect() as conn:
        return await source_events(conn, positions)
