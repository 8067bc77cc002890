"""A settled step, with one owner: wait (bounded) until every group of a step has settled, then
hand back the step's rows.

A step is settled when none of its groups is pending: every session of every uid has ended, so
its queue rows are final (docs/design.md §7). `Ledger.batch` needs those rows and the events they
point at (token payloads); `Ledger.metrics_dict` and the trackers, which log what it gives, need
the rows only. They all ask `settled_step`, which knows where the rows are: as the projector that
just projected the step holds them (`Projector.current_held_step`, `sessions.projection.held`),
or, when it holds none or another projector wrote since its last page, read back from the queue
table and the log. Nobody above this module decides between the two.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sessions import validation
from sessions.errors import StepNotSettled
from sessions.projection.projector import Projector
from sessions.projection.rules import Row
from sessions.runs.retention import check_pruned
from store import EventStore
from store import read_models as rm

__all__ = ["SettledStep", "settled_step"]

#: Seconds between two looks at a step's groups while no commit wakes the waiter sooner.
_POLL_INTERVAL = 0.5


@dataclass(frozen=True, slots=True)
class SettledStep:
    """A settled step's batch rows: its queue rows of kind `row` in queue order and, when asked
    for, the events they point at (position -> event, payloads included).

    `held` says the projector's hold served them and nothing was read back (for tests and
    benchmarks; the rows are the same either way).
    """

    run: str
    partition: str
    global_step: int | None
    rows: list[Row]
    sources: dict[int, rm.SourceEvent]
    held: bool


async def settled_step(
    projector: Projector,
    store: EventStore,
    run: str,
    partition: str,
    global_step: int | None,
    *,
    timeout: float | None,
    poll_interval: float = _POLL_INTERVAL,
    sources: bool = True,
) -> SettledStep:
    """The step's rows once it has settled (projecting as it waits; `_wait_settled`), held by
    `projector` or read back; `sources=False` leaves the events (and their payloads) unread.

    `partition` must be one of the partitions already (the caller checks what a user gave).
    """
    global_step = validation.read_step(global_step)
    await _wait_settled(
        projector,
        store,
        run,
        partition,
        global_step,
        timeout=timeout,
        poll_interval=poll_interval,
    )
    if sources:  # a pruned step has no payloads to build a batch from: say which prune
        await check_pruned(projector.engine, run, partition, global_step)
    async with projector.engine.connect() as conn:
        held = await projector.current_held_step(conn, run, partition, global_step)
        if held is not None:
            rows, events = held
            return SettledStep(run, partition, global_step, rows, events if sources else {}, True)
        rows = await rm.queue_rows_for(conn, run, partition, global_step)
        events = (
            await rm.source_events(conn, [q["source_position"] for q in rows]) if sources else {}
        )
    return SettledStep(run, partition, global_step, rows, events, False)


async def _wait_settled(
    projector: Projector,
    store: EventStore,
    run: str,
    partition: str,
    global_step: int | None,
    *,
    timeout: float | None,
    poll_interval: float = _POLL_INTERVAL,
) -> None:
    """Project and look until none of the step's groups is pending; after `timeout` seconds
    (None: no bound) raise `StepNotSettled`, naming some of the open groups. Between looks it
    sleeps until the next commit of `store`, at most `poll_interval` seconds."""
    global_step = validation.read_step(global_step)
    validation.seconds(timeout, "timeout", forever=True)
    validation.seconds(poll_interval, "poll_interval")
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while True:
        await projector.run()
        async with projector.engine.connect() as conn:
            status = await rm.group_status(conn, run, partition, global_step)
            if status and not status.get("pending"):
                return
        remaining = None if deadline is None else deadline - loop.time()
        if remaining is not None and remaining <= 0:
            raise await _not_settled(projector, run, partition, global_step, timeout, status)
        wait = poll_interval if remaining is None else min(poll_interval, remaining)
        await store.wait_for_commit(wait)


async def _not_settled(
    projector: Projector,
    run: str,
    partition: str,
    global_step: int | None,
    timeout: float | None,
    status: dict[str, int],
) -> StepNotSettled:
    """The error of a wait that ran out, with the step's open groups named (some of them)."""
    if not status:
        return StepNotSettled(
            f"run {run!r} {partition} step {global_step}: no sessions recorded after {timeout}s; "
            "check the run, partition and global_step, or wait longer (timeout=...)",
            run=run,
            partition=partition,
            global_step=global_step,
            timeout=timeout,
        )
    async with projector.engine.connect() as conn:
        uids = await rm.pending_uids(conn, run, partition, global_step)
    pending = status.get("pending", 0)
    named = ", ".join(uids) + (" …" if pending > len(uids) else "")
    return StepNotSettled(
        f"run {run!r} {partition} step {global_step}: {pending} of {sum(status.values())} groups still "
        f"unsettled after {timeout}s (uids: {named}); their sessions are still open — fail or cancel "
        "them, or run `rollout-ledger recover --older-than DURATION`",
        run=run,
        partition=partition,
        global_step=global_step,
        timeout=timeout,
        pending=pending,
        groups=sum(status.values()),
        pending_uids=uids,
    )
