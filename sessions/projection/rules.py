"""The projection rules, written once: events -> read-model rows, queue rows and metric counts.

Pure: no SQL, no torch, no I/O. `Rules.apply` folds one decoded event into a `WorkingSet` (the
rows the events touch, held in memory as dicts keyed by column name). The incremental projector
loads the working set of one page from the database, applies the page and writes back what
changed; the whole-log rebuild (replay, audit) starts from an empty working set and applies the
whole log. Both therefore make the same float additions in the same order, and their rows are
equal by construction rather than by a test's vigilance.

An event the rules cannot project (a log written by an older version, or by a writer that
skipped validation) never stops projection: it is quarantined by a deterministic rule (docs/design.md §7)
— listed in `projection_errors`, and its session, if it has one still open, failed as
`unprojectable` with a placeholder so its group settles — and the rules go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sessions.events import RUN_STREAM_EVENTS
from sessions.failure_policy import EXCLUDE, ZERO
from sessions.placeholder import DROP, EMIT, KEEP_PARTIAL
from sessions.projection import metrics as m
from sessions.projection.queue_row import batch_row, group_tag
from sessions.projection.working_set import (
    TERMINAL_STATES,
    GroupKey,
    LogEvent,
    Row,
    WorkingSet,
    group_conflict,
    group_key,
    group_min_valid,
)
from sessions.storable import IDENTITY, clean_text
from sessions.vocabulary import INFRA, POLICY, UNPROJECTABLE

__all__ = [
    "GroupKey",
    "LogEvent",
    "NO_CREATION",
    "Row",
    "Rules",
    "TERMINAL_STATES",
    "WorkingSet",
    "group_key",
]

#: `projection_errors.outcome`: what the rules did with the event.
FAILED, IGNORED = "session_failed", "ignored"


#: Why an event of a session the rules do not hold is quarantined.
NO_CREATION = "its session has no projected SessionCreated before it"


class Rules:
    """Apply events, in log order, to one working set; `finish()` derives the means after."""

    def __init__(self, state: WorkingSet) -> None:
        self.state = state
        self._sessions = state.sessions
        self._touched = state.touched_sessions
        self._tables: dict[tuple[Any, ...], list[m.MetricTable]] = {}
        self._session_tables: dict[str, list[m.MetricTable]] = {}
        #: each step's scopes in the working set, for `_relaunch` (a rebuild holds every step's)
        self._step_scopes: dict[tuple[Any, ...], list[m.Scope]] = {}
        for scope in state.metrics:
            self._step_scopes.setdefault(scope[:3], []).append(scope)

    def forget(self, sids: list[str], steps: set[tuple[Any, Any, Any]]) -> None:
        """Drop the cached metric tables of sessions and steps a rebuild took out of memory."""
        for sid in sids:
            self._session_tables.pop(sid, None)
        for key in [k for k in self._tables if k[:3] in steps]:
            del self._tables[key]
        for step in steps:
            self._step_scopes.pop(step, None)

    def apply(self, event: LogEvent) -> None:
        position, sid, version, type_, data, recorded_at, problem = event
        if type_ in RUN_STREAM_EVENTS:
            # a run's own stream: read by the ledger (a prune drops its queue rows itself; a
            # launch is seen through its sessions' `launch`, `_created`)
            return
        if type_ == "SessionCreated":
            self._created(sid, position, version, data, recorded_at, problem)
            return
        session = self._sessions.get(sid)
        if session is None:
            self._error(
                position,
                sid,
                type_,
                None,
                NO_CREATION,
                IGNORED,
            )
            return
        session["version"] = version
        self._touched.add(sid)
        if session["failure_reason"] == UNPROJECTABLE:
            return  # quarantined: the rest of its stream is not projected
        if problem is not None:
            self._quarantine(session, position, type_, problem, recorded_at)
            return
        if session["state"] in TERMINAL_STATES and not (
            type_ == "PlaceholderEmitted" and session["state"] == "failed"
        ):
            self._error(
                position, sid, type_, None, f"the session is already {session['state']}", IGNORED
            )
            return
        _HANDLERS[type_](self, session, position, data, recorded_at)  # type: ignore[arg-type]

    def apply_all(self, events: list[LogEvent]) -> None:
        for event in events:
            self.apply(event)

    def finish(self) -> None:
        """Recompute the derived metrics of every scope the events changed."""
        for table in self.state.metrics.values():
            if table.dirty:
                table.derive()

    # ------------------------------------------------------------ scopes
    def _scoped(
        self, run: str, partition: str, step: int | None, source: str | None
    ) -> list[m.MetricTable]:
        """The metric tables a session or group counts in: its data source's and all sources'."""
        key = (run, partition, step, source)
        tables = self._tables.get(key)
        if tables is None:
            tables = []
            for scope in m.scopes(run, partition, step, source):
                table = self.state.metrics.get(scope)
                if table is None:
                    table = self.state.metrics[scope] = m.MetricTable()
                    self._step_scopes.setdefault(scope[:3], []).append(scope)
                tables.append(table)
            self._tables[key] = tables
        return tables

    def _of(self, row: Row) -> list[m.MetricTable]:
        return self._scoped(row["run"], row["partition"], row["global_step"], row["data_source"])

    def _of_session(self, s: Row) -> list[m.MetricTable]:
        """`_of` for a session, remembered per session (its scope never changes); none for a
        session a later launch superseded (`_relaunch` forgets what was remembered)."""
        sid = s["session_id"]
        tables = self._session_tables.get(sid)
        if tables is None:
            tables = self._session_tables[sid] = self._of(s) if self._current(s) else []
        return tables

    # ---------------------------------------------------------- launches
    def _launch_of_step(self, run: str, partition: str, step: int | None) -> int:
        """The launch whose sessions a step counts: the latest that created one there (0 before
        any launch was recorded), kept as the all-sources scope's `launch` value."""
        return int(self._scoped(run, partition, step, None)[0].values.get(_LAUNCH, 0))

    def _current(self, row: Row) -> bool:
        """Whether a session or group row belongs to its step's launch (else it is superseded)."""
        return (row.get("launch") or 0) >= self._launch_of_step(
            row["run"], row["partition"], row["global_step"]
        )

    def _relaunch(self, run: str, partition: str, step: int | None, launch: int) -> None:
        """A later launch's first session in a step: the step's figures start again from zero
        for that launch's sessions, keeping how many sessions earlier launches had there
        (`sessions/superseded`). Every scope of the step is in the working set (the projector
        loads them for a creation that carries a launch; a rebuild holds all)."""
        every_source = self._scoped(run, partition, step, None)[0]
        if not every_source.values:  # the step's first session: nothing to start again
            every_source.values[_LAUNCH] = float(launch)
            every_source.dirty = True
            return
        for scope in self._step_scopes.get((run, partition, step), ()):
            table = self.state.metrics.get(scope)
            # An empty table is one the projector loaded for a session still to come: what it
            # holds then is that session's alone, as in a rebuild, which makes it on creation.
            if table is None or (not table.values and table is not every_source):
                continue
            values = table.values
            superseded = values.get(_SUPERSEDED, 0.0) + values.get(m.SESSIONS_TOTAL, 0.0)
            values.clear()
            if superseded:
                values[_SUPERSEDED] = superseded
            table.dirty = True
        every_source.values[_LAUNCH] = float(launch)  # read by `_launch_of_step`
        self.state.relaunched.add((run, partition, step))
        self._session_tables.clear()  # sessions of the step counted so far are superseded now

    # ---------------------------------------------------------- handlers
    def _created(
        self,
        sid: str,
        position: int,
        version: int,
        e: dict[str, Any] | None,
        recorded_at: Any,
        problem: tuple[str | None, str] | None,
    ) -> None:
        state = self.state
        if sid in state.sessions:
            self._error(
                position,
                sid,
                "SessionCreated",
                "session_id",
                "the session was already created",
                IGNORED,
            )
            return
        if problem is not None and (e is None or problem[0] is None or problem[0] in IDENTITY):
            self._error(
                position, sid, "SessionCreated", problem[0], problem[1], IGNORED
            )  # no valid identity: no session
            return
        assert e is not None
        run, uid, partition, step = e["run"], e["uid"], e["partition"], e["global_step"]
        launch, owner = e.get("launch"), self._launch_of_step(run, partition, step)
        if launch is not None and launch > owner:
            self._relaunch(run, partition, step, launch)
            owner = launch
        # A session recorded without a launch belongs to its step's launch of the moment.
        launch = launch if launch is not None else (owner or None)
        key = (run, partition, step, uid)
        group = state.groups.get(key)
        conflict = group_conflict(group, e) if group is not None else None
        source = (
            None if problem is not None and problem[0] == "data_source" else e.get("data_source")
        )
        runner = None if problem is not None and problem[0] == "runner" else e.get("runner")
        session = state.sessions[sid] = {
            "session_id": sid,
            "run": run,
            "uid": uid,
            "session_index": e["session_index"],
            "group_size": e["group_size"],
            "partition": partition,
            "global_step": step,
            "data_source": source,
            "runner": runner,
            "state": "created",
            "version": version,
            "num_trajectories": 0,
            "selected_rows": 0,
            "reward": None,
            "score_source": None,
            "reward_info": {},
            "failure_reason": None,
            "error_type": None,
            "message": None,
            "placeholder": False,
            "attempts": 0,
            "failure_origin": None,
            "metric_policy": None,
            "partial": False,
            "model_calls": 0,
            "model_calls_failed": 0,
            "created_position": position,
            "terminal_position": None,
            "created_at": recorded_at,
            "terminal_at": None,
            "launch": launch,
        }
        state.new_sessions.add(sid)
        state.touched_sessions.add(sid)
        current = self._current(session)
        _add(self._of_session(session), m.SESSIONS_TOTAL)
        if not current:  # an earlier launch's, arriving after a later one took its step
            _add(self._of(session), _SUPERSEDED)
        if (
            conflict is not None
        ):  # it cannot join its group: failed on its own, no row, no group count
            self._fail(session, position, recorded_at, conflict[1])
            self._error(position, sid, "SessionCreated", conflict[0], conflict[1], FAILED)
            return
        if group is None:
            group = state.groups[key] = {
                "run": run,
                "uid": uid,
                "partition": partition,
                "global_step": step,
                "data_source": source,
                "group_size": e["group_size"],
                "sessions_seen": 0,
                "terminal": 0,
                "succeeded": 0,
                "failed": 0,
                "cancelled": 0,
                "reward_sum": 0.0,
                "reward_count": 0,
                "status": "pending",
                "settled_position": None,
                "members": [],
                "valid_rows": 0,
                "min_valid": group_min_valid(e),
                "launch": launch,
            }
            state.new_groups.add(key)
            if current:
                _add(self._of(group), m.GROUPS_TOTAL)
        state.touched_groups.add(key)
        group["sessions_seen"] += 1
        group["members"] = sorted((*group["members"], e["session_index"]))
        if problem is not None:  # a valid identity, another field unstorable: failed, with its row
            self._quarantine(session, position, "SessionCreated", problem, recorded_at)

    def _started(self, s: Row, position: int, e: dict[str, Any], recorded_at: Any) -> None:
        s["state"] = "running"
        s["attempts"] += 1
        _add(self._of_session(s), m.ATTEMPTS)

    def _attempt_failed(self, s: Row, position: int, e: dict[str, Any], recorded_at: Any) -> None:
        """A superseded attempt: its trajectories and reward are forgotten (the log keeps them)."""
        s["state"] = "retrying"
        self.state.trajectories.pop(s["session_id"], None)
        s["reward"], s["reward_info"] = None, {}
        tables = self._of_session(s)
        if s["attempts"] <= 1:  # its first superseded attempt
            _add(tables, m.SESSIONS_RETRIED)
        _add(tables, m.RETRIES_BY_REASON.format(reason=e["reason"]))

    def _trajectory(self, s: Row, position: int, e: dict[str, Any], recorded_at: Any) -> None:
        s["num_trajectories"] += 1
        known = self.state.trajectories.get(s["session_id"])
        if known is None:
            known = self.state.trajectories[s["session_id"]] = {}
        known[int(e["index"])] = (position, e)

    def _reward(self, s: Row, position: int, e: dict[str, Any], recorded_at: Any) -> None:
        reward = e["reward"]
        if reward is not None:
            reward = float(reward)  # PostgreSQL's jsonb hands 1e19 back as an int
        s["reward"] = reward
        s["reward_info"] = {**s["reward_info"], **e.get("info", {}), "reward": reward}

    def _terminal(
        self, s: Row, state: str, position: int, recorded_at: Any
    ) -> dict[int, tuple[int, dict[str, Any]]]:
        """Mark the session terminal; returns (and forgets) its recorded trajectories: a terminal
        session's trajectories are never selected again."""
        s["state"], s["terminal_position"], s["terminal_at"] = state, position, recorded_at
        return self.state.trajectories.pop(s["session_id"], None) or {}

    def _succeeded(self, s: Row, position: int, e: dict[str, Any], recorded_at: Any) -> None:
        known = self.state.trajectories.get(s["session_id"]) or {}
        missing = [index for index in e["selected"] if index not in known]
        if missing:
            self._quarantine(
                s,
                position,
                "SessionSucceeded",
                (
                    "selected",
                    f"selects trajectory {missing[0]}, which has no TrajectoryRecorded before it",
                ),
                recorded_at,
            )
            return
        self._terminal(s, "succeeded", position, recorded_at)
        score, selected = e["score"], e["selected"]
        reward = 0.0 if score is None else float(score)
        s["reward"], s["score_source"], s["selected_rows"] = (
            None if score is None else reward,
            e["score_source"],
            len(selected),
        )
        tables = self._of_session(s)
        _add(tables, m.SESSIONS_SUCCEEDED)
        if score is None:
            _add(tables, m.REWARD_ABSENT)
        for index in selected:
            source_position, data = known[index]
            self._row(s, position, index, source_position, reward, data=data)
        self._settle(s, position)

    def _failed(self, s: Row, position: int, e: dict[str, Any], recorded_at: Any) -> None:
        decision = e.get("placeholder", EMIT)
        known = self.state.trajectories.get(s["session_id"]) or {}
        selected = e.get("selected") or []
        missing = [index for index in selected if index not in known]
        if decision == KEEP_PARTIAL and (missing or not selected):
            detail = (
                f"keeps trajectory {missing[0]}, which has no TrajectoryRecorded in its attempt"
                if missing
                else "keeps no trajectory"
            )
            self._quarantine(s, position, "SessionFailed", ("selected", detail), recorded_at)
            return
        self._terminal(s, "failed", position, recorded_at)
        reason, origin, metric = e["reason"], e.get("origin", POLICY), e.get("metric", ZERO)
        s["failure_reason"], s["error_type"], s["message"] = reason, e["error_type"], e["message"]
        s["failure_origin"], s["metric_policy"] = origin, metric
        tables = self._of_session(s)
        _add(tables, m.SESSIONS_FAILED)
        _add(tables, m.FAILED_BY_REASON.format(reason=reason))
        _add(tables, m.FAILED_BY_ORIGIN.format(origin=origin))
        if e.get("retry_refused"):
            _add(tables, m.REFUSED_BY_BUDGET.format(budget=e["retry_refused"]))
        if metric == EXCLUDE:
            _add(tables, m.SESSIONS_EXCLUDED)
            _add(tables, m.EXCLUDED_BY_REASON.format(reason=reason))
        if decision == KEEP_PARTIAL:
            score = e.get("score")
            reward = 0.0 if score is None else float(score)
            s["reward"], s["partial"], s["selected_rows"] = reward, True, len(selected)
            for index in selected:
                source_position, data = known[index]
                self._row(
                    s,
                    position,
                    index,
                    source_position,
                    reward,
                    data=data,
                    failure_reason=reason,
                    partial=True,
                )
            self._settle(s, position)
        elif decision == DROP:
            self._settle(s, position)
        # else: the session settles at its PlaceholderEmitted, so its row precedes the group tag.

    def _placeholder(self, s: Row, position: int, e: dict[str, Any], recorded_at: Any) -> None:
        if s["placeholder"]:
            self._error(
                position,
                s["session_id"],
                "PlaceholderEmitted",
                None,
                "the session's placeholder was already emitted",
                IGNORED,
            )
            return
        reward = float(e.get("reward", 0.0))
        self._emit_placeholder(
            s,
            position,
            reward,
            e["reason"],
            e.get("materialization_reason", "session_failed"),
            lengths=(int(e.get("prompt_len", 1)), int(e.get("response_len", 1))),
        )

    def _emit_placeholder(
        self,
        s: Row,
        position: int,
        reward: float,
        reason: str,
        materialization: str,
        lengths: tuple[int, int] = (1, 1),
    ) -> None:
        s["placeholder"] = True
        s["selected_rows"] = 1
        self._row(
            s,
            position,
            0,
            position,
            reward,
            data=None,
            failure_reason=reason,
            materialization_reason=materialization,
            placeholder_lengths=lengths,
        )
        _add(self._of_session(s), m.PLACEHOLDERS)
        self._settle(s, position)

    def _cancelled(self, s: Row, position: int, e: dict[str, Any], recorded_at: Any) -> None:
        self._terminal(s, "cancelled", position, recorded_at)
        s["message"] = e.get("message")
        _add(self._of_session(s), m.SESSIONS_CANCELLED)
        self._settle(s, position)

    def _call_started(self, s: Row, position: int, e: dict[str, Any], recorded_at: Any) -> None:
        """A model call: counted on its session; its tokens reach the read models through the
        trajectory assembled from it at `complete` (the log keeps it for audits and history)."""
        s["model_calls"] += 1

    def _call_recorded(self, s: Row, position: int, e: dict[str, Any], recorded_at: Any) -> None:
        """A call's answer: in the log; its row is the trajectory assembled from it."""

    def _call_failed(self, s: Row, position: int, e: dict[str, Any], recorded_at: Any) -> None:
        s["model_calls_failed"] += 1

    # -------------------------------------------------------- quarantine
    def _error(
        self, position: int, sid: str, type_: str, field_: str | None, reason: str, outcome: str
    ) -> None:
        self.state.errors.append(
            {
                "position": position,
                "session_id": clean_text(sid, 128),
                "type": clean_text(type_, 64),
                "field": None if field_ is None else clean_text(field_, 128),
                "reason": clean_text(reason, 512),
                "outcome": outcome,
            }
        )

    def _fail(self, s: Row, position: int, recorded_at: Any, reason: str) -> None:
        """Fail a session as unprojectable and count it (its row and group are the caller's).
        `terminal_at` stays NULL: no event of the runner's carries the time of this failure (and a
        rebuild reads `recorded_at` only of creations and terminal events)."""
        self._terminal(s, "failed", position, None)
        s["failure_reason"], s["error_type"] = UNPROJECTABLE, None
        s["failure_origin"], s["metric_policy"] = INFRA, ZERO  # the ledger's own, never the model's
        s["message"] = clean_text(
            f"event at position {position} could not be projected: {reason}", 512
        )
        tables = self._of_session(s)
        _add(tables, m.SESSIONS_FAILED)
        _add(tables, m.FAILED_BY_REASON.format(reason=UNPROJECTABLE))
        _add(tables, m.FAILED_BY_ORIGIN.format(origin=INFRA))

    def _quarantine(
        self, s: Row, position: int, type_: str, problem: tuple[str | None, str], recorded_at: Any
    ) -> None:
        """An event of session `s` cannot be projected: list it; fail the session (placeholder
        included, so its group settles) unless it is over already."""
        field_, reason = problem
        if s["state"] == "failed" and not s["placeholder"] and type_ == "PlaceholderEmitted":
            self._emit_placeholder(
                s, position, 0.0, s["failure_reason"] or UNPROJECTABLE, "session_failed"
            )
            self._error(position, s["session_id"], type_, field_, reason, "placeholder_emitted")
            return
        if s["state"] in TERMINAL_STATES:
            self._error(position, s["session_id"], type_, field_, reason, IGNORED)
            return
        self._fail(s, position, recorded_at, reason)
        self._emit_placeholder(s, position, 0.0, UNPROJECTABLE, "session_failed")
        self._error(position, s["session_id"], type_, field_, reason, FAILED)

    # ------------------------------------------------------------ output
    def _queue(self, row: Row) -> None:
        state = self.state
        row["id"] = state.next_queue_id
        state.next_queue_id += 1
        state.queue.append(row)

    def _row(
        self,
        s: Row,
        position: int,
        key_index: int,
        source_position: int,
        reward: float,
        *,
        data: dict[str, Any] | None,
        failure_reason: str | None = None,
        materialization_reason: str | None = None,
        partial: bool = False,
        placeholder_lengths: tuple[int, int] = (1, 1),
    ) -> None:
        """One batch row (a selected trajectory, or the placeholder when `data` is None) and its
        counts. A `partial` row is a failed session's trajectory sent with its reward (keep_partial):
        in the reward means, not in the success-only figures. Rows of a session whose metric
        policy is `exclude` stay out of `reward/mean` and of their group's mean."""
        tables = self._of_session(s)
        if not tables:  # superseded by a later launch: no row, in no figure
            return
        placeholder = data is None
        prompt_len = placeholder_lengths[0] if placeholder else int(data["prompt_len"])  # type: ignore[index]
        response_len = placeholder_lengths[1] if placeholder else int(data["response_len"])  # type: ignore[index]
        materialization = (
            materialization_reason if placeholder else data.get("materialization_reason")
        )  # type: ignore[union-attr]
        self._queue(
            batch_row(
                s,
                position,
                key_index,
                source_position,
                reward,
                placeholder=placeholder,
                partial=partial,
                failure_reason=failure_reason,
                materialization=materialization,
                num_turns=0 if placeholder else int(data["num_turns"]),  # type: ignore[index]
                lengths=(prompt_len, response_len),
                versions=(None, None)
                if placeholder
                else (data.get("min_version"), data.get("max_version")),  # type: ignore[union-attr]
            )
        )
        group = self.state.groups[group_key(s)]
        excluded = s.get("metric_policy") == EXCLUDE
        if not excluded:  # its rows' sum, for `reward/mean@k`
            group["reward_sum"] += reward
            group["reward_count"] += 1
        if not placeholder:
            group["valid_rows"] += 1
        for table in tables:  # `MetricTable.add` inlined: this runs once per row and scope
            values = table.values
            table.dirty = True
            values[_ROWS] = values.get(_ROWS, 0.0) + 1.0
            values[_REWARD_SUM] = values.get(_REWARD_SUM, 0.0) + reward
            if excluded:
                values[_ROWS_EXCLUDED] = values.get(_ROWS_EXCLUDED, 0.0) + 1.0
                values[_REWARD_SUM_EXCLUDED] = values.get(_REWARD_SUM_EXCLUDED, 0.0) + reward
            if partial:
                values[_ROWS_PARTIAL] = values.get(_ROWS_PARTIAL, 0.0) + 1.0
            elif not placeholder:
                values[_ROWS_SUCCEEDED] = values.get(_ROWS_SUCCEEDED, 0.0) + 1.0
                values[_REWARD_SUM_SUCCESS] = values.get(_REWARD_SUM_SUCCESS, 0.0) + reward
                values[_LENGTH_SUM] = values.get(_LENGTH_SUM, 0.0) + response_len
                if response_len > values.get(_LENGTH_MAX, _MINUS_INF):
                    values[_LENGTH_MAX] = float(response_len)

    def _settle(self, s: Row, position: int) -> None:
        """A session is done for projection: count it in its group; once all are, tag the group
        and count its rows' mean under `reward/mean@k` (k its row count), as verl would see it."""
        key = group_key(s)
        group = self.state.groups[key]
        self.state.touched_groups.add(key)
        group["terminal"] += 1
        group[s["state"]] += 1
        if group["status"] == "pending" and group["terminal"] >= group["group_size"]:
            group["status"] = "finished" if group["succeeded"] > 0 else "failure"
            group["settled_position"] = position
            if not self._current(group):  # superseded: settled in SQL, in no figure, no tag
                return
            tables = self._of(group)
            _add(tables, m.GROUPS_FINISHED if group["status"] == "finished" else m.GROUPS_FAILURE)
            if group["partition"] == "train" and group["valid_rows"] < group["min_valid"]:
                _add(tables, m.GROUPS_BELOW_MIN_VALID)
            rows = group["reward_count"]
            if rows:
                mean = m.group_mean(group["reward_sum"], rows)
                for name, amount in (
                    (m.UID_MEAN_SUM.format(n=rows), mean),
                    (m.UIDS.format(n=rows), 1.0),
                    (_UID_MEAN_SUM_ALL, mean),
                    (_UIDS_ALL, 1.0),
                ):
                    _add(tables, name, amount)
            self._queue(group_tag(group, position))


#: Each session event's handler, as plain functions: a table of bound methods on the instance is a
#: reference cycle through the whole working set, which only a cyclic collection frees (0.4-0.7 s
#: for a 100k-event rebuild; the projector makes a Rules per page).
_HANDLERS: dict[str, Callable[[Rules, Row, int, dict[str, Any], Any], None]] = {
    "SessionStarted": Rules._started,
    "AttemptFailed": Rules._attempt_failed,
    "TrajectoryRecorded": Rules._trajectory,
    "RewardPosted": Rules._reward,
    "SessionSucceeded": Rules._succeeded,
    "SessionFailed": Rules._failed,
    "PlaceholderEmitted": Rules._placeholder,
    "SessionCancelled": Rules._cancelled,
    # A model call reaches the read models through the trajectory assembled from it.
    "ModelCallStarted": Rules._call_started,
    "ModelCallRecorded": Rules._call_recorded,
    "ModelCallFailed": Rules._call_failed,
}


_ROWS, _REWARD_SUM, _ROWS_SUCCEEDED = m.ROWS, m.REWARD_SUM, m.ROWS_SUCCEEDED
_ROWS_EXCLUDED, _REWARD_SUM_EXCLUDED, _ROWS_PARTIAL = (
    m.ROWS_EXCLUDED,
    m.REWARD_SUM_EXCLUDED,
    m.ROWS_PARTIAL,
)
_REWARD_SUM_SUCCESS, _LENGTH_SUM, _LENGTH_MAX = (
    m.REWARD_SUM_SUCCESS,
    m.RESPONSE_LENGTH_SUM,
    m.RESPONSE_LENGTH_MAX,
)
_UID_MEAN_SUM_ALL, _UIDS_ALL = m.UID_MEAN_SUM_ALL, m.UIDS_ALL
_LAUNCH, _SUPERSEDED = m.LAUNCH, m.SESSIONS_SUPERSEDED
_MINUS_INF = float("-inf")


def _add(tables: list[m.MetricTable], name: str, amount: float = 1.0) -> None:
    """`MetricTable.add` on each table, inlined (the rules' hottest call)."""
    for table in tables:
        values = table.values
        values[name] = values.get(name, 0.0) + amount
        table.dirty = True
