"""The OpenTelemetry follower's reads and its checkpoint (revision 0011).

A follower sends sessions to a trace receiver as they end. It reads the sessions whose terminal
position lies after its checkpoint and at or before the projector's (rows and checkpoint commit
together, so every session that ended by then is visible), in the order they ended; once a page
is sent it moves its checkpoint to the last one's position. The move is a compare-and-set on the
position it started from: a second follower of the same name moving it meanwhile is refused
rather than silently overwritten.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from store.errors import StoreError
from store.faults import wraps_faults
from store.read_models import get_checkpoint
from store.schema.tables import otel_checkpoints, sessions

__all__ = ["FollowerConflict", "follower_state", "move_follower", "settled_after"]

_TERMINAL = ("succeeded", "failed", "cancelled")


class FollowerConflict(StoreError, RuntimeError):
    """Another follower of the same name moved the checkpoint."""


@wraps_faults()
async def follower_state(conn: AsyncConnection, name: str) -> tuple[int, int]:
    """(position, sessions sent) of the follower `name`; (0, 0) before its first page."""
    row = (
        await conn.execute(
            select(otel_checkpoints.c.position, otel_checkpoints.c.sessions).where(
                otel_checkpoints.c.name == name
            )
        )
    ).first()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))


@wraps_faults()
async def settled_after(
    conn: AsyncConnection, *, after: int, run: str | None, limit: int
) -> tuple[int, list[dict[str, Any]]]:
    """(the projector's checkpoint, up to `limit` sessions that ended after position `after` and
    by that checkpoint, in the order they ended), of one run or of all (`run` None). Each row has
    `session_id`, `uid`, `run`, `state`, `reward` and `terminal_position`."""
    up_to = await get_checkpoint(conn)
    c = sessions.c
    query = (
        select(c.session_id, c.uid, c.run, c.state, c.reward, c.terminal_position)
        .where(
            c.terminal_position > after,
            c.terminal_position <= up_to,
            c.state.in_(_TERMINAL),
        )
        .order_by(c.terminal_position)
        .limit(limit)
    )
    if run is not None:
        query = query.where(c.run == run)
    return up_to, [dict(row) for row in (await conn.execute(query)).mappings()]


@wraps_faults()
async def move_follower(
    conn: AsyncConnection, name: str, *, previous: int, position: int, sent: int
) -> None:
    """Move follower `name` from `previous` to `position`, adding `sent` sessions to its count,
    in the caller's transaction; FollowerConflict when its row no longer holds `previous`."""
    now = datetime.now(timezone.utc)
    moved = await conn.execute(
        update(otel_checkpoints)
        .where(otel_checkpoints.c.name == name, otel_checkpoints.c.position == previous)
        .values(position=position, sessions=otel_checkpoints.c.sessions + sent, updated_at=now)
    )
    if moved.rowcount == 1:
        return
    exists = (
        await conn.execute(
            select(otel_checkpoints.c.position).where(otel_checkpoints.c.name == name)
        )
    ).first()
    if exists is None and previous == 0:
        await conn.execute(
            otel_checkpoints.insert().values(
                name=name, position=position, sessions=sent, updated_at=now
            )
        )
        return
    raise FollowerConflict(
        f"the OpenTelemetry follower {name!r} is at position "
        f"{'none' if exists is None else exists[0]}, not {previous}: another follower of that "
        "name is running; stop it, or give this one another --name"
    )
