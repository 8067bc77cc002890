"""Replay: rebuild every read model of a database from its `events` table alone (DESIGN §9).

Three steps, timed apart because different things bound them:

1. copy the log verbatim into the target's empty `events` table at driver level
   (`store.bulk_copy`: pure SQL between SQLite files, COPY into PostgreSQL) — bound by writing the
   token payloads;
2. fold the copied log into read-model rows in one pass (`sessions.rebuild`) — bound by Python
   per event (mostly parsing each event's JSON `data`); payloads are never read;
3. insert those rows and the checkpoint in one transaction.

The result equals what the incremental `Projector` stores for the same log, row for row; the
audit relies on that, and tests/test_replay_equivalence.py checks it on random logs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from sessions.projector import PG_PROJECTOR_LOCK
from sessions.rebuild import EVENT_SELECT, GROUP_COLUMNS, METRIC_COLUMNS, QUEUE_COLUMNS, SESSION_COLUMNS, Fold, ReadModels
from store import bulk_copy, driver
from store.read_models import PROJECTOR
from store.tables import checkpoints

#: Events per page read (copy across backends, and the fold's reads).
PAGE = 20_000


@dataclass(frozen=True)
class ReplayReport:
    events: int
    seconds: float
    #: Parts of `seconds`, one after the other: the copy of the log, the fold of the copied log into
    #: read-model rows (with their serialisation), and their insert with the checkpoint.
    copy_seconds: float = 0.0
    fold_seconds: float = 0.0
    write_seconds: float = 0.0

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


async def copy_events(
    source: AsyncEngine,
    target: AsyncEngine,
    *,
    page_size: int = PAGE,
    on_page: Callable[[int], None] | None = None,
    up_to: int | None = None,
) -> int:
    """Copy the log verbatim — positions, ids, payloads — into an empty `events` table.

    `up_to` stops at that position (inclusive).
    """
    await _require_no_events(target)
    return await bulk_copy.copy_events(source, target, up_to=up_to, page_size=page_size, on_page=on_page)


async def _require_no_events(target: AsyncEngine) -> None:
    async with driver.reader(target) as read:
        if (await read.fetch("SELECT count(*) FROM events"))[0][0]:
            raise ValueError("the target database already has events; replay needs an empty one")


async def rebuild(
    source: AsyncEngine,
    target: AsyncEngine,
    *,
    up_to: int | None = None,
    page_size: int = PAGE,
    on_events: Callable[[int], None] | None = None,
) -> int:
    """Fold `source`'s log (positions <= `up_to`, or all) and write the read models and checkpoint
    into `target`, whose read models must be empty. `source` may be `target` itself.

    Returns the number of events folded.
    """
    models = await fold_log(source, up_to=up_to, page_size=page_size, on_events=on_events)
    await insert_read_models(target, prepare(models, source, target))
    return models.events


async def fold_log(
    source: AsyncEngine, *, up_to: int | None = None, page_size: int = PAGE, on_events: Callable[[int], None] | None = None
) -> ReadModels:
    """The read models of `source`'s log (positions <= `up_to`, or all), folded in memory."""
    folded = Fold()
    async with driver.reader(source) as read:
        last = 0
        while True:
            rows = await read.events_page(EVENT_SELECT, after=last, up_to=up_to, limit=max(1, page_size))
            if not rows:
                break
            folded.feed(rows)
            last = rows[-1][0]
            if on_events is not None:
                on_events(len(rows))
    return folded.result()


@dataclass
class Prepared:
    """A fold's rows as the target's driver takes them: JSON as text, timestamps in its storage form."""

    sessions: list[tuple[Any, ...]]
    groups: list[tuple[Any, ...]]
    metrics: list[tuple[Any, ...]]
    queue: list[tuple[Any, ...]]
    last_position: int
    events: int


def prepare(models: ReadModels, source: AsyncEngine, target: AsyncEngine) -> Prepared:
    """Serialise JSON columns (as SQLAlchemy's JSON type does: `json.dumps`) and, across backends,
    convert the session timestamps the fold took from the source's events."""
    dumps = json.dumps
    reward_info = SESSION_COLUMNS.index("reward_info")
    tags = QUEUE_COLUMNS.index("tags")
    convert = bulk_copy.recorded_at_converter(source, target)
    created, terminal = SESSION_COLUMNS.index("created_at"), SESSION_COLUMNS.index("terminal_at")
    sessions = []
    for row in models.sessions:
        values = list(row)
        values[reward_info] = dumps(values[reward_info])
        if convert is not None:
            values[created] = convert(values[created])
            if values[terminal] is not None:
                values[terminal] = convert(values[terminal])
        sessions.append(tuple(values))
    queue = [(*row[:tags], dumps(row[tags]), *row[tags + 1:]) for row in models.queue]
    return Prepared(sessions, models.groups, models.metrics, queue, models.last_position, models.events)


async def insert_read_models(target: AsyncEngine, rows: Prepared) -> None:
    """Insert the rows and the checkpoint in one transaction (empty read models expected)."""
    if not rows.events:
        return  # as the projector: no events, no checkpoint
    stamp = checkpoints.c.updated_at.type.dialect_impl(target.dialect).bind_processor(target.dialect)
    now = datetime.now(timezone.utc)
    async with driver.writer(target) as write:
        if write.postgres:  # as a projector page: one writer of read models at a time
            await write.execute("SELECT pg_advisory_xact_lock($1)", (PG_PROJECTOR_LOCK,))
        mark = "$1" if write.postgres else "?"
        if await write.fetch(f"SELECT position FROM checkpoints WHERE name = {mark}", (PROJECTOR,)):
            raise ValueError("the target database already has a projector checkpoint; replay needs empty read models")
        await write.insert("sessions", SESSION_COLUMNS, rows.sessions)
        await write.insert("groups", GROUP_COLUMNS, rows.groups)
        await write.insert("metric_counts", METRIC_COLUMNS, rows.metrics)
        await write.insert("queue_rows", QUEUE_COLUMNS, rows.queue)
        await write.insert("checkpoints", ("name", "position", "updated_at"),
                           [(PROJECTOR, rows.last_position, stamp(now) if stamp else now)])
        await write.commit()


async def replay(
    source: AsyncEngine,
    target: AsyncEngine,
    *,
    on_events: Callable[[int], None] | None = None,
    page_size: int = PAGE,
    up_to: int | None = None,
) -> ReplayReport:
    """Copy the events (all, or those at positions <= `up_to`) into `target` (migrated, empty),
    then build its read models from scratch out of the copied log alone.

    (Copy and fold side by side were measured slower on two cores than one after the other: both
    read the source while the copy writes the target.)
    """
    started = time.perf_counter()
    count = await copy_events(source, target, page_size=page_size, up_to=up_to)
    copied = time.perf_counter()
    rows = prepare(await fold_log(target, page_size=page_size, on_events=on_events), target, target)
    folded = time.perf_counter()
    await insert_read_models(target, rows)
    done = time.perf_counter()
    return ReplayReport(count, done - started, copied - started, folded - copied, done - folded)
