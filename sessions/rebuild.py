"""Fold a whole log into read-model rows in one pass: replay's fast path.

The incremental `Projector` pays per event for generality: a dataclass decode and upcast, read
models loaded and saved per page, SQLAlchemy parameter processing. A replay starts from empty
read models and sees the whole log, so it can fold plain tuples in memory — JSON `data` decoded
once, payloads never read — and write each table once.

The fold mirrors `sessions.projector._Page` handler by handler, with the same float operations in
the same order, so its rows equal the projector's exactly (tests/test_replay_equivalence.py checks
that on random logs). Errors mirror it too: a log the projector refuses (unknown type, newer
schema, missing fields, an event before its SessionCreated, a selected trajectory that was never
recorded) raises the projector's error here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessions import events as ev
from sessions import metrics as m
from sessions.errors import UnknownEventError
from sessions.projector import ProjectionError
from store.engine import load_json
from store.records import StoredEvent
from store.tables import groups as groups_table
from store.tables import queue_rows as queue_table
from store.tables import sessions as sessions_table

log = logging.getLogger(__name__)

#: The columns a fold reads from `events`, in this order.
EVENT_COLUMNS = ("position", "session_id", "version", "type", "schema_version", "data", "recorded_at")
#: What a fold selects for them: `recorded_at` only where a session takes it (created, terminal).
#: It is stored after the payload, so reading it for a trajectory walks that row's whole payload.
EVENT_SELECT = (
    *EVENT_COLUMNS[:-1],
    "CASE WHEN type IN ('SessionCreated', 'SessionSucceeded', 'SessionFailed', 'SessionCancelled') THEN recorded_at END",
)

SESSION_COLUMNS = tuple(c.name for c in sessions_table.c)
GROUP_COLUMNS = tuple(c.name for c in groups_table.c)
QUEUE_COLUMNS = tuple(c.name for c in queue_table.c if c.name != "id")
METRIC_COLUMNS = ("run", "partition", "global_step", "data_source", "metric", "value")


def _required(cls: type[ev.Event]) -> frozenset[str]:
    """Fields `from_data` cannot fill with a default: their absence is malformed data."""
    missing = (dataclasses.MISSING,)
    return frozenset(
        f.name for f in dataclasses.fields(cls)
        if f.default in missing and f.default_factory in missing and f.name != "payload"  # type: ignore[misc]
    )


#: Data texts up to this long are decoded once per distinct text (at most CACHED_ENTRIES per type).
CACHED_TEXT = 96
CACHED_ENTRIES = 4096
CURRENT = {name: cls.SCHEMA_VERSION for name, cls in ev.EVENT_TYPES.items()}
REQUIRED = {name: _required(cls) for name, cls in ev.EVENT_TYPES.items()}


@dataclass
class ReadModels:
    """What a fold produced: rows in table column order (queue rows in queue order, without ids).

    JSON columns (`sessions.reward_info`, `queue_rows.tags`) hold Python values; `created_at`
    and `terminal_at` hold the events' `recorded_at` exactly as the reader returned it.
    """

    sessions: list[tuple[Any, ...]] = field(default_factory=list)
    groups: list[tuple[Any, ...]] = field(default_factory=list)
    metrics: list[tuple[Any, ...]] = field(default_factory=list)
    queue: list[tuple[Any, ...]] = field(default_factory=list)
    last_position: int = 0
    events: int = 0


class Fold:
    """Feed pages of `EVENT_COLUMNS` tuples in position order, then take `result()`."""

    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, Any]] = {}
        self.session_tables: dict[str, list[m.MetricTable]] = {}
        self.groups: dict[tuple[str, str], dict[str, Any]] = {}
        self.group_tables: dict[tuple[str, str], list[m.MetricTable]] = {}
        self.metrics: dict[m.Scope, m.MetricTable] = {}
        self._scopes: dict[tuple[Any, ...], list[m.MetricTable]] = {}
        self._finished = False
        #: session -> its TrajectoryRecorded events so far, as (position, data)
        self.trajectories: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self.queue: list[tuple[Any, ...]] = []
        self.last_position = 0
        self.events = 0
        self._decoded: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in CURRENT}
        self._handlers = {
            "SessionStarted": self._started,
            "TrajectoryRecorded": self._trajectory,
            "RewardPosted": self._reward,
            "SessionSucceeded": self._succeeded,
            "SessionFailed": self._failed,
            "PlaceholderEmitted": self._placeholder,
            "SessionCancelled": self._cancelled,
        }

    # ------------------------------------------------------------ input
    def feed(self, rows: Sequence[Sequence[Any]]) -> None:
        handlers, sessions, decode = self._handlers, self.sessions, self._decode
        caches = self._decoded
        position = self.last_position
        for row in rows:
            position, sid, version, type_, schema, raw, recorded_at = row
            cache = caches.get(type_) if schema == CURRENT.get(type_) else None
            data = cache.get(raw) if cache is not None and type(raw) is str else None
            if data is None:
                data = decode(row, cache)
            if type_ == "SessionCreated":
                self._created(sid, position, data, recorded_at, version)
                continue
            session = sessions.get(sid)
            if session is None:
                raise ProjectionError(
                    f"event at position {position} ({type_}) belongs to session {sid!r}, "
                    "which has no SessionCreated before it; the log is damaged — run `rollout-ledger audit`"
                )
            session["version"] = version
            handlers[type_](session, position, data, recorded_at)
        if rows:
            self.last_position = position
            self.events += len(rows)

    def _decode(self, row: Sequence[Any], cache: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
        """An event's data as the projector sees it: parsed, upcast, checked for the fields its type
        needs. Short texts (a SessionStarted's, most RewardPosted's) repeat across a log, so their
        checked result is kept and shared: the fold never changes a data dict."""
        position, _sid, _version, type_, schema, raw, _at = row
        data = raw if type(raw) is dict else parse_json(raw)
        if CURRENT.get(type_) != schema:
            data = ev.upcast(type_, schema, data, None)  # raises on unknown types and newer schemas
        if type(data) is not dict:
            raise UnknownEventError(f"event at position {position} ({type_} v{schema}) has malformed data: not a JSON object")
        if not REQUIRED[type_] <= data.keys():
            _raise_decode_error(row, data)
        if cache is not None and type(raw) is str and len(raw) <= CACHED_TEXT and len(cache) < CACHED_ENTRIES:
            cache[raw] = data
        return data

    # ---------------------------------------------------------- handlers
    def _scoped(self, run: str, partition: str, step: int | None, source: str | None) -> list[m.MetricTable]:
        """The metric tables a session or group counts in (as `_Page._scoped`; made dirty at once,
        since every caller adds to them straight away)."""
        key = (run, partition, step, source)
        tables = self._scopes.get(key)
        if tables is None:
            tables = []
            for scope in m.scopes(run, partition, step, source):
                table = self.metrics.get(scope)
                if table is None:
                    table = self.metrics[scope] = m.MetricTable(dirty=True)
                tables.append(table)
            self._scopes[key] = tables
        return tables

    def _created(self, sid: str, position: int, e: dict[str, Any], recorded_at: Any, version: int) -> None:
        run, uid, partition, step = e["run"], e["uid"], e["partition"], e["global_step"]
        source, group_size = e.get("data_source"), e["group_size"]
        self.sessions[sid] = {
            "session_id": sid, "run": run, "uid": uid, "session_index": e["session_index"],
            "group_size": group_size, "partition": partition, "global_step": step,
            "data_source": source, "runner": e.get("runner"), "state": "created", "version": version,
            "num_trajectories": 0, "selected_rows": 0, "reward": None, "score_source": None, "reward_info": {},
            "failure_reason": None, "error_type": None, "message": None, "placeholder": False,
            "created_position": position, "terminal_position": None, "created_at": recorded_at, "terminal_at": None,
        }
        key = (run, uid)
        group = self.groups.get(key)
        if group is None:
            group = {
                "run": run, "uid": uid, "partition": partition, "global_step": step,
                "data_source": source, "group_size": group_size, "sessions_seen": 0, "terminal": 0,
                "succeeded": 0, "failed": 0, "cancelled": 0, "reward_sum": 0.0, "reward_count": 0,
                "status": "pending", "settled_position": None,
            }
            self.groups[key] = group
            tables = self.group_tables[key] = self._scoped(run, partition, step, source)
            _add(tables, m.GROUPS_TOTAL)
        group["sessions_seen"] += 1
        tables = self.session_tables[sid] = self._scoped(run, partition, step, source)
        _add(tables, m.SESSIONS_TOTAL)

    def _started(self, s: dict[str, Any], position: int, e: dict[str, Any], recorded_at: Any) -> None:
        s["state"] = "running"

    def _trajectory(self, s: dict[str, Any], position: int, e: dict[str, Any], recorded_at: Any) -> None:
        s["num_trajectories"] += 1
        self.trajectories.setdefault(s["session_id"], []).append((position, e))

    def _reward(self, s: dict[str, Any], position: int, e: dict[str, Any], recorded_at: Any) -> None:
        reward = e["reward"]
        s["reward"] = reward
        s["reward_info"] = {**s["reward_info"], **e.get("info", {}), "reward": reward}

    def _succeeded(self, s: dict[str, Any], position: int, e: dict[str, Any], recorded_at: Any) -> None:
        sid = s["session_id"]
        s["state"], s["terminal_position"], s["terminal_at"] = "succeeded", position, recorded_at
        score, selected = e["score"], e["selected"]
        reward = 0.0 if score is None else float(score)
        s["reward"], s["score_source"], s["selected_rows"] = score, e["score_source"], len(selected)
        tables = self.session_tables[sid]
        _add(tables, m.SESSIONS_SUCCEEDED)
        if score is None:
            _add(tables, m.REWARD_ABSENT)
        # A terminal session's trajectories are never selected again (a second terminal event is
        # damage the audit reports, and the projector itself cannot project it): let them go.
        known = {int(data["index"]): (at, data) for at, data in self.trajectories.pop(sid, ())}
        for index in selected:
            if index not in known:
                raise ProjectionError(
                    f"SessionSucceeded at position {position} selects trajectory {index} of session "
                    f"{sid!r}, which has no such TrajectoryRecorded; run `rollout-ledger audit`"
                )
            source_position, data = known[index]
            self._row(s, position, index, source_position, reward, False, data, None, None)
        self._settle(s, position, reward)

    def _failed(self, s: dict[str, Any], position: int, e: dict[str, Any], recorded_at: Any) -> None:
        s["state"], s["terminal_position"], s["terminal_at"] = "failed", position, recorded_at
        self.trajectories.pop(s["session_id"], None)
        reason = e["reason"]
        s["failure_reason"], s["error_type"], s["message"] = reason, e["error_type"], e["message"]
        tables = self.session_tables[s["session_id"]]
        _add(tables, m.SESSIONS_FAILED)
        _add(tables, m.FAILED_BY_REASON.format(reason=reason))
        if e.get("placeholder", "emit") == "drop":
            self._settle(s, position, None)

    def _placeholder(self, s: dict[str, Any], position: int, e: dict[str, Any], recorded_at: Any) -> None:
        if s["state"] != "failed" or s["placeholder"]:
            log.warning("ignoring PlaceholderEmitted at position %s: session %s is %s", position, s["session_id"], s["state"])
            return
        reward = float(e.get("reward", 0.0))
        s["placeholder"] = True
        s["selected_rows"] = 1
        self._row(s, position, 0, position, reward, True, None, e["reason"], e.get("materialization_reason", "session_failed"))
        _add(self.session_tables[s["session_id"]], m.PLACEHOLDERS)
        self._settle(s, position, reward)

    def _cancelled(self, s: dict[str, Any], position: int, e: dict[str, Any], recorded_at: Any) -> None:
        s["state"], s["terminal_position"], s["terminal_at"] = "cancelled", position, recorded_at
        self.trajectories.pop(s["session_id"], None)
        s["message"] = e.get("message")
        _add(self.session_tables[s["session_id"]], m.SESSIONS_CANCELLED)
        self._settle(s, position, None)

    def _row(
        self, s: dict[str, Any], position: int, key_index: int, source_position: int, reward: float, placeholder: bool,
        data: dict[str, Any] | None, failure_reason: str | None, materialization_reason: str | None,
    ) -> None:
        prompt_len = 1 if data is None else int(data["prompt_len"])
        response_len = 1 if data is None else int(data["response_len"])
        materialization = materialization_reason if data is None else data.get("materialization_reason")
        uid, step = s["uid"], s["global_step"]
        self.queue.append((
            s["run"], s["partition"], step, f"{uid}_{s['session_index']}_{key_index}", "row", uid,
            s["session_id"], s["session_index"], s["data_source"], source_position, reward, placeholder,
            failure_reason, materialization, 0 if data is None else int(data["num_turns"]), prompt_len, response_len,
            {
                "status": "finished", "global_steps": step, "prompt_len": prompt_len,
                "response_len": response_len, "seq_len": prompt_len + response_len, "uid": uid,
                "materialization_reason": materialization, "is_placeholder": placeholder,
            },
            position,
        ))

    def _settle(self, s: dict[str, Any], position: int, value: float | None) -> None:
        """As `_Page._settle`: count the session in its group; tag the group once all are terminal."""
        key = (s["run"], s["uid"])
        group = self.groups[key]
        group["terminal"] += 1
        group[s["state"]] += 1
        tables = self.group_tables[key]
        if value is not None:
            n = group["group_size"]
            old = group["reward_sum"] / group["reward_count"] if group["reward_count"] else None
            group["reward_sum"] += value
            group["reward_count"] += 1
            new = group["reward_sum"] / group["reward_count"]
            mean_sum, uids = _per_group_size(n)
            _add(tables, mean_sum, new - (old or 0.0))
            if old is None:
                _add(tables, uids)
        if group["status"] == "pending" and group["terminal"] >= group["group_size"]:
            group["status"] = "finished" if group["succeeded"] > 0 else "failure"
            group["settled_position"] = position
            _add(tables, m.GROUPS_FINISHED if group["status"] == "finished" else m.GROUPS_FAILURE)
            self.queue.append((
                group["run"], group["partition"], group["global_step"], group["uid"], "tag", group["uid"],
                None, None, group["data_source"], None, None, False, None, None, None, None, None,
                {"is_prompt": True, "status": group["status"], "global_steps": group["global_step"]},
                position,
            ))

    # ----------------------------------------------------------- output
    def _row_metrics(self) -> None:
        """The projector's per-row adds (rows, reward sums, response lengths), replayed from the
        queue rows: one row per add, in the order they were made, so the sums are bit-identical."""
        ROWS, REWARD_SUM, REWARD_SUM_SUCCESS = m.ROWS, m.REWARD_SUM, m.REWARD_SUM_SUCCESS  # noqa: N806
        ROWS_SUCCEEDED, LENGTH_SUM = m.ROWS_SUCCEEDED, m.RESPONSE_LENGTH_SUM  # noqa: N806
        tables: dict[tuple[Any, ...], list[m.MetricTable]] = {}
        for row in self.queue:
            if row[4] != "row":
                continue
            run, partition, step, _key, _kind, _uid, _sid, _index, source = row[:9]
            reward, placeholder, response_len = row[10], row[11], row[16]
            scoped = tables.get((run, partition, step, source))
            if scoped is None:
                scoped = tables[(run, partition, step, source)] = self._scoped(run, partition, step, source)
            for table in scoped:  # `_add` inlined: this loop runs once per queue row and table
                values = table.values
                values[ROWS] = values.get(ROWS, 0.0) + 1.0
                values[REWARD_SUM] = values.get(REWARD_SUM, 0.0) + reward
                if not placeholder:
                    values[ROWS_SUCCEEDED] = values.get(ROWS_SUCCEEDED, 0.0) + 1.0
                    values[REWARD_SUM_SUCCESS] = values.get(REWARD_SUM_SUCCESS, 0.0) + reward
                    values[LENGTH_SUM] = values.get(LENGTH_SUM, 0.0) + response_len
                    table.maximum(m.RESPONSE_LENGTH_MAX, response_len)

    def result(self) -> ReadModels:
        """The read models; call once, after the last `feed` (it completes the metric counters)."""
        if self._finished:
            raise RuntimeError("Fold.result() was already taken")
        self._finished = True
        self._row_metrics()
        metrics = []
        for (run, partition, step, source), table in self.metrics.items():
            if table.dirty:
                table.derive()
                metrics.extend((run, partition, step, source, name, value) for name, value in table.values.items())
        return ReadModels(
            sessions=list(map(_SESSION_ROW, self.sessions.values())),
            groups=list(map(_GROUP_ROW, self.groups.values())),
            metrics=metrics,
            queue=self.queue,
            last_position=self.last_position,
            events=self.events,
        )


_raw_decode = json.JSONDecoder().raw_decode


def parse_json(raw: str | bytes) -> Any:
    """`json.loads` without its Python-level wrapper (two regex matches per call, a third of its
    cost on small documents); anything unusual — surrounding whitespace, bytes, an error — goes
    through `load_json`, which also words the error."""
    if type(raw) is str:
        try:
            data, end = _raw_decode(raw)
        except ValueError:
            pass
        else:
            if end == len(raw):
                return data
    return load_json(raw)


_SESSION_ROW = operator.itemgetter(*SESSION_COLUMNS)
_GROUP_ROW = operator.itemgetter(*GROUP_COLUMNS)


def _add(tables: list[m.MetricTable], name: str, amount: float = 1.0) -> None:
    """`MetricTable.add` on each table (tables from `_scoped` are dirty already)."""
    for table in tables:
        values = table.values
        values[name] = values.get(name, 0.0) + amount


@functools.cache
def _per_group_size(n: int) -> tuple[str, str]:
    return m.UID_MEAN_SUM.format(n=n), m.UIDS.format(n=n)


def _raise_decode_error(row: Sequence[Any], data: dict[str, Any]) -> None:
    """Raise the error `ev.decode` raises for this event (the projector's own message)."""
    position, sid, version, type_, schema, _raw, recorded_at = row
    stored = StoredEvent(position, "", sid, version, type_, schema, "", "", "", None, data, None, recorded_at)
    ev.decode(stored)
    raise UnknownEventError(f"event at position {position} ({type_} v{schema}) has malformed data")  # pragma: no cover


def fold(rows: Iterable[Sequence[Any]]) -> ReadModels:
    """Fold one iterable of `EVENT_COLUMNS` tuples (tests and small logs)."""
    folded = Fold()
    folded.feed(list(rows))
    return folded.result()
