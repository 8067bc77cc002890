"""The projector: the event log -> read models, queue rows, group tags and metric counts.

It reads the global log in `position` order from its checkpoint, one page per transaction: the
page's read-model changes, queue rows and metric counts commit together with the new checkpoint,
so a crash anywhere replays the page from scratch and every row lands exactly once. External
sinks are written before that commit with deterministic keys (at-least-once, idempotent by key).

The page transaction holds the database's write lock (SQLite) or an advisory lock (PostgreSQL)
and re-reads the checkpoint inside it, so two projectors on one database never project the same
page twice: they take turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from sessions import events as ev
from sessions import metrics as m
from sessions.queues import QueueItem, QueueSink
from store import read_models as rm
from store.engine import WRITE_LOCK
from store.event_store import EventStore, is_transient, read_page, retry_transient
from store.tables import groups as groups_table
from store.tables import sessions as sessions_table

log = logging.getLogger(__name__)

PG_PROJECTOR_LOCK = 0x524C5052  # "RLPR": held for one page's transaction
PG_LEADER_LOCK = 0x524C4C44  # "RLLD": held by the leading follower for as long as it follows


class ProjectionError(RuntimeError):
    """The log holds something the projector cannot project (names the event position)."""


@dataclass
class PageResult:
    events: int
    rows: int
    tags: int
    last_position: int


#: Seconds one external sink's `put` may take before the page is rolled back (None: no limit).
#: A put that hangs would otherwise hold the page transaction — on SQLite the write lock — forever.
SINK_TIMEOUT = 60.0


class Projector:
    """Projects the log of one database. Safe to run in several processes at once.

    In follow mode a page that fails (a sink that raises or times out, a database error that
    outlived its retries) is rolled back and retried with exponential backoff; `failures` counts
    consecutive failed attempts, `failures_total` all of them, and `last_error` holds the latest.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        sinks: Sequence[QueueSink] = (),
        page_size: int = 2000,
        store: EventStore | None = None,
        sink_timeout: float | None = SINK_TIMEOUT,
    ) -> None:
        self.engine = engine
        self.sinks = list(sinks)
        self.page_size = page_size
        self.store = store
        self.sink_timeout = sink_timeout
        self.failures = 0
        self.failures_total = 0
        self.last_error: BaseException | None = None

    async def step(self) -> PageResult:
        """Project one page; `events == 0` means the projector is at the end of the log.

        A transient database error (lost connection, busy file) rolls the page back and retries it.
        """
        return await retry_transient(self._step, what="projection")

    async def _step(self) -> PageResult:
        async with self.engine.connect() as conn:
            conn = await conn.execution_options(**{WRITE_LOCK: True})
            async with conn.begin():
                if conn.dialect.name == "postgresql":
                    await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_PROJECTOR_LOCK})
                checkpoint = await rm.get_checkpoint(conn)
                page = await read_page(conn, checkpoint, self.page_size, with_payload=False)
                if not page:
                    return PageResult(0, 0, 0, checkpoint)
                work = _Page(conn, [ev.decode(stored) for stored in page])
                await work.load()
                work.project()
                await work.save()
                if self.sinks:
                    items = await work.queue_items()
                    for sink in self.sinks:
                        await self._put(sink, items)
                await rm.set_checkpoint(conn, page[-1].position, previous=checkpoint)
                return PageResult(len(page), work.row_count, work.tag_count, page[-1].position)

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
            raise TimeoutError(
                f"queue sink {type(sink).__name__}.put of {len(items)} item(s) took longer than "
                f"sink_timeout={self.sink_timeout}s; the page was rolled back and the checkpoint did not move"
            )
        put.result()

    async def run(self, *, on_page: Callable[[PageResult], None] | None = None) -> int:
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
        on_page: Callable[[PageResult], None] | None = None,
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
            raise ValueError(f"need 0 < backoff <= max_backoff, got backoff={backoff}, max_backoff={max_backoff}")
        async with self._leadership(stop, poll_interval) as leading:
            if not leading:
                return 0
            if on_leader is not None:
                on_leader()
            return await self._follow(stop, poll_interval, on_page, on_error, backoff, max_backoff)

    @contextlib.asynccontextmanager
    async def _leadership(self, stop: asyncio.Event, poll_interval: float) -> AsyncIterator[bool]:
        if self.engine.dialect.name != "postgresql":
            yield True
            return
        async with self.engine.connect() as conn:
            while not stop.is_set():
                try:
                    got = (await conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": PG_LEADER_LOCK})).scalar_one()
                    await conn.commit()
                except DBAPIError as error:
                    if not is_transient(error):
                        raise
                    # A dropped connection must not end a waiting follower: poll again on a new one.
                    log.warning("leader election: %s; trying again", error.orig)
                    await conn.rollback()
                    got = False
                if got:
                    try:
                        yield True
                    finally:
                        try:
                            await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": PG_LEADER_LOCK})
                            await conn.commit()
                        except DBAPIError as error:  # the lock went with the lost connection
                            if not is_transient(error):
                                raise
                            await conn.rollback()
                    return
                try:
                    await asyncio.wait_for(stop.wait(), poll_interval)
                except asyncio.TimeoutError:
                    pass
            yield False

    async def _follow(
        self,
        stop: asyncio.Event,
        poll_interval: float,
        on_page: Callable[[PageResult], None] | None,
        on_error: Callable[[BaseException, int, float], None] | None,
        backoff: float,
        max_backoff: float,
    ) -> int:
        total = 0

        def counted(result: PageResult) -> None:
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
                        self.failures, type(error).__name__, error, delay,
                    )
                    if on_error is not None:
                        on_error(error, self.failures, delay)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                    continue
                if self.failures:
                    log.warning("projector: recovered after %d failed attempt(s)", self.failures)
                    self.failures = 0
                await asyncio.wait(waiters, timeout=poll_interval, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waiters:
                    task.cancel()
        return total


class _Page:
    """One page of events projected in memory, then written back."""

    def __init__(self, conn: AsyncConnection, recorded: list[ev.Recorded]) -> None:
        self.conn = conn
        self.recorded = recorded
        self.sessions: dict[str, dict[str, Any]] = {}
        self.new_sessions: set[str] = set()
        self.groups: dict[tuple[str, str], dict[str, Any]] = {}
        self.new_groups: set[tuple[str, str]] = set()
        self.metrics: dict[m.Scope, m.MetricTable] = {}
        self.metric_ids: dict[m.Scope, dict[str, tuple[int, float]]] = {}
        self.trajectories: dict[str, dict[int, tuple[int, dict[str, Any]]]] = {}
        self.queue: list[dict[str, Any]] = []
        self.row_count = 0
        self.tag_count = 0

    # ------------------------------------------------------------ loading
    async def load(self) -> None:
        created = {r.session_id: r.event for r in self.recorded if isinstance(r.event, ev.SessionCreated)}
        other_ids = sorted({r.session_id for r in self.recorded} - created.keys())
        self.sessions = await rm.load_sessions(self.conn, other_ids)
        missing = [sid for sid in other_ids if sid not in self.sessions]
        if missing:
            first = next(r for r in self.recorded if r.session_id == missing[0])
            raise ProjectionError(
                f"event at position {first.position} ({first.type}) belongs to session {missing[0]!r}, "
                "which has no SessionCreated before it; the log is damaged — run `rollout-ledger audit`"
            )
        group_keys = {(s["run"], s["uid"]) for s in self.sessions.values()}
        group_keys |= {(e.run, e.uid) for e in created.values()}
        self.groups = await rm.load_groups(self.conn, sorted(group_keys))
        scopes: set[m.Scope] = set()
        for s in self.sessions.values():
            scopes.update(m.scopes(s["run"], s["partition"], s["global_step"], s["data_source"]))
        for e in created.values():
            scopes.update(m.scopes(e.run, e.partition, e.global_step, e.data_source))
        for g in self.groups.values():
            scopes.update(m.scopes(g["run"], g["partition"], g["global_step"], g["data_source"]))
        self.metric_ids = await rm.load_metrics(self.conn, sorted(scopes, key=repr))
        self.metrics = {scope: m.MetricTable({k: v for k, (_id, v) in known.items()}) for scope, known in self.metric_ids.items()}
        succeeded = sorted({r.session_id for r in self.recorded if isinstance(r.event, ev.SessionSucceeded)})
        if succeeded:
            found = await rm.trajectory_events(self.conn, succeeded, self.recorded[-1].position or 0)
            for sid, items in found.items():
                self.trajectories[sid] = {
                    int(data["index"]): (position, ev.upcast("TrajectoryRecorded", schema, data)) for position, schema, data in items
                }

    # ---------------------------------------------------------- projecting
    def project(self) -> None:
        for recorded in self.recorded:
            handler = _HANDLERS[type(recorded.event)]
            handler(self, recorded)
        for table in self.metrics.values():
            if table.dirty:
                table.derive()

    def _session(self, recorded: ev.Recorded) -> dict[str, Any]:
        session = self.sessions[recorded.session_id]
        session["version"] = recorded.version
        return session

    def _scoped(self, run: str, partition: str, step: int | None, source: str | None) -> list[m.MetricTable]:
        tables = []
        for scope in m.scopes(run, partition, step, source):
            table = self.metrics.get(scope)
            if table is None:
                table = self.metrics[scope] = m.MetricTable()
            tables.append(table)
        return tables

    def _session_metrics(self, s: dict[str, Any]) -> list[m.MetricTable]:
        return self._scoped(s["run"], s["partition"], s["global_step"], s["data_source"])

    def _group_metrics(self, g: dict[str, Any]) -> list[m.MetricTable]:
        return self._scoped(g["run"], g["partition"], g["global_step"], g["data_source"])

    def on_created(self, r: ev.Recorded) -> None:
        e: ev.SessionCreated = r.event  # type: ignore[assignment]
        self.new_sessions.add(r.session_id)
        self.sessions[r.session_id] = {
            "session_id": r.session_id, "run": e.run, "uid": e.uid, "session_index": e.session_index,
            "group_size": e.group_size, "partition": e.partition, "global_step": e.global_step,
            "data_source": e.data_source, "runner": e.runner, "state": "created", "version": r.version,
            "num_trajectories": 0, "selected_rows": 0, "reward": None, "score_source": None, "reward_info": {},
            "failure_reason": None, "error_type": None, "message": None, "placeholder": False,
            "created_position": r.position, "terminal_position": None, "created_at": r.recorded_at, "terminal_at": None,
        }
        key = (e.run, e.uid)
        group = self.groups.get(key)
        if group is None:
            group = {
                "run": e.run, "uid": e.uid, "partition": e.partition, "global_step": e.global_step,
                "data_source": e.data_source, "group_size": e.group_size, "sessions_seen": 0, "terminal": 0,
                "succeeded": 0, "failed": 0, "cancelled": 0, "reward_sum": 0.0, "reward_count": 0,
                "status": "pending", "settled_position": None,
            }
            self.groups[key] = group
            self.new_groups.add(key)
            for table in self._group_metrics(group):
                table.add(m.GROUPS_TOTAL)
        group["sessions_seen"] += 1
        for table in self._session_metrics(self.sessions[r.session_id]):
            table.add(m.SESSIONS_TOTAL)

    def on_started(self, r: ev.Recorded) -> None:
        self._session(r)["state"] = "running"

    def on_trajectory(self, r: ev.Recorded) -> None:
        self._session(r)["num_trajectories"] += 1

    def on_reward(self, r: ev.Recorded) -> None:
        e: ev.RewardPosted = r.event  # type: ignore[assignment]
        s = self._session(r)
        s["reward"] = e.reward
        s["reward_info"] = {**s["reward_info"], **e.info, "reward": e.reward}

    def on_succeeded(self, r: ev.Recorded) -> None:
        e: ev.SessionSucceeded = r.event  # type: ignore[assignment]
        s = self._terminal(r, "succeeded")
        reward = 0.0 if e.score is None else float(e.score)
        s["reward"], s["score_source"], s["selected_rows"] = e.score, e.score_source, len(e.selected)
        tables = self._session_metrics(s)
        for table in tables:
            table.add(m.SESSIONS_SUCCEEDED)
            if e.score is None:
                table.add(m.REWARD_ABSENT)
        known = self.trajectories.get(r.session_id, {})
        for index in e.selected:
            if index not in known:
                raise ProjectionError(
                    f"SessionSucceeded at position {r.position} selects trajectory {index} of session "
                    f"{r.session_id!r}, which has no such TrajectoryRecorded; run `rollout-ledger audit`"
                )
            position, data = known[index]
            self._row(s, r, key_index=index, source_position=position, reward=reward, placeholder=False, data=data)
            for table in tables:
                table.add(m.ROWS)
                table.add(m.ROWS_SUCCEEDED)
                table.add(m.REWARD_SUM, reward)
                table.add(m.REWARD_SUM_SUCCESS, reward)
                table.add(m.RESPONSE_LENGTH_SUM, int(data["response_len"]))
                table.maximum(m.RESPONSE_LENGTH_MAX, int(data["response_len"]))
        self._settle(s, r, value=reward)

    def on_failed(self, r: ev.Recorded) -> None:
        e: ev.SessionFailed = r.event  # type: ignore[assignment]
        s = self._terminal(r, "failed")
        s["failure_reason"], s["error_type"], s["message"] = e.reason, e.error_type, e.message
        for table in self._session_metrics(s):
            table.add(m.SESSIONS_FAILED)
            table.add(m.FAILED_BY_REASON.format(reason=e.reason))
        if e.placeholder == "drop":
            self._settle(s, r, value=None)
        # else: the session settles at its PlaceholderEmitted, so its row precedes the group tag.

    def on_placeholder(self, r: ev.Recorded) -> None:
        e: ev.PlaceholderEmitted = r.event  # type: ignore[assignment]
        s = self._session(r)
        if s["state"] != "failed" or s["placeholder"]:
            log.warning("ignoring PlaceholderEmitted at position %s: session %s is %s", r.position, r.session_id, s["state"])
            return
        s["placeholder"] = True
        s["selected_rows"] = 1
        self._row(s, r, key_index=0, source_position=r.position, reward=float(e.reward), placeholder=True, data=None,
                  failure_reason=e.reason, materialization_reason=e.materialization_reason)
        for table in self._session_metrics(s):
            table.add(m.PLACEHOLDERS)
            table.add(m.ROWS)
            table.add(m.REWARD_SUM, float(e.reward))
        self._settle(s, r, value=float(e.reward))

    def on_cancelled(self, r: ev.Recorded) -> None:
        e: ev.SessionCancelled = r.event  # type: ignore[assignment]
        s = self._terminal(r, "cancelled")
        s["message"] = e.message
        for table in self._session_metrics(s):
            table.add(m.SESSIONS_CANCELLED)
        self._settle(s, r, value=None)

    def _terminal(self, r: ev.Recorded, state: str) -> dict[str, Any]:
        s = self._session(r)
        s["state"] = state
        s["terminal_position"] = r.position
        s["terminal_at"] = r.recorded_at
        return s

    def _row(
        self, s: dict[str, Any], r: ev.Recorded, *, key_index: int, source_position: int, reward: float, placeholder: bool,
        data: dict[str, Any] | None, failure_reason: str | None = None, materialization_reason: str | None = None,
    ) -> None:
        prompt_len = 1 if data is None else int(data["prompt_len"])
        response_len = 1 if data is None else int(data["response_len"])
        materialization = materialization_reason if data is None else data.get("materialization_reason")
        self.queue.append({
            "run": s["run"], "partition": s["partition"], "global_step": s["global_step"],
            "key": f"{s['uid']}_{s['session_index']}_{key_index}", "kind": "row", "uid": s["uid"],
            "session_id": s["session_id"], "session_index": s["session_index"], "data_source": s["data_source"],
            "source_position": source_position, "reward": reward, "is_placeholder": placeholder,
            "failure_reason": failure_reason, "materialization_reason": materialization,
            "num_turns": 0 if data is None else int(data["num_turns"]),
            "prompt_len": prompt_len, "response_len": response_len,
            "tags": {
                "status": "finished", "global_steps": s["global_step"], "prompt_len": prompt_len,
                "response_len": response_len, "seq_len": prompt_len + response_len, "uid": s["uid"],
                "materialization_reason": materialization, "is_placeholder": placeholder,
            },
            "produced_position": r.position,
        })
        self.row_count += 1

    def _settle(self, s: dict[str, Any], r: ev.Recorded, *, value: float | None) -> None:
        """A session is done for projection: count it in its group; tag the group once all are."""
        group = self.groups[(s["run"], s["uid"])]
        group["terminal"] += 1
        group[s["state"]] += 1
        tables = self._group_metrics(group)
        if value is not None:
            n = group["group_size"]
            old = group["reward_sum"] / group["reward_count"] if group["reward_count"] else None
            group["reward_sum"] += value
            group["reward_count"] += 1
            new = group["reward_sum"] / group["reward_count"]
            for table in tables:
                table.add(m.UID_MEAN_SUM.format(n=n), new - (old or 0.0))
                if old is None:
                    table.add(m.UIDS.format(n=n))
        if group["status"] == "pending" and group["terminal"] >= group["group_size"]:
            group["status"] = "finished" if group["succeeded"] > 0 else "failure"
            group["settled_position"] = r.position
            for table in tables:
                table.add(m.GROUPS_FINISHED if group["status"] == "finished" else m.GROUPS_FAILURE)
            self.queue.append({
                "run": group["run"], "partition": group["partition"], "global_step": group["global_step"],
                "key": group["uid"], "kind": "tag", "uid": group["uid"], "session_id": None, "session_index": None,
                "data_source": group["data_source"], "source_position": None, "reward": None, "is_placeholder": False,
                "failure_reason": None, "materialization_reason": None, "num_turns": None, "prompt_len": None,
                "response_len": None,
                "tags": {"is_prompt": True, "status": group["status"], "global_steps": group["global_step"]},
                "produced_position": r.position,
            })
            self.tag_count += 1

    # -------------------------------------------------------------- saving
    async def save(self) -> None:
        sessions_new = [s for sid, s in self.sessions.items() if sid in self.new_sessions]
        sessions_old = [s for sid, s in self.sessions.items() if sid not in self.new_sessions]
        await rm.save_rows(self.conn, sessions_table, sessions_new, sessions_old, keys=("session_id",))
        groups_new = [g for k, g in self.groups.items() if k in self.new_groups]
        groups_old = [g for k, g in self.groups.items() if k not in self.new_groups]
        await rm.save_rows(self.conn, groups_table, groups_new, groups_old, keys=("run", "uid"))
        changed = {scope: table.values for scope, table in self.metrics.items() if table.dirty}
        await rm.save_metrics(self.conn, changed, self.metric_ids)
        await rm.insert_queue_rows(self.conn, self.queue)

    async def queue_items(self) -> list[QueueItem]:
        """The page's queue rows with their token arrays, for external sinks."""
        from sessions import rows as row_builder  # torch: imported only when a sink needs arrays

        positions = [q["source_position"] for q in self.queue if q["kind"] == "row"]
        sources = await rm.source_events(self.conn, positions)
        built = iter(row_builder.materialise(self.queue, sources))
        return [
            QueueItem(q["run"], q["partition"], q["global_step"], q["key"], q["uid"], dict(q["tags"]),
                      next(built) if q["kind"] == "row" else None)
            for q in self.queue
        ]


_HANDLERS: dict[type, Callable[[_Page, ev.Recorded], None]] = {
    ev.SessionCreated: _Page.on_created,
    ev.SessionStarted: _Page.on_started,
    ev.TrajectoryRecorded: _Page.on_trajectory,
    ev.RewardPosted: _Page.on_reward,
    ev.SessionSucceeded: _Page.on_succeeded,
    ev.SessionFailed: _Page.on_failed,
    ev.PlaceholderEmitted: _Page.on_placeholder,
    ev.SessionCancelled: _Page.on_cancelled,
}

