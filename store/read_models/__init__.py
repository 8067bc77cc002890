"""The read models: load and save the projector's rows (here), its reads of the log
(`log_reads.py`), the queries behind `Ledger.batch` and `metrics` (`queries.py`), their names and
keys (`keys.py`).

The projector loads only the rows a page of events touches, changes them in memory, and writes
them back in the same transaction as the page's queue rows and its checkpoint.
`from store import read_models` is the namespace of all of them, as one module was before the
room was split by job; the projection locks and the audit's key-ordered scans live beside them
(`projection_locks.py`, `read_model_scan.py`), and `store` exports those names itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from itertools import compress
from operator import itemgetter, ne
from typing import Any

from sqlalchemy import and_, bindparam, func, literal_column, or_, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from store.faults import wraps_faults
from store.read_models.keys import (
    CHUNK,
    GROUP_KEY,
    PROJECTOR,
    MetricScope,
    as_utc,
    chunks,
    equals,
    step_equals,
)
from store.read_models.log_reads import (
    DECODER_COLUMNS,
    SourceEvent,
    created_sessions,
    events_after,
    read_source_events,
    run_ends_after,
    source_events,
    trajectory_events,
)
from store.read_models.queries import (
    group_min_valid,
    group_status,
    latest_run,
    log_end,
    metric_rows,
    open_sessions_before_launch,
    open_sessions_last_event,
    pending_uids,
    projection_error_rows,
    queue_rows_for,
    recent_runs,
    refused_retries,
    retries_taken,
    run_last_steps,
    session_reward_infos,
    wasted_call_tokens,
)
from store.read_models.row_writes import execute_rows, insert_rows, plan_for, update_rows
from store.schema.tables import (
    checkpoints,
    groups,
    metric_counts,
    projection_errors,
    queue_rows,
    sessions,
)

#: A NULL step as `uq_groups_key` spells it (`store.schema.tables.step_key`).
_NO_STEP = literal_column("-1")


@wraps_faults()
async def get_checkpoint(conn: AsyncConnection, name: str = PROJECTOR) -> int:
    value = (
        await conn.execute(select(checkpoints.c.position).where(checkpoints.c.name == name))
    ).scalar_one_or_none()
    return int(value or 0)


@wraps_faults()
async def set_checkpoint(
    conn: AsyncConnection, position: int, *, previous: int, name: str = PROJECTOR
) -> datetime:
    """Move the checkpoint; returns the `updated_at` written (what `checkpoint_stamp` reads back)."""
    now = datetime.now(timezone.utc)
    if previous == 0:
        exists = (
            await conn.execute(select(checkpoints.c.name).where(checkpoints.c.name == name))
        ).first()
        if exists is None:
            await conn.execute(
                checkpoints.insert().values(name=name, position=position, updated_at=now)
            )
            return now
    await conn.execute(
        update(checkpoints)
        .where(checkpoints.c.name == name)
        .values(position=position, updated_at=now)
    )
    return now


@wraps_faults()
async def checkpoint_stamp(conn: AsyncConnection, name: str = PROJECTOR) -> datetime | None:
    """When the checkpoint last moved (UTC), None if it never did: with the position, it tells a
    projector whether the read models are still as its own last page left them."""
    value = (
        await conn.execute(select(checkpoints.c.updated_at).where(checkpoints.c.name == name))
    ).scalar_one_or_none()
    return None if value is None else as_utc(value)


@wraps_faults()
async def load_sessions(
    conn: AsyncConnection, session_ids: Sequence[str]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for chunk in chunks(list(session_ids)):
        result = await conn.execute(select(sessions).where(sessions.c.session_id.in_(chunk)))
        out.update({row["session_id"]: dict(row) for row in result.mappings()})
    return out


@wraps_faults()
async def load_groups(
    conn: AsyncConnection, keys: Sequence[tuple[str, str, int | None, str]]
) -> dict[tuple[str, str, int | None, str], dict[str, Any]]:
    """Groups by their key (run, partition, global_step, uid)."""
    # One IN list of uids per (run, partition, step), spelt as `uq_groups_key` is declared so the
    # planner searches the natural key; a tree of OR-ed ANDs costs more to build than to run, and
    # by uid alone no index served it (SCAN groups, issue 28).
    by_step: dict[tuple[str, str, int | None], set[str]] = {}
    for run, partition, step, uid in keys:
        by_step.setdefault((run, partition, step), set()).add(uid)
    out: dict[tuple[str, str, int | None, str], dict[str, Any]] = {}
    for (run, partition, step), uids in sorted(by_step.items(), key=repr):
        for chunk in chunks(sorted(uids)):
            result = await conn.execute(
                select(groups).where(
                    groups.c.run == run,
                    groups.c.partition == partition,
                    step_equals(groups.c.global_step, step),
                    groups.c.uid.in_(chunk),
                )
            )
            for row in result.mappings():
                out[(run, partition, step, row["uid"])] = dict(row)
    return out


def _scope_condition(scope: MetricScope) -> Any:
    run, partition, step, source = scope
    return and_(
        metric_counts.c.run == run,
        metric_counts.c.partition == partition,
        step_equals(metric_counts.c.global_step, step),
        # '' as text: `uq_metric_counts_scope`'s own expression, so the whole key is searched
        func.coalesce(metric_counts.c.data_source, literal_column("''"))
        == ("" if source is None else source),
    )


@wraps_faults()
async def load_metrics(
    conn: AsyncConnection, scopes: Sequence[MetricScope]
) -> dict[MetricScope, dict[str, float]]:
    """scope -> metric -> value, for the scopes asked (an unknown scope maps to {})."""
    out: dict[MetricScope, dict[str, float]] = {scope: {} for scope in scopes}
    for chunk in chunks(list(scopes)):
        result = await conn.execute(
            select(metric_counts).where(or_(*(_scope_condition(s) for s in chunk)))
        )
        for row in result.mappings():
            scope = (row["run"], row["partition"], row["global_step"], row["data_source"])
            out.setdefault(scope, {})[row["metric"]] = row["value"]
    return out


@wraps_faults()
async def load_step_metrics(
    conn: AsyncConnection, steps: Sequence[tuple[str, str, int | None]]
) -> dict[MetricScope, dict[str, float]]:
    """Every stored scope of each step (run, partition, global_step), whatever its data source:
    what a later launch's first session in the step starts again."""
    out: dict[MetricScope, dict[str, float]] = {}
    for run, partition, step in steps:
        result = await conn.execute(
            select(metric_counts).where(
                metric_counts.c.run == run,
                metric_counts.c.partition == partition,
                step_equals(metric_counts.c.global_step, step),
            )
        )
        for row in result.mappings():
            scope = (row["run"], row["partition"], row["global_step"], row["data_source"])
            out.setdefault(scope, {})[row["metric"]] = row["value"]
    return out


@wraps_faults()
async def delete_step_metrics(
    conn: AsyncConnection, steps: Sequence[tuple[str, str, int | None]]
) -> None:
    """Delete every metric row of each step (its scopes are then written again whole)."""
    for run, partition, step in steps:
        await conn.execute(
            metric_counts.delete().where(
                metric_counts.c.run == run,
                metric_counts.c.partition == partition,
                step_equals(metric_counts.c.global_step, step),
            )
        )


@wraps_faults()
async def save_rows(
    conn: AsyncConnection,
    table: Any,
    inserts: list[dict[str, Any]],
    updates: list[dict[str, Any]],
    keys: Sequence[str],
    *,
    stored: Sequence[dict[str, Any] | None] | None = None,
) -> None:
    """Insert new rows and update changed ones (matched on `keys`).

    `stored[i]`, when given, is `updates[i]` as it was read: only the columns that differ are
    written, one statement per set of changed columns (a settling page changes a handful of a
    session's ~30 columns, and binding the others cost most of its write).
    """
    await insert_rows(conn, table, inserts)
    columns = [c.name for c in table.columns if c.name not in keys]
    for changed, rows in changed_columns(updates, stored, columns).items():
        await update_rows(conn, table, keys, changed, rows)


def changed_columns(
    updates: Sequence[dict[str, Any]],
    stored: Sequence[dict[str, Any] | None] | None,
    columns: Sequence[str],
) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """Rows to update grouped by the columns that changed (all of them where nothing was stored);
    a row with none changed is left out."""
    out: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    everything = tuple(columns)
    values = itemgetter(*everything) if len(everything) > 1 else lambda row: (row[everything[0]],)
    for i, row in enumerate(updates):
        before = None if stored is None else stored[i]
        # compared at C speed: a settling page compares ~30 columns of thousands of sessions
        changed = (
            everything
            if before is None
            else tuple(compress(everything, map(ne, values(row), values(before))))
        )
        if changed:
            out.setdefault(changed, []).append(row)
    return out


@wraps_faults()
async def save_sessions(
    conn: AsyncConnection,
    inserts: list[dict[str, Any]],
    updates: list[dict[str, Any]],
    stored: Sequence[dict[str, Any] | None] | None = None,
) -> None:
    await save_rows(conn, sessions, inserts, updates, keys=("session_id",), stored=stored)


@wraps_faults()
async def save_groups(
    conn: AsyncConnection,
    inserts: list[dict[str, Any]],
    updates: list[dict[str, Any]],
    stored: Sequence[dict[str, Any] | None] | None = None,
) -> None:
    """As `save_rows`, matching a group by its natural key (see `group_update`)."""
    await insert_rows(conn, groups, inserts)
    columns = [c.name for c in groups.columns if c.name not in GROUP_KEY]
    for changed, rows in changed_columns(updates, stored, columns).items():
        await update_rows(
            conn, groups, GROUP_KEY, changed, rows, build=lambda c=changed: group_update(c)
        )


def group_update(columns: Sequence[str]) -> Any:
    """UPDATE of some group columns by the natural key (bound as `k_<key>`, values as `v_<column>`).

    The step is compared as `coalesce(global_step, -1)` with -1 as SQL text, not a bound value:
    only that very expression matches `uq_groups_key`'s, and with a bound -1 each row's update
    scanned all its step's groups (quadratic in a step's groups).
    """
    return (
        update(groups)
        .where(
            groups.c.run == bindparam("k_run"),
            groups.c.partition == bindparam("k_partition"),
            func.coalesce(groups.c.global_step, _NO_STEP)
            == func.coalesce(bindparam("k_global_step", type_=groups.c.global_step.type), _NO_STEP),
            groups.c.uid == bindparam("k_uid"),
        )
        .values({c: bindparam(f"v_{c}") for c in columns})
    )


#: `metric_counts` is keyed by its natural key; a NULL step or data source is matched through the
#: same sentinels as the unique index `uq_metric_counts_scope` (migration 0003): -1 for a step
#: (steps are >= 0) and '' for a data source (an empty data source is refused at append).
METRIC_UPSERT = (
    "INSERT INTO metric_counts (run, partition, global_step, data_source, metric, value) "
    "VALUES (:run, :partition, :global_step, :data_source, :metric, :value) "
    "ON CONFLICT (run, partition, coalesce(global_step, -1), coalesce(data_source, ''), metric) "
    "DO UPDATE SET value = excluded.value"
)


@wraps_faults()
async def save_metrics(conn: AsyncConnection, changed: dict[MetricScope, dict[str, float]]) -> None:
    """Upsert metric values by their natural key (one statement for the whole page)."""
    params = [
        {
            "run": run,
            "partition": partition,
            "global_step": step,
            "data_source": source,
            "metric": metric,
            "value": value,
        }
        for (run, partition, step, source), values in changed.items()
        for metric, value in values.items()
    ]
    await execute_rows(conn, plan_for(conn.dialect, "metric upsert", _metric_upsert), params)


def _metric_upsert() -> Any:
    return text(METRIC_UPSERT).bindparams(
        *(bindparam(name, type_=metric_counts.c[name].type) for name in _METRIC_BINDS)
    )


_METRIC_BINDS = ("run", "partition", "global_step", "data_source", "metric", "value")


@wraps_faults()
async def insert_queue_rows(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    await insert_rows(conn, queue_rows, rows)


@wraps_faults()
async def insert_projection_errors(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    await insert_rows(conn, projection_errors, rows)


@wraps_faults()
async def next_queue_id(conn: AsyncConnection) -> int:
    """The id the next queue row takes: queue rows are numbered 1, 2, ... in projection order, by
    the projector itself (not a sequence, which skips values on rollback), so a replay numbers
    them identically. Pages are serialised by the projection lock, so this cannot race."""
    value = (await conn.execute(select(func.max(queue_rows.c.id)))).scalar_one_or_none()
    return int(value or 0) + 1


__all__ = [
    "CHUNK",
    "DECODER_COLUMNS",
    "GROUP_KEY",
    "METRIC_UPSERT",
    "PROJECTOR",
    "MetricScope",
    "SourceEvent",
    "as_utc",
    "changed_columns",
    "checkpoint_stamp",
    "chunks",
    "created_sessions",
    "delete_step_metrics",
    "equals",
    "events_after",
    "get_checkpoint",
    "group_min_valid",
    "group_status",
    "group_update",
    "insert_projection_errors",
    "insert_queue_rows",
    "latest_run",
    "load_groups",
    "load_metrics",
    "load_sessions",
    "load_step_metrics",
    "log_end",
    "metric_rows",
    "next_queue_id",
    "open_sessions_before_launch",
    "open_sessions_last_event",
    "pending_uids",
    "projection_error_rows",
    "queue_rows_for",
    "read_source_events",
    "recent_runs",
    "refused_retries",
    "retries_taken",
    "run_ends_after",
    "run_last_steps",
    "save_groups",
    "save_metrics",
    "save_rows",
    "save_sessions",
    "session_reward_infos",
    "set_checkpoint",
    "source_events",
    "trajectory_events",
    "wasted_call_tokens",
]
