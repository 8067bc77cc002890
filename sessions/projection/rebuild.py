"""The whole-log rebuild: the projection rules applied to a whole log at once (replay, audit).

The incremental projector loads and saves the rows each page touches; a rebuild starts from
empty read models, so it keeps one working set for the whole log and writes each table once, at
driver level. The rules are the same (`sessions.projection.rules`), so its rows equal the
projector's; only the I/O around them differs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessions.errors import UsageError
from sessions.events import RUN_STREAM_PREFIX
from sessions.gc_pause import gc_paused
from sessions.projection.decoding import Decoder
from sessions.projection.rules import NO_CREATION, TERMINAL_STATES, Row, Rules, WorkingSet

__all__ = [
    "ReadModels",
    "Rebuild",
    "without_pruned",
]


@dataclass
class ReadModels:
    """What a rebuild produced, as rows keyed by column name (queue rows in queue order).

    JSON columns (`sessions.reward_info`, `queue_rows.tags`) hold Python values; `created_at`
    and `terminal_at` hold the events' `recorded_at` exactly as the reader returned it.
    """

    sessions: list[Row] = field(default_factory=list)
    groups: list[Row] = field(default_factory=list)
    metrics: list[Row] = field(default_factory=list)
    queue: list[Row] = field(default_factory=list)
    errors: list[Row] = field(default_factory=list)
    last_position: int = 0
    events: int = 0


class Rebuild:
    """Feed pages of `sessions.projection.decoding.EVENT_COLUMNS` tuples in position order, then
    take `result()`."""

    def __init__(self) -> None:
        self.state = WorkingSet()
        self.rules = Rules(self.state)
        self.decoder = Decoder()
        self.last_position = 0
        self.events = 0
        #: (run, partition, step) of every step a `PayloadsPruned` event in the fed log pruned:
        #: their queue rows were dropped with their payloads, so the rebuild drops them too.
        self.pruned: set[tuple[str, str, int]] = set()
        #: (run, partition, step) of every step `evict_closed` took out of memory, and whether a
        #: later event may have reached one of them (a creation in the step, or an event of a
        #: session the rules no longer hold: `suspects`, to be looked up in the log). Either
        #: makes the evicted rows possibly stale; the audit then folds again without evicting.
        self.evicted_steps: set[tuple[str, str, int]] = set()
        self.late_creation = False
        self.suspects: set[str] = set()
        self._finished = False

    def feed(self, rows: Sequence[Sequence[Any]]) -> None:
        if self._finished:
            raise UsageError(
                "Rebuild.feed() after result(): a rebuild's rules are released with its result"
            )
        if not rows:
            return
        errors_before = len(self.state.errors)
        with gc_paused():  # the rebuild only allocates rows it keeps (sessions.gc_pause says why)
            self.rules.apply_all(self.decoder.events(rows))
        if self.evicted_steps:
            self._watch_evicted(errors_before)
        # What the incremental projector writes back; a rebuild writes every row it holds, and
        # these sets would otherwise hold every session and group of the log.
        for done in (
            "new_sessions",
            "touched_sessions",
            "new_groups",
            "touched_groups",
            "relaunched",
        ):
            getattr(self.state, done).clear()
        for row in rows:
            if row[3] == "PayloadsPruned":
                self._pruned(row[1], row[5])
        self.last_position = rows[-1][0]
        self.events += len(rows)

    def _watch_evicted(self, errors_before: int) -> None:
        state = self.state
        for sid in state.new_sessions:
            row = state.sessions.get(sid)
            if row is not None and _step_of(row) in self.evicted_steps:
                self.late_creation = True
        for error in state.errors[errors_before:]:
            if error["reason"] == NO_CREATION:
                self.suspects.add(error["session_id"])

    def evict_closed(self, before: int) -> ReadModels:
        """Take out of memory, and return, the rows of every step that looks done: all its
        sessions terminal by a position before `before`, none of its groups pending. Queue rows
        keep the ids they were given; metrics are derived first. Sessions without a step stay.

        A step that looks done can still get events (a late creation, an event after the end);
        `evicted_steps`, `late_creation` and `suspects` record what a caller needs to tell."""
        state = self.state
        done: dict[tuple[str, str, int], bool] = {}
        for row in state.sessions.values():
            key = _step_of(row)
            if key[2] is None:
                continue
            ended = row["terminal_position"]
            ok = row["state"] in TERMINAL_STATES and ended is not None and ended < before
            done[key] = done.get(key, True) and ok  # type: ignore[index]
        for row in state.groups.values():
            key = _step_of(row)
            if row["status"] == "pending" and key in done:
                done[key] = False  # type: ignore[index]
        closed = {key for key, ok in done.items() if ok}
        if not closed:
            return ReadModels(last_position=self.last_position, events=self.events)
        self.evicted_steps |= closed
        sids = [sid for sid, row in state.sessions.items() if _step_of(row) in closed]
        out_sessions = [state.sessions.pop(sid) for sid in sids]
        for sid in sids:
            state.trajectories.pop(sid, None)
        group_keys = [k for k, row in state.groups.items() if _step_of(row) in closed]
        out_groups = [state.groups.pop(k) for k in group_keys]
        scopes = [scope for scope in state.metrics if scope[:3] in closed]
        metrics = []
        for scope in scopes:
            table = state.metrics.pop(scope)
            if table.dirty:
                table.derive()
            metrics.extend(_metric_rows(scope, table.values))
        self.rules.forget(sids, closed)
        kept, out_queue = [], []
        for q in state.queue:
            (out_queue if _step_of(q) in closed else kept).append(q)
        state.queue = kept
        return ReadModels(
            sessions=out_sessions,
            groups=out_groups,
            metrics=metrics,
            queue=out_queue,
            last_position=self.last_position,
            events=self.events,
        )

    def _pruned(self, sid: str, raw: Any) -> None:
        try:
            data = raw if isinstance(raw, dict) else json.loads(raw)
            run = sid[len(RUN_STREAM_PREFIX) :]
            self.pruned.update((run, data["partition"], int(s)) for s in data["steps"])
        except (ValueError, TypeError, KeyError):
            pass  # the audit's log check reports a prune it cannot read

    def result(self) -> ReadModels:
        """The read models; call once, after the last `feed` (it derives the means)."""
        if self._finished:
            raise UsageError("Rebuild.result() was already taken")
        self._finished = True
        return self._models(copy=False)

    def snapshot(self) -> ReadModels:
        """The read models so far, copied, so that feeding on does not change them (the audit
        compares the read models up to the stored checkpoint, then checks the rest of the log)."""
        return self._models(copy=True)

    def _models(self, *, copy: bool) -> ReadModels:
        self.rules.finish()
        state = self.state
        metrics = [
            row
            for scope, table in state.metrics.items()
            for row in _metric_rows(scope, table.values)
        ]
        rows = (lambda values: [dict(row) for row in values]) if copy else list
        return ReadModels(
            sessions=rows(state.sessions.values()),
            groups=rows(state.groups.values()),
            metrics=metrics,
            queue=without_pruned(state.queue, self.pruned),
            errors=list(state.errors),
            last_position=self.last_position,
            events=self.events,
        )


def _step_of(row: Row) -> tuple[Any, Any, Any]:
    return (row["run"], row["partition"], row["global_step"])


def _metric_rows(scope: tuple[Any, ...], values: dict[str, float]) -> list[Row]:
    run, partition, step, source = scope
    return [
        {
            "run": run,
            "partition": partition,
            "global_step": step,
            "data_source": source,
            "metric": name,
            "value": value,
        }
        for name, value in values.items()
    ]


def _rebuild_rows(rows: Iterable[Sequence[Any]]) -> ReadModels:
    """Rebuild from one iterable of `EVENT_COLUMNS` tuples (tests and small logs)."""
    rebuilt = Rebuild()
    rebuilt.feed(list(rows))
    return rebuilt.result()


def without_pruned(queue: Iterable[Row], pruned: set[tuple[str, str, int]]) -> list[Row]:
    """The queue rows but those of pruned steps (in order, so the others keep their ids)."""
    if not pruned:
        return list(queue)
    return [q for q in queue if (q["run"], q["partition"], q["global_step"]) not in pruned]
