"""What one run of the projection rules reads and changes: rows keyed by column name.

The incremental projector loads a page's working set from the database and writes back what
changed; the whole-log rebuild starts from an empty one (docs/design.md §7). The rules
(`sessions.projection.rules`) are the only code that changes one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sessions.events import DEFAULT_MIN_VALID
from sessions.projection import metrics as m

__all__ = [
    "TERMINAL_STATES",
    "GroupKey",
    "LogEvent",
    "Row",
    "WorkingSet",
    "group_conflict",
    "group_key",
    "group_min_valid",
]

Row = dict[str, Any]
#: A group's key: (run, partition, global_step, uid) — a uid that comes back at a later step is a
#: new group (docs/design.md §2).
GroupKey = tuple[str, str, "int | None", str]
#: What the rules read of one event: (position, session_id, version, type, data, recorded_at,
#: problem). `data` is decoded, upcast to the current schema and checked against
#: `sessions.storable` (`sessions.projection.decoding`); `problem` is None, or (field, reason)
#: when the event cannot be projected as it is (then `data` may be None).
LogEvent = tuple[int, str, int, str, "dict[str, Any] | None", Any, "tuple[str | None, str] | None"]

#: A session in one of these states is over: later events of its stream are not projected.
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


def group_key(row: Row) -> GroupKey:
    """The group a session (or group) row belongs to."""
    return (row["run"], row["partition"], row["global_step"], row["uid"])


@dataclass
class WorkingSet:
    """The read-model rows a run of the rules may read or change, plus what it produced.

    `trajectories` maps a session to its recorded, not yet terminal trajectories
    (index -> (position, data)); `queue` holds the queue rows made, in queue order, with `id`s
    counted from `next_queue_id`, so a replay numbers them exactly as the live projector did.
    """

    sessions: dict[str, Row] = field(default_factory=dict)
    groups: dict[GroupKey, Row] = field(default_factory=dict)
    metrics: dict[m.Scope, m.MetricTable] = field(default_factory=dict)
    trajectories: dict[str, dict[int, tuple[int, dict[str, Any]]]] = field(default_factory=dict)
    queue: list[Row] = field(default_factory=list)
    next_queue_id: int = 1
    #: `projection_errors` rows made: the events quarantined.
    errors: list[Row] = field(default_factory=list)
    #: Keys of the sessions and groups the rules created (to insert, not update).
    new_sessions: set[str] = field(default_factory=set)
    new_groups: set[GroupKey] = field(default_factory=set)
    #: Every session and group the rules changed (the others were only read).
    touched_sessions: set[str] = field(default_factory=set)
    touched_groups: set[GroupKey] = field(default_factory=set)
    #: Steps (run, partition, global_step) a later launch took over in this run of the rules:
    #: their metric scopes start again (`Rules._relaunch`), so what was stored for them goes.
    relaunched: set[tuple[str, str, int | None]] = field(default_factory=set)
    #: Copies of the rows as stored before the run (the incremental projector's), so only the
    #: columns the rules changed are written back; the rules never read them.
    stored_sessions: dict[str, Row] = field(default_factory=dict)
    stored_groups: dict[GroupKey, Row] = field(default_factory=dict)

    @property
    def rows_made(self) -> int:
        return sum(1 for q in self.queue if q["kind"] == "row")

    @property
    def tags_made(self) -> int:
        return sum(1 for q in self.queue if q["kind"] == "tag")

    def changed_metrics(self) -> dict[m.Scope, dict[str, float]]:
        return {scope: table.values for scope, table in self.metrics.items() if table.dirty}


def group_conflict(group: Row, e: dict[str, Any]) -> tuple[str, str] | None:
    """Why a new session cannot join an existing group: another size, or a taken index."""
    if e["group_size"] != group["group_size"]:
        return (
            "group_size",
            f"group_size {e['group_size']} differs from its group's {group['group_size']}",
        )
    if e["session_index"] in group["members"]:
        return ("session_index", f"session_index {e['session_index']} is taken in its group")
    return None


def group_min_valid(created: dict[str, Any]) -> int:
    """The group's `min_valid`, from its first session's creation (the default when it names none)."""
    value = created.get("min_valid")
    return DEFAULT_MIN_VALID if value is None else int(value)
