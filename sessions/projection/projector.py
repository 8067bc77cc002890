"""The incremental projector: the event log -> read models, queue rows, group tags and metric counts.

It reads the global log in `position` order from its checkpoint, one page per transaction: it
loads the rows the page touches, applies the projection rules (`sessions.projection.rules`, the
same rules a replay applies to the whole log), and writes back what changed together with the
page's queue rows and the new checkpoint — so a crash anywhere replays the page from scratch and
every row lands exactly once. External sinks are written before that commit with deterministic
keys (at-least-once, idempotent by key).

The page transaction holds the database's projection lock (`store.projection_page`) and re-reads
the checkpoint inside it, so two projectors on one database never project the same page twice:
they take turns. Callers of one projector in one process (a follower and `ledger.batch`) take
turns on an asyncio lock first, so the one that waits is woken when the page ends rather than
polling the database's lock (SQLite's busy handler sleeps up to 100 ms between tries).

A projector holds, between its pages, the rows its last committed page left (`Held`: open
sessions, their trajectories, pending groups, the metric scopes just written), so the next page
reads from the database only what it does not hold: the settling page of a step, which touches
every session at once, reads nothing back. The held rows are used only while the checkpoint is
the one that page wrote (same position, same `updated_at`); anything else — another projector's
page, a failed page, whose rules changed the rows in memory before the rollback — drops them.

With `hold_batches` (the default) a page reads the trajectories' payloads with their events, as
they land, and the projector holds the batch rows of every step it projected from its first
session: the queue rows and source events `ledger.batch` would otherwise read back from the
queue table and the log once the step ends (`held_step`), bounded by `MAX_HELD_STEPS` and
`MAX_HELD_BYTES` (`sessions.projection.held`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sessions.errors import ConfigError, LedgerTimeout
from sessions.placeholder import KEEP_PARTIAL
from sessions.projection import metrics as m
from sessions.projection.decoding import Decoder
from sessions.projection.held import Held, HeldStep, hold, page_sources
from sessions.projection.rules import LogEvent, Row, Rules, WorkingSet, group_key
from sessions.queues.sinks import QueueItem, QueueSink
from store import EventStore, follower_leadership, projection_page, retry_transient
from store import read_models as rm

__all__ = [
    "Projector",
]

log = logging.getLogger(__name__)


@dataclass
class _PageResult:
    events: int
    rows: int
    tags: int
    last_position: int
    #: Events of the page the rules quarantined (listed in `projection_errors`).
    quarantined: int = 0


#: Seconds one external sink's `put` may take before the page is rolled back (None: no limit).
#: A put that hangs would otherwise hold the page transaction — on SQLite the write lock — forever.
_SINK_TIMEOUT = 60.0


class Projector:
    """Projects the log of one database. Safe to run in several processes at once.

    In follow mode a page that fails (a sink that raises or times out, a database error that
    outlived its retries) is rolled back and retried with exponential backoff; `failures` counts
    consecutive failed attempts, `failures_total` all of them, and `last_error` holds the latest.
    """

    def __init__(
        self,
        engine: Any,
        *,
        sinks: Sequence[QueueSink] = (),
        page_size: int = 2000,
        store: EventStore | None = None,
        sink_timeout: float | None = _SINK_TIMEOUT,
        hold_batches: bool = True,
    ) -> None:
        self.engine = engine
        #: Read trajectories' payloads with their events and hold the batch rows of the steps
        #: projected from their first session (`held_step`); off for a follower nobody asks.
        self.hold_batches = hold_batches
        self.sinks = list(sinks)
        self.page_size = page_size
        self.store = store
        self.sink_timeout = sink_timeout
        self.failures = 0
        self.failures_total = 0
        self.last_error: BaseException | None = None
        self._held: Held | None = None
        self._turns: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    def _turn(self) -> asyncio.Lock:
        """This projector's page lock for the running loop (a lock belongs to one loop)."""
        loop = asyncio.get_running_loop()
        if self._turns is None or self._turns[0] is not loop:
            self._turns = (loop, asyncio.Lock())
        return self._turns[1]

    async def step(self) -> _PageResult:
        """Project one page; `events == 0` means the projector is at the end of the log.

        A transient database error (lost connection, busy file) rolls the page back and retries it.
        """
        return await retry_transient(self._step, what="projection")

    async def _step(self) -> _PageResult:
        async with self._turn():
            try:
                return await self._page()
            except BaseException:
                self._held = None  # the rules may have changed held rows before the rollback
                raise

    async def _page(self) -> _PageResult:
        async with projection_page(self.engine) as conn:
            checkpoint = await rm.get_checkpoint(conn)
            payloads: dict[int, bytes] | None = {} if self.hold_batches else None
            page = Decoder().events(
                await rm.events_after(conn, checkpoint, self.page_size, payloads=payloads)
            )
            held = self._held
            if held is not None and (held.position, held.stamp) != (
                checkpoint,
                await rm.checkpoint_stamp(conn),
            ):
                held = self._held = None  # another projector moved on: what we hold is stale
            if not page:
                return _PageResult(0, 0, 0, checkpoint)
            held = held or Held(checkpoint, None)
            state = await _load_working_set(conn, page, checkpoint, held)
            rules = Rules(state)
            rules.apply_all(page)
            rules.finish()
            for relaunched in state.relaunched:  # its held rows are an earlier launch's
                held.steps.pop(relaunched, None)
            await _save_working_set(conn, state)
            if self.sinks:
                items = await _queue_items(conn, state.queue)
                for sink in self.sinks:
                    await self._put(sink, items)
            last = page[-1][0]
            stamp = rm.as_utc(await rm.set_checkpoint(conn, last, previous=checkpoint))
        self._held = hold(state, last, stamp, held, page_sources(page, payloads or {}))
        if payloads is None and self._held is not None:
            self._held.steps.clear()
        return _PageResult(len(page), state.rows_made, state.tags_made, last, len(state.errors))

    async def current_held_step(
        self, conn: Any, run: str, partition: str, global_step: int | None
    ) -> tuple[list[Row], dict[int, rm.SourceEvent]] | None:
        """`held_step`, only if no projector has written since this one's last page (the
        checkpoint read in `conn` is the one it wrote): another process may have projected the
        step's last events after this one's last page."""
        held = self._held
        if held is None or (held.position, held.stamp) != (
            await rm.get_checkpoint(conn),
            await rm.checkpoint_stamp(conn),
        ):
            return None
        return self.held_step(run, partition, global_step)

    def held_step(
        self, run: str, partition: str, global_step: int | None
    ) -> tuple[list[Row], dict[int, rm.SourceEvent]] | None:
        """A step's queue rows (kind `row`, queue order) and their source events as this projector
        wrote them, or None if it does not hold the whole step: what `ledger.batch` reads back
        otherwise (`store.read_models.queue_rows_for`, `source_events`). Current as of this
        projector's last page: call it right after projecting to the log's end."""
        step = None if self._held is None else self._held.steps.get((run, partition, global_step))
        return None if step is None else (list(step.queue), dict(step.sources))

    async def _put(self, sink: QueueSink, items: list[QueueItem]) -> None:
        """`sink.put` under `sink_timeout`; the sink's own errors (its own timeouts included) pass as they are."""
        if self.sink_timeout is None:
            await sink.put(items)
            return
        put = asyncio.ensure_future(sink.put(items))
        try:
            done, _ = await asyncio.wait({put}, timeout=self.sink_timeout)
        except BaseException:
            put.cancel()
            raise
        if not done:
            put.cancel()
            await asyncio.wait({put})  # let it unwind; never raises
            if not put.cancelled():
                put.exception()  # retrieved: the timeout is the error reported
            raise LedgerTimeout(
                f"queue sink {type(sink).__name__}.put of {len(items)} item(s) took longer than "
                f"sink_timeout={self.sink_timeout}s; the page was rolled back and the checkpoint did not move"
            )
        put.result()

    async def run(self, *, on_page: Callable[[_PageResult], None] | None = None) -> int:
        """Project to the current end of the log; returns the number of events projected."""
        total = 0
        while True:
            result = await self.step()
            if result.events == 0:
                return total
            total += result.events
            if on_page is not None:
                on_page(result)

    async def follow(
        self,
        stop: asyncio.Event,
        *,
        poll_interval: float = 0.5,
        on_page: Callable[[_PageResult], None] | None = None,
        on_leader: Callable[[], None] | None = None,
        on_error: Callable[[BaseException, int, float], None] | None = None,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
    ) -> int:
        """Keep projecting until `stop` is set; sleeps between polls instead of busy-looping.

        In-process appends wake it at once; appends from other processes are seen at the next poll.
        On PostgreSQL only one follower leads (a session-level advisory lock); the others wait and
        take over from the checkpoint when the leader's connection goes away. (Pages are safe
        without it — each takes a transaction lock — the lead just stops followers contending.)

        A page that fails is rolled back (its checkpoint does not move) and retried after
        `backoff * 2**(attempt-1)` seconds, at most `max_backoff`: the follower logs a warning
        with the error and the attempt count, calls `on_error(error, attempt, delay)`, and keeps
        going rather than dying. Returns the number of events projected.
        """
        if backoff <= 0 or max_backoff < backoff:
            raise ConfigError(
                f"need 0 < backoff <= max_backoff, got backoff={backoff}, max_backoff={max_backoff}"
            )
        async with follower_leadership(self.engine, stop, poll_interval) as leading:
            if not leading:
                return 0
            if on_leader is not None:
                on_leader()
            return await self._follow(stop, poll_interval, on_page, on_error, backoff, max_backoff)

    async def _follow(
        self,
        stop: asyncio.Event,
        poll_interval: float,
        on_page: Callable[[_PageResult], None] | None,
        on_error: Callable[[BaseException, int, float], None] | None,
        backoff: float,
        max_backoff: float,
    ) -> int:
        total = 0

        def counted(result: _PageResult) -> None:
            nonlocal total
            total += result.events  # counted per page: a later page's failure must not lose it
            if on_page is not None:
                on_page(result)

        self.failures = 0
        while not stop.is_set():
            waiters = [asyncio.ensure_future(stop.wait())]
            if self.store is not None:
                # Armed before reading the log: a commit landing after the read still wakes us.
                waiters.append(asyncio.ensure_future(self.store.wait_for_commit()))
                await asyncio.sleep(0)  # let the waiter take hold of the current commit signal
            try:
                try:
                    await self.run(on_page=counted)
                except Exception as error:  # noqa: BLE001 - a follower reports and retries, it does not die
                    self.failures += 1
                    self.failures_total += 1
                    self.last_error = error
                    delay = min(max_backoff, backoff * 2 ** min(self.failures - 1, 62))
                    log.warning(
                        "projector: page failed (attempt %d): %s: %s; checkpoint unchanged, retrying in %.2fs",
                        self.failures,
                        type(error).__name__,
                        error,
                        delay,
                    )
                    if on_error is not None:
                        on_error(error, self.failures, delay)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                    continue
                if self.failures:
                    log.warning("projector: recovered after %d failed attempt(s)", self.failures)
                    self.failures = 0
                await asyncio.wait(
                    waiters, timeout=poll_interval, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for task in waiters:
                    task.cancel()
        return total


async def _load_working_set(
    conn: Any, page: list[LogEvent], checkpoint: int, held: Held | None = None
) -> WorkingSet:
    """The read-model rows a page's events touch, as stored before the page: those `held` (the
    rows as of `checkpoint`) has, the others read — with copies of them as stored.

    Sessions the page creates, and their groups and scopes, may not exist yet; a session the page
    does not create but that is missing stays missing, and the rules refuse its event.
    """
    held = held or Held(checkpoint, None)
    state = WorkingSet(
        sessions=held.sessions,
        groups=held.groups,
        metrics=held.metrics,
        trajectories=held.trajectories,
    )
    touched = {event[1] for event in page}
    missing = sorted(
        touched - state.sessions.keys()
    )  # created ones too: a repeated creation is refused
    if missing:
        state.sessions.update(await rm.load_sessions(conn, missing))
    rows = [state.sessions[sid] for sid in touched if sid in state.sessions]
    rows += [
        data
        for _p, _sid, _v, type_, data, _at, _problem in page
        if type_ == "SessionCreated" and data is not None and _has_identity(data)
    ]
    keys = {group_key(row) for row in rows}
    if keys - state.groups.keys():
        state.groups.update(
            await rm.load_groups(conn, sorted(keys - state.groups.keys(), key=repr))
        )
    scopes: set[m.Scope] = set()
    for row in (*rows, *(state.groups[key] for key in keys if key in state.groups)):
        scopes.update(
            m.scopes(row["run"], row["partition"], row["global_step"], row.get("data_source"))
        )
    if scopes - state.metrics.keys():
        loaded = await rm.load_metrics(conn, sorted(scopes - state.metrics.keys(), key=repr))
        state.metrics.update({scope: m.MetricTable(values) for scope, values in loaded.items()})
        # a step none of whose sessions was projected yet: all its rows will be made while held
        held.steps.update(
            {
                scope[:3]: HeldStep()
                for scope, values in loaded.items()
                if scope[3] is None and not values
            }
        )
    # A creation of a launch may take its step over from an earlier launch (`Rules._relaunch`),
    # which starts every scope of the step again: all of them are loaded, not only the page's.
    launched: dict[tuple[str, str, int | None], int] = {}
    for _p, _sid, _v, type_, data, _at, _problem in page:
        if type_ == "SessionCreated" and data is not None and _has_identity(data):
            launch = data.get("launch")
            key = (data["run"], data["partition"], data.get("global_step"))
            if isinstance(launch, int) and launch > launched.get(key, 0):
                launched[key] = launch
    later = [  # steps a creation of the page may take over from an earlier launch's sessions
        key
        for key, launch in launched.items()
        if (every := state.metrics.get((*key, None))) is not None
        and every.values
        and launch > int(every.values.get(m.LAUNCH, 0))
    ]
    if later:
        for scope, values in (await rm.load_step_metrics(conn, sorted(later, key=repr))).items():
            if scope not in state.metrics:
                state.metrics[scope] = m.MetricTable(values)
    state.stored_sessions = {
        sid: dict(state.sessions[sid]) for sid in touched if sid in state.sessions
    }
    state.stored_groups = {key: dict(state.groups[key]) for key in keys if key in state.groups}
    await _load_trajectories(conn, page, checkpoint, state, held.complete)
    state.next_queue_id = held.next_queue_id or await rm.next_queue_id(conn)
    return state


async def _load_trajectories(
    conn: Any, page: list[LogEvent], checkpoint: int, state: WorkingSet, complete: set[str]
) -> None:
    """The trajectories a session's end in this page may select (a success's, or a keep_partial
    failure's), recorded before the page, for the sessions whose `complete` does not name them:
    their current attempt's only, as the rules keep them."""
    ending = sorted(
        {
            event[1]
            for event in page
            if event[1] in state.sessions
            and event[1] not in complete
            and (
                event[3] == "SessionSucceeded"
                or (
                    event[3] == "SessionFailed"
                    and (event[4] or {}).get("placeholder") == KEEP_PARTIAL
                )
            )
        }
    )
    if not ending:
        return
    for sid in ending:
        state.trajectories.pop(sid, None)  # a partial view from pages that did not hold it
    decoder = Decoder()
    for position, sid, _version, type_, data, _at, problem in decoder.events(
        await rm.trajectory_events(conn, ending, checkpoint)
    ):
        if type_ == "AttemptFailed":
            state.trajectories.pop(sid, None)  # superseded, as `Rules._attempt_failed` forgets them
        elif problem is None and data is not None:
            state.trajectories.setdefault(sid, {})[int(data["index"])] = (position, data)


async def _save_working_set(conn: Any, state: WorkingSet) -> None:
    """Write back what the rules changed: new rows inserted, touched ones updated, queue rows added."""
    sessions_new = [
        state.sessions[sid] for sid in state.touched_sessions if sid in state.new_sessions
    ]
    sessions_old = sorted(
        (state.sessions[sid] for sid in state.touched_sessions if sid not in state.new_sessions),
        key=_by_session,
    )
    await rm.save_sessions(
        conn,
        sorted(sessions_new, key=_by_session),
        sessions_old,
        [state.stored_sessions.get(row["session_id"]) for row in sessions_old],
    )
    groups_new = [state.groups[key] for key in state.touched_groups if key in state.new_groups]
    groups_old = [state.groups[key] for key in state.touched_groups if key not in state.new_groups]
    await rm.save_groups(
        conn,
        groups_new,
        groups_old,
        [state.stored_groups.get(group_key(row)) for row in groups_old],
    )
    if state.relaunched:  # started again: rows of metrics the earlier launch had must go
        await rm.delete_step_metrics(conn, sorted(state.relaunched, key=repr))
    await rm.save_metrics(conn, state.changed_metrics())
    await rm.insert_queue_rows(conn, state.queue)
    await rm.insert_projection_errors(conn, state.errors)


def _has_identity(data: dict[str, Any]) -> bool:
    """Whether a creation's data names a group (a malformed one may not; the rules refuse it)."""
    return all(isinstance(data.get(k), str) for k in ("run", "partition", "uid"))


def _by_session(row: dict[str, Any]) -> str:
    return row["session_id"]


async def _queue_items(conn: Any, queue: list[dict[str, Any]]) -> list[QueueItem]:
    """A page's queue rows with their token arrays, for external sinks."""
    from sessions.batches import (
        rows as row_builder,
    )  # torch: imported only when a sink needs arrays

    positions = [q["source_position"] for q in queue if q["kind"] == "row"]
    sources = await rm.source_events(conn, positions)
    built = iter(row_builder.materialise(queue, sources))
    return [
        QueueItem(
            q["run"],
            q["partition"],
            q["global_step"],
            q["key"],
            q["uid"],
            dict(q["tags"]),
            next(built) if q["kind"] == "row" else None,
        )
        for q in queue
    ]
