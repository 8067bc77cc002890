"""What a projector keeps between its pages: the rows its last committed page left, and the batch
rows of the steps it projected from their first session (`sessions.projection.projector` says
when they are used and when dropped).

Bounded: `_MAX_HELD_SESSIONS` open sessions, `MAX_HELD_STEPS` steps, `MAX_HELD_BYTES` of payloads
for the steps and, apart, for the open sessions' trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sessions.projection import metrics as m
from sessions.projection.decoding import CURRENT
from sessions.projection.rules import TERMINAL_STATES, GroupKey, LogEvent, Row, WorkingSet
from store import read_models as rm

__all__ = [
    "Held",
    "HeldStep",
    "MAX_HELD_BYTES",
    "MAX_HELD_STEPS",
    "StepKey",
    "hold",
    "page_sources",
]


#: Open sessions a projector holds between pages at most; past it, the next page reads them again.
_MAX_HELD_SESSIONS = 200_000
#: Steps whose batch rows a projector holds (the most recently begun), and the payload bytes it
#: holds at most for them and, apart, for the open sessions' trajectories.
MAX_HELD_STEPS = 8
MAX_HELD_BYTES = 512 << 20

StepKey = tuple[str, str, "int | None"]


@dataclass
class HeldStep:
    """A step's queue rows of kind `row` in queue order and the events they point at, payloads
    included: what `ledger.batch` would read back from the queue table and the log."""

    queue: list[Row] = field(default_factory=list)
    sources: dict[int, rm.SourceEvent] = field(default_factory=dict)
    size: int = 0  # payload bytes


@dataclass
class Held:
    """The read-model rows as this projector's last committed page left them (see the module doc).

    `complete` names the held sessions whose recorded trajectories `trajectories` (and their
    events, payloads included, in `sources`) holds in full: their creation was projected while
    held; any other session's are read from the log when it ends. `steps` holds the batch rows
    of the steps whose first session was projected while held (so every row of theirs was made
    here), until a row's source is not held.
    """

    position: int
    stamp: Any
    sessions: dict[str, Row] = field(default_factory=dict)
    groups: dict[GroupKey, Row] = field(default_factory=dict)
    metrics: dict[m.Scope, m.MetricTable] = field(default_factory=dict)
    trajectories: dict[str, dict[int, tuple[int, dict[str, Any]]]] = field(default_factory=dict)
    complete: set[str] = field(default_factory=set)
    sources: dict[int, rm.SourceEvent] = field(default_factory=dict)
    steps: dict[StepKey, HeldStep] = field(default_factory=dict)
    #: The id the next queue row takes (None: read it), as the page counted it.
    next_queue_id: int | None = None


def hold(
    state: WorkingSet, position: int, stamp: Any, held: Held, page: dict[int, rm.SourceEvent]
) -> Held | None:
    """What to keep of a committed page's rows: open sessions (their trajectories and sources where
    complete), pending groups, the metric scopes it wrote (marked clean), the held steps' batch
    rows. None past `_MAX_HELD_SESSIONS`."""
    complete = held.complete | state.new_sessions
    sessions = {
        sid: row for sid, row in state.sessions.items() if row["state"] not in TERMINAL_STATES
    }
    if len(sessions) > _MAX_HELD_SESSIONS:
        return None
    _hold_rows(held.steps, state.queue, held.sources, page)
    complete &= sessions.keys()
    trajectories = {sid: known for sid, known in state.trajectories.items() if sid in complete}
    sources = {
        pos: src
        for known in trajectories.values()
        for pos, _data in known.values()
        if (src := held.sources.get(pos) or page.get(pos)) is not None
    }
    if sum(len(src[3] or b"") for src in sources.values()) > MAX_HELD_BYTES:
        complete, trajectories, sources = set(), {}, {}  # read back when the sessions end
        held.steps.clear()
    groups = {key: row for key, row in state.groups.items() if row["status"] == "pending"}
    metrics = {scope: table for scope, table in state.metrics.items() if table.dirty}
    for table in metrics.values():
        table.dirty = False
    return Held(
        position,
        stamp,
        sessions,
        groups,
        metrics,
        trajectories,
        complete,
        sources,
        held.steps,
        state.next_queue_id,
    )


def _hold_rows(
    steps: dict[StepKey, HeldStep], queue: list[Row], *sources: dict[int, rm.SourceEvent]
) -> None:
    """Add a page's batch rows to their held steps; a step with a row whose source (a trajectory's
    payload above all) is not held is let go, as are the oldest past the limits."""
    for row in queue:
        key = (row["run"], row["partition"], row["global_step"])
        step = steps.get(key)
        if row["kind"] != "row" or step is None:
            continue
        position = row["source_position"]
        source = next((found[position] for found in sources if position in found), None)
        if source is None or (not row["is_placeholder"] and source[3] is None):
            del steps[key]
            continue
        step.queue.append(row)
        step.sources[position] = source
        step.size += len(source[3] or b"")
    while len(steps) > MAX_HELD_STEPS or sum(step.size for step in steps.values()) > MAX_HELD_BYTES:
        del steps[next(iter(steps))]


def page_sources(page: list[LogEvent], payloads: dict[int, bytes]) -> dict[int, rm.SourceEvent]:
    """The page's events as `store.read_models.source_events` gives them: data upcast already."""
    return {
        position: (type_, CURRENT.get(type_, 0), data, payloads.get(position))
        for position, _sid, _v, type_, data, _at, problem in page
        if problem is None
    }  # a quarantined event's raw data may differ from what decoded
