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
from typing import Any

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
        keys = [(run, partition, global_step, uid) for uid in uids]
        rows = await rm.load_groups(conn, keys)
    waiting = [_Waiting.of(uid, rows.get(key)) for uid, key in zip(uids, keys)]
    pending = status.get("pending", 0)
    named = ", ".join(uids) + (" …" if pending > len(uids) else "")
    return StepNotSettled(
        f"run {run!r} {partition} step {global_step}: {pending} of {sum(status.values())} groups still "
        f"unsettled after {timeout}s (uids: {named}); " + _what_they_wait_for(waiting),
        run=run,
        partition=partition,
        global_step=global_step,
        timeout=timeout,
        pending=pending,
        groups=sum(status.values()),
        pending_uids=uids,
        open_sessions={w.uid: w.open for w in waiting if w.open},
        never_created={w.uid: w.missing for w in waiting if w.missing},
    )


@dataclass(frozen=True, slots=True)
class _Waiting:
    """What one unsettled group waits for: sessions created and not ended (`open`), and slots
    below its `group_size` that no session was created for (`missing`)."""

    uid: str
    open: int
    missing: tuple[int, ...]

    @classmethod
    def of(cls, uid: str, group: dict[str, Any] | None) -> _Waiting:
        if group is None:  # not read back (a uid just read as pending has its row): say nothing
            return cls(uid, 0, ())
        seen = set(group["members"])
        missing = tuple(i for i in range(group["group_size"]) if i not in seen)
        return cls(uid, max(group["sessions_seen"] - group["terminal"], 0), missing)


def _what_they_wait_for(waiting: list[_Waiting]) -> str:
    """The two causes of an unsettled group, each with its own remedy: a session created and
    never ended (a dead or hung worker), and a session never created (a worker that never
    started one, or a `group_size` larger than the sessions the caller makes)."""
    parts = []
    if opened := [w for w in waiting if w.open]:
        counts = ", ".join(f"{w.uid}: {w.open}" for w in opened)
        parts.append(
            f"{sum(w.open for w in opened)} session(s) created and still open ({counts}) — fail or "
            "cancel them, or run `rollout-ledger recover --older-than DURATION`"
        )
    if absent := [w for w in waiting if w.missing]:
        slots = "; ".join(f"{w.uid}: session_index {_spans(w.missing)}" for w in absent)
        parts.append(
            f"{sum(len(w.missing) for w in absent)} session(s) never created ({slots}) — create and "
            "end them, or give group_size the number of sessions each uid really gets"
        )
    return "; ".join(parts) or "its sessions ended meanwhile — ask again"


def _spans(indices: tuple[int, ...]) -> str:
    """Sorted slot indices as runs: (0, 1, 2, 5) -> '0-2, 5'."""
    out: list[str] = []
    start = prev = indices[0]
    for i in (*indices[1:], None):
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)
