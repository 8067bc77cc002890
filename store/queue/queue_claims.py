"""Durable queue consumers: claim, ack and release rows of `queue_rows` (docs/design.md §7).

`queue_rows` is an immutable read model the projector writes; who holds which row lives in
`queue_claims` (one row per claimed queue row). A queue row is *available* when it has no
claim, or its claim is unacked and older than the claimer's lease: a consumer that dies after
claiming does not lose its rows, they come back once its lease runs out. A consumer that dies
*during* a claim loses nothing either: its transaction rolls back.

How several consumers are kept from getting the same row:

* PostgreSQL: candidates are selected with `FOR UPDATE OF queue_rows SKIP LOCKED`, so
  concurrent claimers neither block on nor double-claim each other's in-flight rows. The row
  lock alone is not enough under READ COMMITTED: a claimer whose snapshot predates another's
  commit can lock a row *after* that commit (the lock is free again and the row itself never
  changes, so PostgreSQL does not recheck it) while still seeing no claim. So the claim write
  is the arbiter: an upsert whose conflict branch only takes over a claim that is still unacked
  and expired. `ON CONFLICT` looks at the latest committed claim, not the snapshot, and
  `RETURNING` says which rows this consumer really got. Lost rows are simply not returned and
  the claim goes round again for more (they are visible as claimed to the next statement).
* SQLite: the transaction begins with the write lock held (`BEGIN IMMEDIATE`, see
  `store.dialects.WRITE_LOCK`), so claimers take turns; the same upsert is used, unchanged.

Clock: on PostgreSQL claim times and lease cut-offs come from the server's clock (`now()`), so
consumers on hosts with skewed clocks agree; SQLite is one file on one host and uses this
process's UTC clock. All consumers of one queue should use the same lease: the lease is
applied by the claimer deciding whether someone else's claim has expired.

This module is SQL only; it does not import `sessions`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timedelta
from types import EllipsisType
from typing import Any

from sqlalchemy import and_, delete, exists, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store.dialects import WRITE_LOCK, dialect_of
from store.errors import StoreInputError
from store.faults import wraps_faults
from store.read_models.keys import equals
from store.schema.tables import NAME, queue_claims, queue_rows

#: Rounds of "select candidates, upsert claims" per call; each lost round makes progress
#: (the rows lost are seen as claimed next round), so this bound is only a safety net.
_MAX_ROUNDS = 16
_CHUNK = 500


# ---------------------------------------------------------------------------- validation
def check_consumer(consumer: Any) -> str:
    """A claim belongs to a name; an empty or over-long one would fail late, inside SQL."""
    if not isinstance(consumer, str) or not consumer.strip():
        raise StoreInputError(f"queue consumer name must be a non-empty string, got {consumer!r}")
    if len(consumer) > NAME:
        raise StoreInputError(
            f"queue consumer name {consumer[:20]!r}… is {len(consumer)} characters; at most {NAME}"
        )
    return consumer


def check_claim_args(run: Any, limit: Any, global_step: Any, lease_seconds: Any) -> None:
    """Reject bad arguments up front: a bad limit would otherwise just claim nothing. The
    partition is only a value to filter by here: what names one is the domain's vocabulary, which
    the one caller (`sessions.queues.consumer`) checks before it claims."""
    if not isinstance(run, str) or not run:
        raise StoreInputError(f"run must be a non-empty string, got {run!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise StoreInputError(f"limit must be a positive integer (rows to claim), got {limit!r}")
    if (
        global_step is not ...
        and global_step is not None
        and (isinstance(global_step, bool) or not isinstance(global_step, int))
    ):
        raise StoreInputError(
            f"global_step must be an int, None (rows without a step) or ... (any step), got {global_step!r}"
        )
    if (
        isinstance(lease_seconds, bool)
        or not isinstance(lease_seconds, (int, float))
        or not math.isfinite(lease_seconds)
        or lease_seconds <= 0
    ):
        raise StoreInputError(
            f"lease_seconds must be a positive finite number, got {lease_seconds!r}"
        )


def _check_ids(row_ids: Sequence[int]) -> list[int]:
    if isinstance(row_ids, (str, bytes)):
        raise StoreInputError(f"row_ids must be a sequence of queue row ids, got {row_ids!r}")
    ids = list(row_ids)
    for row_id in ids:
        if isinstance(row_id, bool) or not isinstance(row_id, int):
            raise StoreInputError(
                f"queue row ids are integers (the `id` of the claimed rows), got {row_id!r}"
            )
    return sorted(set(ids))


# ----------------------------------------------------------------------------- helpers
async def _now(conn: AsyncConnection) -> datetime:
    """The clock leases are measured by: the server's on PostgreSQL, ours (UTC) on SQLite."""
    return await dialect_of(conn).lease_now(conn)


def _insert(conn: AsyncConnection) -> Any:
    """The backend's INSERT construct, for its `ON CONFLICT DO UPDATE … RETURNING` form."""
    return dialect_of(conn).upsert(queue_claims)


def _live_claim(cutoff: datetime) -> Any:
    """A claim that still holds its row: acked, or claimed within the lease."""
    return and_(
        queue_claims.c.queue_row_id == queue_rows.c.id,
        or_(queue_claims.c.acked_at.is_not(None), queue_claims.c.claimed_at >= cutoff),
    )


def _chunks(items: list[int]) -> list[list[int]]:
    return [items[i : i + _CHUNK] for i in range(0, len(items), _CHUNK)]


async def _lock_own_claims(conn: AsyncConnection, consumer: str, ids: list[int]) -> list[int]:
    """This consumer's unacked claims among `ids`, locked in id order.

    PostgreSQL: a claimer taking over expired claims locks them in id order too (its upsert
    runs over candidates sorted by id), so an ack or release racing it cannot deadlock.
    """
    query = (
        select(queue_claims.c.queue_row_id)
        .where(
            queue_claims.c.queue_row_id.in_(ids),
            queue_claims.c.consumer == consumer,
            queue_claims.c.acked_at.is_(None),
        )
        .order_by(queue_claims.c.queue_row_id)
        .with_for_update()
    )
    return [int(row_id) for row_id in (await conn.execute(query)).scalars()]


async def _write_conn(engine: AsyncEngine) -> Any:
    """A connection whose transactions take the write lock up front (SQLite: BEGIN IMMEDIATE)."""
    conn = await engine.connect()
    return await conn.execution_options(**{WRITE_LOCK: True})


# ------------------------------------------------------------------------------- claim
@wraps_faults()
async def claim_in(
    conn: AsyncConnection,
    consumer: str,
    *,
    run: str,
    partition: str,
    limit: int,
    global_step: int | None | EllipsisType = ...,
    lease_seconds: float = 300.0,
) -> list[dict[str, Any]]:
    """`claim` inside the caller's open transaction (which must hold WRITE_LOCK on SQLite).

    Exposed so a caller can claim and do its own work in one transaction; nothing is claimed
    until that transaction commits, and a rollback (or a crash) hands nothing out.
    """
    check_consumer(consumer)
    check_claim_args(run, limit, global_step, lease_seconds)
    now = await _now(conn)
    cutoff = now - timedelta(seconds=float(lease_seconds))
    claimed: list[dict[str, Any]] = []
    for _round in range(_MAX_ROUNDS):
        wanted = limit - len(claimed)
        if wanted <= 0:
            break
        query = select(queue_rows).where(
            queue_rows.c.run == run,
            queue_rows.c.partition == partition,
            queue_rows.c.kind == "row",
            ~exists().where(_live_claim(cutoff)),
        )
        if global_step is not ...:
            query = query.where(equals(queue_rows.c.global_step, global_step))
        query = (
            query.order_by(queue_rows.c.id)
            .limit(wanted)
            .with_for_update(of=queue_rows, skip_locked=True)
        )
        candidates = [dict(row) for row in (await conn.execute(query)).mappings()]
        if not candidates:
            break
        statement = _insert(conn).values(
            [{"queue_row_id": c["id"], "consumer": consumer, "claimed_at": now} for c in candidates]
        )
        statement = statement.on_conflict_do_update(
            index_elements=[queue_claims.c.queue_row_id],
            set_={
                "consumer": statement.excluded.consumer,
                "claimed_at": statement.excluded.claimed_at,
            },
            # Take over only a claim that is still abandoned by the time we write (see module doc).
            where=and_(queue_claims.c.acked_at.is_(None), queue_claims.c.claimed_at < cutoff),
        ).returning(queue_claims.c.queue_row_id)
        won = {int(row_id) for row_id in (await conn.execute(statement)).scalars()}
        claimed.extend(c for c in candidates if c["id"] in won)
        if len(candidates) < wanted and len(won) == len(candidates):
            break  # the queue had no more available rows
    claimed.sort(key=lambda row: row["id"])
    return claimed


@wraps_faults()
async def claim(
    engine: AsyncEngine,
    consumer: str,
    *,
    run: str,
    partition: str,
    limit: int,
    global_step: int | None | EllipsisType = ...,
    lease_seconds: float = 300.0,
) -> list[dict[str, Any]]:
    """Atomically claim up to `limit` available rows (kind 'row', in `id` order) for `consumer`.

    `global_step`: an int selects that step, None rows without a step, `...` any step.
    Available means unclaimed, or claimed but unacked for longer than `lease_seconds` (the
    claim's holder is presumed dead). Returns the claimed queue rows as dicts, possibly fewer
    than `limit`, empty when nothing is available. Ack them when done, or release them.
    """
    check_consumer(consumer)
    check_claim_args(run, limit, global_step, lease_seconds)
    conn = await _write_conn(engine)
    try:
        async with conn.begin():
            return await claim_in(
                conn,
                consumer,
                run=run,
                partition=partition,
                limit=limit,
                global_step=global_step,
                lease_seconds=lease_seconds,
            )
    finally:
        await conn.close()


# -------------------------------------------------------------------------- ack/release
@wraps_faults()
async def ack(engine: AsyncEngine, consumer: str, row_ids: Sequence[int]) -> int:
    """Mark rows done so they are never handed out again; returns how many this call acked.

    Only claims this consumer still holds and has not acked yet count: a row whose lease ran
    out and was taken over by another consumer is *not* acked (0 for it), which is how a slow
    consumer learns it lost the row and must not publish its result.
    """
    check_consumer(consumer)
    ids = _check_ids(row_ids)
    if not ids:
        return 0
    conn = await _write_conn(engine)
    total = 0
    try:
        async with conn.begin():
            now = await _now(conn)
            for chunk in _chunks(ids):
                mine = await _lock_own_claims(conn, consumer, chunk)
                if mine:
                    result = await conn.execute(
                        update(queue_claims)
                        .where(queue_claims.c.queue_row_id.in_(mine))
                        .values(acked_at=now)
                    )
                    total += int(result.rowcount or 0)
    finally:
        await conn.close()
    return total


@wraps_faults()
async def release(engine: AsyncEngine, consumer: str, row_ids: Sequence[int]) -> int:
    """Give unacked rows back at once (no lease wait); returns how many were released.

    Only this consumer's unacked claims are dropped: releasing cannot undo an ack or steal
    back a row someone else has taken over.
    """
    check_consumer(consumer)
    ids = _check_ids(row_ids)
    if not ids:
        return 0
    conn = await _write_conn(engine)
    total = 0
    try:
        async with conn.begin():
            for chunk in _chunks(ids):
                mine = await _lock_own_claims(conn, consumer, chunk)
                if mine:
                    result = await conn.execute(
                        delete(queue_claims).where(queue_claims.c.queue_row_id.in_(mine))
                    )
                    total += int(result.rowcount or 0)
    finally:
        await conn.close()
    return total


__all__ = [
    "ack",
    "check_claim_args",
    "check_consumer",
    "claim",
    "claim_in",
    "release",
]
