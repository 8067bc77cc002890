"""Replay: rebuild every read model of a database from its `events` table alone (DESIGN §9)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from sessions.projector import Projector
from store.engine import WRITE_LOCK
from store.tables import events

PAGE = 2000


@dataclass(frozen=True)
class ReplayReport:
    events: int
    seconds: float

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

    `up_to` stops at that position (inclusive): the audit replays exactly what the stored read
    models have projected, so events appended since are not mistaken for divergences.
    """
    async with target.connect() as conn:
        if (await conn.execute(select(func.count()).select_from(events))).scalar_one():
            raise ValueError("the target database already has events; replay needs an empty one")
    copied, position = 0, 0
    async with source.connect() as src:
        while True:
            query = select(events).where(events.c.position > position)
            if up_to is not None:
                query = query.where(events.c.position <= up_to)
            result = await src.execute(query.order_by(events.c.position).limit(page_size))
            rows = [dict(row) for row in result.mappings()]
            if not rows:
                break
            async with target.connect() as dst:
                dst = await dst.execution_options(**{WRITE_LOCK: True})
                async with dst.begin():
                    await dst.execute(events.insert(), rows)
            copied += len(rows)
            position = rows[-1]["position"]
            if on_page is not None:
                on_page(len(rows))
    if target.dialect.name == "postgresql" and copied:
        async with target.begin() as conn:  # explicit positions bypass the identity: move it past them
            await conn.execute(text("SELECT setval(pg_get_serial_sequence('events', 'position'), :p)"), {"p": position})
    return copied


async def replay(
    source: AsyncEngine,
    target: AsyncEngine,
    *,
    on_events: Callable[[int], None] | None = None,
    page_size: int = PAGE,
    up_to: int | None = None,
) -> ReplayReport:
    """Copy the events (all, or those at positions <= `up_to`) into `target` (migrated, empty)
    and project them there from scratch."""
    import time

    started = time.perf_counter()
    count = await copy_events(source, target, page_size=page_size, up_to=up_to)
    projector = Projector(target, page_size=page_size)
    await projector.run(on_page=(lambda r: on_events(r.events)) if on_events else None)
    return ReplayReport(count, time.perf_counter() - started)
