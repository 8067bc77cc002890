"""Replay: rebuild every read model of a database from its `events` table alone (docs/design.md §9).

Three steps, timed apart because different things bound them:

1. copy the log verbatim into the target's empty `events` table at driver level
   (`store.bulk_copy`: pure SQL between SQLite files, COPY into PostgreSQL) — bound by SQLite
   writing the rows, their indexes and token payloads;
2. meanwhile, fold the same events (the source's, up to the position the copy goes to) into
   read-model rows in one pass (`sessions.projection.rebuild`) — bound by Python per event;
   payloads are never read. Between SQLite files the copy runs inside SQLite, without the GIL,
   so the two share the cores. A long log can be folded by worker processes, a share of its steps
   each (`sessions.audit.parallel_fold`), and merged into what one process makes;
3. insert those rows and the checkpoint — in the copy's transaction: a replay commits the log
   and its read models together, and an interrupted one leaves the target empty.

The result equals what the incremental `Projector` stores for the same log, row for row; the
audit relies on that, and tests/audit/test_replay_equivalence.py checks it on random logs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sessions.audit.parallel_fold import ParallelFold, workers_for
from sessions.errors import InvalidArgument
from sessions.gc_pause import gc_paused
from sessions.projection.rebuild import ReadModels, Rebuild
from store import bulk_copy
from store import bulk_read_models as bulk

__all__ = [
    "PAGE",
    "copy_events",
    "prepare",
    "rebuild",
    "replay",
]

#: Events per page read (copy across backends, and the rebuild's reads).
PAGE = 20_000
#: Queue rows written at a time while the fold goes on (`_queue_meanwhile`).
EARLY_QUEUE_ROWS = 5000


@dataclass(frozen=True)
class _ReplayReport:
    events: int
    seconds: float
    #: Parts of `seconds`: the copy of the log and, at the same time, the rebuild of its events
    #: into read-model rows, each from the start; then the serialisation and insert of those rows
    #: (but the queue rows written while the fold went on) with the checkpoint, to the commit.
    copy_seconds: float = 0.0
    fold_seconds: float = 0.0
    write_seconds: float = 0.0

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


async def copy_events(
    source: Any,
    target: Any,
    *,
    page_size: int = PAGE,
    on_page: Callable[[int], None] | None = None,
    up_to: int | None = None,
) -> int:
    """Copy the log verbatim — positions, ids, payloads — into an empty `events` table.

    `up_to` stops at that position (inclusive).
    """
    if await bulk.has_events(target):
        raise InvalidArgument("the target database already has events; replay needs an empty one")
    return await bulk_copy.copy_events(
        source, target, up_to=up_to, page_size=page_size, on_page=on_page
    )


async def rebuild(
    source: Any,
    target: Any,
    *,
    up_to: int | None = None,
    page_size: int = PAGE,
    on_events: Callable[[int], None] | None = None,
) -> int:
    """Rebuild `source`'s log (positions <= `up_to`, or all) and write the read models and
    checkpoint into `target`, whose read models must be empty. `source` may be `target` itself.

    Returns the number of events applied.
    """
    models = await _rebuild_log(source, up_to=up_to, page_size=page_size, on_events=on_events)
    await bulk.insert_read_models(target, prepare(models, source, target))
    return models.events


async def _rebuild_log(
    source: Any,
    *,
    up_to: int | None = None,
    page_size: int = PAGE,
    on_events: Callable[[int], None] | None = None,
) -> ReadModels:
    """The read models of `source`'s log (positions <= `up_to`, or all), rebuilt in memory."""
    rebuilt = Rebuild()
    async for rows in bulk.event_pages(source, up_to=up_to, page_size=page_size):
        rebuilt.feed(rows)
        if on_events is not None:
            on_events(len(rows))
    return rebuilt.result()


def prepare(models: ReadModels, source: Any, target: Any, *, queue_from: int = 0) -> bulk.Prepared:
    """The rebuilt rows in the target driver's form (queue rows from `queue_from` on)."""
    tables = {
        "sessions": models.sessions,
        "groups": models.groups,
        "metrics": models.metrics,
        "queue": models.queue,
        "errors": models.errors,
    }
    return bulk.prepare(
        tables,
        last_position=models.last_position,
        events=models.events,
        source=source,
        target=target,
        queue_from=queue_from,
    )


async def replay(
    source: Any,
    target: Any,
    *,
    on_events: Callable[[int], None] | None = None,
    page_size: int = PAGE,
    up_to: int | None = None,
    workers: int | None = None,
) -> _ReplayReport:
    """Copy the events (all, or those at positions <= `up_to`) into `target` (migrated, empty),
    and build its read models from scratch out of those events alone, in one transaction.

    `workers`: processes the fold runs in (1: this one); by default
    `sessions.audit.parallel_fold.workers_for`'s choice (1 on fewer than 3 cores or a short log).
    The rows are the same either way.

    The fold reads the source while the copy writes the target, up to the position the copy goes
    to, so both see the same events (the copy is verbatim).

    The cyclic GC is paused throughout (`sessions.gc_pause`): the fold's read models and their
    prepared rows are a million young objects, no cycles among them, that the collector would
    scan again and again (0.5-1 s of full collections at 100k events).
    """
    with gc_paused():
        if await bulk.has_events(target):
            raise InvalidArgument(
                "the target database already has events; replay needs an empty one"
            )
        count = await workers_for(source, workers)
        return await _replay(
            source, target, on_events=on_events, page_size=page_size, up_to=up_to, workers=count
        )


async def _replay(
    source: Any,
    target: Any,
    *,
    on_events: Callable[[int], None] | None,
    page_size: int,
    up_to: int | None,
    workers: int,
) -> _ReplayReport:
    started = time.perf_counter()
    end: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    marks: dict[str, float] = {}
    rebuilt, paged = Rebuild(), asyncio.Event()

    async def fold() -> ReadModels:
        last = await end
        shown = _Shown(on_events)
        models = (
            await _fold_apart(source, last, page_size, workers, shown.add) if workers > 1 else None
        )
        if models is None:  # one process (asked for, or the steps could not be kept apart)
            shown.folded = 0
            async for rows in bulk.event_pages(source, up_to=last, page_size=page_size):
                rebuilt.feed(rows)
                paged.set()
                shown.add(len(rows))
            models = rebuilt.result()
        marks["folded"] = time.perf_counter()
        return models

    folding = asyncio.ensure_future(fold())

    async def write(writer: Any) -> None:
        marks["copied"] = time.perf_counter()
        written = await _queue_meanwhile(writer, target, rebuilt.state.queue, folding, paged)
        models = await folding
        marks["written from"] = time.perf_counter()
        await bulk.write_read_models(
            writer, prepare(models, source, target, queue_from=written), target, claimed=written > 0
        )

    try:
        count = await bulk_copy.copy_events(
            source,
            target,
            up_to=up_to,
            page_size=page_size,
            on_end=end.set_result,
            before_commit=write,
        )
    finally:
        if not folding.done():  # the copy failed: the fold's rows have nowhere to go
            folding.cancel()
        await asyncio.gather(folding, return_exceptions=True)
    done = time.perf_counter()
    return _ReplayReport(
        count,
        done - started,
        marks["copied"] - started,
        marks["folded"] - started,
        done - marks["written from"],
    )


class _Shown:
    """Events folded, reported to a progress callback as they are folded, each event once even
    when a parallel fold is given up and the log folded again (`folded` set back to 0)."""

    def __init__(self, on_events: Callable[[int], None] | None) -> None:
        self.on_events = on_events
        self.folded = self.shown = 0

    def add(self, n: int) -> None:
        self.folded += n
        if self.on_events is not None and self.folded > self.shown:
            self.on_events(self.folded - self.shown)
            self.shown = self.folded


async def _fold_apart(
    source: Any,
    up_to: int,
    page_size: int,
    workers: int,
    on_folded: Callable[[int], None],
) -> ReadModels | None:
    """The log up to `up_to` folded by `workers` processes and merged; None if its steps could
    not be kept apart."""
    async with ParallelFold(workers, on_folded=on_folded) as fold:
        async for rows in bulk.event_pages(source, up_to=up_to, page_size=page_size):
            fold.feed(rows)
        _early, models = await fold.result()
    return models


async def _queue_meanwhile(
    writer: Any,
    target: Any,
    queue: list[dict[str, Any]],
    folding: asyncio.Future[Any],
    paged: asyncio.Event,
) -> int:
    """Write the queue rows the fold has made, while it goes on; returns how many.

    The copy is done, so the target's connection would idle until the fold ends; a queue row is
    final once made (a rebuild only appends them), and SQLite inserts rows mostly outside the
    GIL, beside the fold (about 0.1 s of the 0.3 s insert at 100k events).
    """
    written = 0
    while not folding.done():
        if len(queue) - written >= EARLY_QUEUE_ROWS:
            if not written:
                await bulk.claim_read_models(writer, target)
            made = len(queue)
            await bulk.write_queue_rows(writer, bulk.queue_tuples(queue[written:made]))
            written = made
            continue
        paged.clear()
        page = asyncio.ensure_future(paged.wait())
        await asyncio.wait({folding, page}, return_when=asyncio.FIRST_COMPLETED)
        page.cancel()
    return written
