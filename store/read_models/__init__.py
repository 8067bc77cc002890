"""Load and save the projector's read models: plain rows in, plain rows out.

The projector loads only the rows a page of events touches, changes them in memory, and writes
them back in the same transaction as the page's queue rows and its checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from itertools import compress
from operator import itemgetter, ne
from types import EllipsisType
from typing import Any

from sqlalchemy import Text, and_, bindparam, cast, func, literal_column, or_, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from store.schema.tables import (
    checkpoints,
    events,
    groups,
    metric_counts,
    projection_errors,
    queue_rows,
    sessions,
)

_CHUNK = 500
PROJECTOR = "projector"
#: The columns the projection decoder reads from `events`, in its order.
DECODER_COLUMNS = (
    "position",
    "session_id",
    "version",
    "type",
    "schema_version",
    "data",
    "recorded_at",
)
#: The natural key of `groups` (unique index `uq_groups_key`).
GROUP_KEY = ("run", "partition", "global_step", "uid")

MetricScope = tuple[str, str, "int | None", "str | None"]
#: A NULL step as `uq_groups_key` spells it (`store.schema.tables.step_key`).
_NO_STEP = literal_column("-1")


def _chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start : start + _CHUNK]


async def get_checkpoint(conn: AsyncConnection, name: str = PROJECTOR) -> int:
    value = (
        await conn.execute(select(checkpoints.c.position).where(checkpoints.c.name == name))
    ).scalar_one_or_none()
    return int(value or 0)


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


async def checkpoint_stamp(conn: AsyncConnection, name: str = PROJECTOR) -> datetime | None:
    """When the checkpoint last moved (UTC), None if it never did: with the position, it tells a
    projector whether the read models are still as its own last page left them."""
    value = (
        await conn.execute(select(checkpoints.c.updated_at).where(checkpoints.c.name == name))
    ).scalar_one_or_none()
    return None if value is None else as_utc(value)


def as_utc(value: datetime) -> datetime:
    """An aware UTC datetime (SQLite hands back naive ones; we only ever write UTC)."""
    return (
        value.replace(tzinfo=timezone.utc)
        if value.tzinfo is None
        else value.astimezone(timezone.utc)
    )


async def load_sessions(
    conn: AsyncConnection, session_ids: Sequence[str]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for chunk in _chunks(list(session_ids)):
        result = await conn.execute(select(sessions).where(sessions.c.session_id.in_(chunk)))
        out.update({row["session_id"]: dict(row) for row in result.mappings()})
    return out


async def session_reward_infos(
    conn: AsyncConnection, session_ids: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Each session's projected `reward_info` (what its rewards posted, merged by key)."""
    out: dict[str, dict[str, Any]] = {}
    for chunk in _chunks(sorted(set(session_ids))):
        result = await conn.execute(
            select(sessions.c.session_id, sessions.c.reward_info).where(
                sessions.c.session_id.in_(chunk)
            )
        )
        out.update({sid: dict(info or {}) for sid, info in result.all()})
    return out


async def load_groups(
    conn: AsyncConnection, keys: Sequence[tuple[str, str, int | None, str]]
) -> dict[tuple[str, str, int | None, str], dict[str, Any]]:
    """Groups by their key (run, partition, global_step, uid)."""
    # Select by uid alone (one IN list; a tree of OR-ed ANDs costs more to build than to run),
    # then keep the wanted keys.
    wanted = set(keys)
    out: dict[tuple[str, str, int | None, str], dict[str, Any]] = {}
    for chunk in _chunks(sorted({key[3] for key in wanted})):
        result = await conn.execute(select(groups).where(groups.c.uid.in_(chunk)))
        for row in result.mappings():
            key = (row["run"], row["partition"], row["global_step"], row["uid"])
            if key in wanted:
                out[key] = dict(row)
    return out


def equals(column: Any, value: Any) -> Any:
    """`column = value`, or `column IS NULL` when value is None (`= NULL` is never true).

    Not `IS NOT DISTINCT FROM`: PostgreSQL cannot use a b-tree index for that.
    """
    return column.is_(None) if value is None else column == value


def _scope_condition(scope: MetricScope) -> Any:
    run, partition, step, source = scope
    return and_(
        metric_counts.c.run == run,
        metric_counts.c.partition == partition,
        equals(metric_counts.c.global_step, step),
        equals(metric_counts.c.data_source, source),
    )


async def load_metrics(
    conn: AsyncConnection, scopes: Sequence[MetricScope]
) -> dict[MetricScope, dict[str, float]]:
    """scope -> metric -> value, for the scopes asked (an unknown scope maps to {})."""
    out: dict[MetricScope, dict[str, float]] = {scope: {} for scope in scopes}
    for chunk in _chunks(list(scopes)):
        result = await conn.execute(
            select(metric_counts).where(or_(*(_scope_condition(s) for s in chunk)))
        )
        for row in result.mappings():
            scope = (row["run"], row["partition"], row["global_step"], row["data_source"])
            out.setdefault(scope, {})[row["metric"]] = row["value"]
    return out


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
    if inserts:
        await conn.execute(table.insert(), inserts)
    columns = [c.name for c in table.columns if c.name not in keys]
    for changed, rows in changed_columns(updates, stored, columns).items():
        statement = (
            update(table)
            .where(and_(*(table.c[k] == bindparam(f"k_{k}") for k in keys)))
            .values({c: bindparam(f"v_{c}") for c in changed})
        )
        params = [
            {**{f"k_{k}": row[k] for k in keys}, **{f"v_{c}": row[c] for c in changed}}
            for row in rows
        ]
        await conn.execute(statement.execution_options(synchronize_session=False), params)


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


async def save_sessions(
    conn: AsyncConnection,
    inserts: list[dict[str, Any]],
    updates: list[dict[str, Any]],
    stored: Sequence[dict[str, Any] | None] | None = None,
) -> None:
    await save_rows(conn, sessions, inserts, updates, keys=("session_id",), stored=stored)


async def save_groups(
    conn: AsyncConnection,
    inserts: list[dict[str, Any]],
    updates: list[dict[str, Any]],
    stored: Sequence[dict[str, Any] | None] | None = None,
) -> None:
    """As `save_rows`, matching a group by its natural key (see `group_update`)."""
    if inserts:
        await conn.execute(groups.insert(), inserts)
    columns = [c.name for c in groups.columns if c.name not in GROUP_KEY]
    for changed, rows in changed_columns(updates, stored, columns).items():
        params = [
            {**{f"k_{k}": row[k] for k in GROUP_KEY}, **{f"v_{c}": row[c] for c in changed}}
            for row in rows
        ]
        await conn.execute(
            group_update(changed).execution_options(synchronize_session=False), params
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
    if params:
        await conn.execute(text(METRIC_UPSERT), params)


async def insert_queue_rows(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    if rows:
        await conn.execute(queue_rows.insert(), rows)


async def insert_projection_errors(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    if rows:
        await conn.execute(projection_errors.insert(), rows)


async def projection_error_rows(
    conn: AsyncConnection, *, after: int = 0, limit: int | None = None
) -> list[dict[str, Any]]:
    """Quarantined events in log order (those after a position)."""
    query = (
        select(projection_errors)
        .where(projection_errors.c.position > after)
        .order_by(projection_errors.c.position)
    )
    if limit is not None:
        query = query.limit(limit)
    return [dict(row) for row in (await conn.execute(query)).mappings()]


async def next_queue_id(conn: AsyncConnection) -> int:
    """The id the next queue row takes: queue rows are numbered 1, 2, ... in projection order, by
    the projector itself (not a sequence, which skips values on rollback), so a replay numbers
    them identically. Pages are serialised by the projection lock, so this cannot race."""
    value = (await conn.execute(select(func.max(queue_rows.c.id)))).scalar_one_or_none()
    return int(value or 0) + 1


async def events_after(
    conn: AsyncConnection, after: int, limit: int, *, payloads: dict[int, bytes] | None = None
) -> list[tuple[Any, ...]]:
    """Up to `limit` events after a position, as the projection decoder reads them:
    (position, session_id, version, type, schema_version, data, recorded_at), no payloads.

    With `payloads`, the same read also fills it with position -> payload of the events that have
    one (the token arrays a follower keeps for the batch, read once, as they land).
    """
    columns = _decoder_columns() + ([events.c.payload] if payloads is not None else [])
    result = await conn.execute(
        select(*columns).where(events.c.position > after).order_by(events.c.position).limit(limit)
    )
    if payloads is None:
        return [_utc_row(row) for row in result]
    out = []
    for *row, payload in result:
        if payload is not None:
            payloads[row[0]] = bytes(payload)
        out.append(_utc_row(row))
    return out


def _decoder_columns() -> list[Any]:
    """`DECODER_COLUMNS`, with `data` as its stored text: the decoder parses it, so a row of
    malformed JSON is one event to quarantine, not a page that cannot be read."""
    return [
        cast(events.c.data, Text) if name == "data" else events.c[name] for name in DECODER_COLUMNS
    ]


def _utc_row(row: Any) -> tuple[Any, ...]:
    *head, recorded_at = row
    if recorded_at.tzinfo is None:  # SQLite keeps no zone; we only ever write UTC
        recorded_at = recorded_at.replace(tzinfo=timezone.utc)
    return (*head, recorded_at)


async def trajectory_events(
    conn: AsyncConnection, session_ids: Sequence[str], up_to: int
) -> list[tuple[Any, ...]]:
    """The TrajectoryRecorded events of some sessions at positions <= `up_to`, and the
    AttemptFailed events that supersede them, in log order, as `events_after` returns them."""
    out: list[tuple[Any, ...]] = []
    for chunk in _chunks(list(session_ids)):
        result = await conn.execute(
            select(*_decoder_columns()).where(
                events.c.session_id.in_(chunk),
                events.c.type.in_(("TrajectoryRecorded", "AttemptFailed")),
                events.c.position <= up_to,
            )
        )
        out.extend(_utc_row(row) for row in result)
    out.sort(key=lambda row: row[0])
    return out


SourceEvent = tuple[str, int, dict[str, Any], "bytes | None"]  # type, schema_version, data, payload


async def source_events(conn: AsyncConnection, positions: Sequence[int]) -> dict[int, SourceEvent]:
    """position -> (type, schema_version, data, payload) for the events queue rows point at."""
    out: dict[int, SourceEvent] = {}
    for chunk in _chunks(sorted(set(positions))):
        result = await conn.execute(
            select(
                events.c.position,
                events.c.type,
                events.c.schema_version,
                events.c.data,
                events.c.payload,
            ).where(events.c.position.in_(chunk))
        )
        for position, type_, schema_version, data, payload in result:
            out[position] = (
                type_,
                schema_version,
                data,
                bytes(payload) if payload is not None else None,
            )
    return out


async def read_source_events(engine: Any, positions: Sequence[int]) -> dict[int, SourceEvent]:
    """`source_events` on a connection of its own."""
    async with engine.connect() as conn:
        return await source_events(conn, positions)


async def queue_rows_for(
    conn: AsyncConnection,
    run: str,
    partition: str,
    global_step: int | None,
    *,
    kind: str | None = "row",
) -> list[dict[str, Any]]:
    """A step's queue rows in queue order (global_step None selects rows without a step)."""
    query = select(queue_rows).where(queue_rows.c.run == run, queue_rows.c.partition == partition)
    query = query.where(equals(queue_rows.c.global_step, global_step))
    if kind is not None:
        query = query.where(queue_rows.c.kind == kind)
    result = await conn.execute(query.order_by(queue_rows.c.id))
    return [dict(row) for row in result.mappings()]


async def group_status(
    conn: AsyncConnection, run: str, partition: str, global_step: int | None
) -> dict[str, int]:
    """Counts of a step's groups by status (pending / finished / failure)."""
    query = select(groups.c.status, func.count()).where(
        groups.c.run == run, groups.c.partition == partition
    )
    query = query.where(equals(groups.c.global_step, global_step))
    result = await conn.execute(query.group_by(groups.c.status))
    return {status: int(count) for status, count in result}


async def metric_rows(
    conn: AsyncConnection,
    *,
    run: str | None = None,
    partition: str | None = None,
    global_step: int | None | EllipsisType = ...,
) -> list[dict[str, Any]]:
    """Metric counts, filtered; `global_step=...` (the default) is every step, None the step-less rows."""
    query = select(metric_counts)
    if run is not None:
        query = query.where(metric_counts.c.run == run)
    if partition is not None:
        query = query.where(metric_counts.c.partition == partition)
    if global_step is not ...:
        query = query.where(equals(metric_counts.c.global_step, global_step))
    query = query.order_by(
        metric_counts.c.run,
        metric_counts.c.partition,
        metric_counts.c.global_step,
        metric_counts.c.data_source,
        metric_counts.c.metric,
    )
    return [dict(row) for row in (await conn.execute(query)).mappings()]


async def latest_run(conn: AsyncConnection) -> str | None:
    """The run of the most recent event (the CLI's default --run)."""
    result = await conn.execute(select(events.c.run).order_by(events.c.position.desc()).limit(1))
    return result.scalar_one_or_none()


async def recent_runs(conn: AsyncConnection, *, limit: int = 20) -> list[str]:
    """Run names of the log, most recent event first: what an error names when a run matches none
    (read from the log, so a run the projector has not reached is named too)."""
    last = func.max(events.c.position)
    result = await conn.execute(
        select(events.c.run).group_by(events.c.run).order_by(last.desc()).limit(limit)
    )
    return [run for (run,) in result]


async def log_end(conn: AsyncConnection) -> int:
    """The log's last position (0 when it is empty)."""
    return int(
        (await conn.execute(select(func.coalesce(func.max(events.c.position), 0)))).scalar_one()
    )


async def pending_uids(
    conn: AsyncConnection, run: str, partition: str, global_step: int | None, *, limit: int = 10
) -> list[str]:
    """Some of a step's unsettled groups, to name them in a timeout."""
    query = select(groups.c.uid).where(
        groups.c.run == run, groups.c.partition == partition, groups.c.status == "pending"
    )
    query = query.where(equals(groups.c.global_step, global_step))
    return list((await conn.execute(query.order_by(groups.c.uid).limit(limit))).scalars())


async def open_sessions_last_event(
    conn: AsyncConnection, *, run: str | None = None
) -> list[tuple[str, datetime]]:
    """(session_id, recorded_at of its latest event) for every projected session still open
    (created or running), in one run or all; timestamps in UTC."""
    query = (
        select(sessions.c.session_id, func.max(events.c.recorded_at))
        .join(events, events.c.session_id == sessions.c.session_id)
        .where(sessions.c.state.in_(("created", "running")))
        .group_by(sessions.c.session_id)
    )
    if run is not None:
        query = query.where(sessions.c.run == run)
    out = []
    for session_id, last in await conn.execute(query):
        out.append(
            (session_id, last if last.tzinfo is not None else last.replace(tzinfo=timezone.utc))
        )
    return out
