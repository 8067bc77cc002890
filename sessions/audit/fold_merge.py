"""The read models of a log folded in parts, put back together as one fold would have made them.

Every read model belongs to one step: a session, its group, and the metric scopes of its step and
data source, whose float sums depend on the order they were added in. A log folded by step, each
step whole in one part (`sessions.audit.parallel_fold`), therefore needs no arithmetic to merge:
only the order one process would have made the rows in, which each row (or the sessions beside
it) carries:

* sessions: by the position of their `SessionCreated` (a fold adds them in log order);
* groups: by the creation of their first session, which is when a fold adds a group;
* metric scopes: the step's all-sources scope at its first session's creation, a data source's
  scope at the first creation that names it; each scope's rows keep their order;
* queue rows and quarantined events: by the position of the event that made them (all the rows
  one event makes come from one part, in order); queue ids are counted again from 1.

A step whose rows come from two parts (a session re-created under another step, which routing
by the first creation cannot foresee) cannot be merged this way: `merge` returns None, and the
caller folds the log in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

from sessions.projection.rebuild import ReadModels, without_pruned
from sessions.projection.rules import Row

__all__ = ["merge"]

_CREATED = itemgetter("created_position")
_PRODUCED = itemgetter("produced_position")
_POSITION = itemgetter("position")


def merge(
    parts: Sequence[ReadModels],
    *,
    pruned: set[tuple[str, str, int]],
    last_position: int,
    events: int,
) -> ReadModels | None:
    """One fold's read models out of parts folded from disjoint sets of whole steps, each part's
    rows in its own fold's order and its queue rows not yet cut by `pruned` (the log's prunes,
    which the parts did not see). None when some step's rows are in two parts."""
    if not _steps_disjoint(parts):
        return None
    # Each part's rows are in order already: a sort finds those runs and merges them in C, with
    # no Python per row (heapq.merge's key call per row cost 4x more), stably.
    sessions = sorted(chain.from_iterable(p.sessions for p in parts), key=_CREATED)
    group_born: dict[tuple[Any, ...], int] = {}
    scope_born: dict[tuple[Any, ...], tuple[int, int]] = {}
    for s in sessions:
        step = (s["run"], s["partition"], s["global_step"])
        born = s["created_position"]
        group_born.setdefault((*step, s["uid"]), born)
        scope_born.setdefault((*step, None), (born, 0))
        if s["data_source"] is not None:
            scope_born.setdefault((*step, s["data_source"]), (born, 1))
    groups = [g for p in parts for g in p.groups]
    scopes = [block for p in parts for block in _scope_blocks(p.metrics)]
    if any(_group_of(g) not in group_born for g in groups) or any(
        scope not in scope_born for scope, _rows in scopes
    ):
        return None  # a row no session accounts for: not a fold of whole steps
    groups.sort(key=lambda g: group_born[_group_of(g)])
    scopes.sort(key=lambda block: scope_born[block[0]])
    queue = sorted(chain.from_iterable(p.queue for p in parts), key=_PRODUCED)
    for number, row in enumerate(queue, start=1):
        row["id"] = number
    return ReadModels(
        sessions=sessions,
        groups=groups,
        metrics=[row for _scope, rows in scopes for row in rows],
        queue=without_pruned(queue, pruned),
        errors=sorted(chain.from_iterable(p.errors for p in parts), key=_POSITION),
        last_position=last_position,
        events=events,
    )


def _group_of(row: Row) -> tuple[Any, ...]:
    return (row["run"], row["partition"], row["global_step"], row["uid"])


def _scope_blocks(metrics: Iterable[Row]) -> list[tuple[tuple[Any, ...], list[Row]]]:
    """A part's metric rows cut into its scopes' runs of rows (a fold lists a scope's together)."""
    blocks: list[tuple[tuple[Any, ...], list[Row]]] = []
    last: tuple[Any, ...] | None = None
    for row in metrics:
        scope = (row["run"], row["partition"], row["global_step"], row["data_source"])
        if scope != last:
            blocks.append((scope, []))
            last = scope
        blocks[-1][1].append(row)
    return blocks


def _steps_disjoint(parts: Sequence[ReadModels]) -> bool:
    """Whether no step has sessions in two parts. A part's groups and metric scopes are made by
    its own sessions' creations, so theirs are then apart too (and `merge` refuses a group or a
    scope that no session accounts for)."""
    seen: set[tuple[Any, ...]] = set()
    for part in parts:
        steps = {(s["run"], s["partition"], s["global_step"]) for s in part.sessions}
        if not seen.isdisjoint(steps):
            return False
        seen |= steps
    return True
