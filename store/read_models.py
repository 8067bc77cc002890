"""Load and save the projector's read models: plain rows in, plain rows out.

The projector loads only the rows a page of events touches, changes them in memory, and writes
them back in the same transaction as the page's queue rows and its checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from types import EllipsisType
from typing import Any

from sqlalchemy import and_, bindparam, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from store.tables import checkpoints, events, groups, metric_counts, queue_rows, sessions

_CHUNK = 500
PROJECTOR = "projector"

MetricScope = tuple[str, str, "int | None", "str | None"]


def _chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start : start + _CHUNK]


async def get_checkpoint(conn: AsyncConnection, name: str = PROJECTOR) -> int:
    value = (await conn.execute(select(checkpoints.c.position).where(checkpoints.c.name == name))).scalar_one_or_none()
    return int(value or 0)


async def set_checkpoint(conn: AsyncConnection, position: int, *, previous: int, name: str = PROJECTOR) -> None:
    now = datetime.now(timezone.utc)
    if previous == 0:
        exists = (await conn.execute(select(checkpoints.c.name).where(checkpoints.c.name == name))).first()
        if exists is None:
            await conn.execute(checkpoints.insert().values(name=name, position=position, updated_at=now))
            return
    await conn.execute(update(checkpoints).where(checkpoints.c.name == name).values(position=position, updated_at=now))


async def load_sessions(conn: AsyncConnection, session_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for chunk in _chunks(list(session_ids)):
        result = await conn.execute(select(sessions).where(sessions.c.session_id.in_(chunk)))
        out.update({row["session_id"]: dict(row) for row in result.mappings()})
    return out


async def load_groups(conn: AsyncConnection, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    # Select by uid alone (one IN list; a tree of OR-ed ANDs costs more to build than to run),
    # then keep the wanted (run, uid) pairs.
    wanted = set(keys)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for chunk in _chunks(sorted({uid for _run, uid in wanted})):
        result = await conn.execute(select(groups).where(groups.c.uid.in_(chunk)))
        for row in result.mappings():
            key = (row["run"], row["uid"])
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


async def load_metrics(conn: AsyncConnection, scopes: Sequence[MetricScope]) -> dict[MetricScope, dict[str, tuple[int, float]]]:
    """scope -> metric -> (row id, value)."""
    out: dict[MetricScope, dict[str, tuple[int, float]]] = {scope: {} for scope in scopes}
    for chunk in _chunks(list(scopes)):
        result = await conn.execute(select(metric_counts).where(or_(*(_scope_condition(s) for s in chunk))))
        for row in result.mappings():
            scope = (row["run"], row["partition"], row["global_step"], row["data_source"])
            out.setdefault(scope, {})[row["metric"]] = (row["id"], row["value"])
    return out


async def save_rows(conn: AsyncConnection, table: Any, inserts: list[dict[str, Any]], updates: list[dict[str, Any]], keys: Sequence[str]) -> None:
    """Insert new rows and update changed ones (matched on `keys`) with one statement each."""
    if inserts:
        await conn.execute(table.insert(), inserts)
    if updates:
        columns = [c.name for c in table.columns if c.name not in keys]
        statement = (
            update(table)
            .where(and_(*(table.c[k] == bindparam(f"k_{k}") for k in keys)))
            .values({c: bindparam(f"v_{c}") for c in columns})
        )
        params = [{**{f"k_{k}": row[k] for k in keys}, **{f"v_{c}": row[c] for c in columns}} for row in updates]
        await conn.execute(statement.execution_options(synchronize_session=False), params)


async def save_metrics(
    conn: AsyncConnection, changed: dict[MetricScope, dict[str, float]], existing: dict[MetricScope, dict[str, tuple[int, float]]]
) -> None:
    inserts: list[dict[str, Any]] = []
    updates: list[dict[str, Any]] = []
    for scope, values in changed.items():
        run, partition, step, source = scope
        known = existing.get(scope, {})
        for metric, value in values.items():
            if metric in known:
                row_id, old = known[metric]
                if old != value:
                    updates.append({"k_id": row_id, "v_value": value})
            else:
                inserts.append(
                    {"run": run, "partition": partition, "global_step": step, "data_source": source, "metric": metric, "value": value}
                )
    if inserts:
        await conn.execute(metric_counts.insert(), inserts)
    if updates:
        statement = update(metric_counts).where(metric_counts.c.id == bindparam("k_id")).values(value=bindparam("v_value"))
        await conn.execute(statement.execution_options(synchronize_session=False), updates)


async def insert_queue_rows(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    if rows:
        await conn.execute(queue_rows.insert(), rows)


async def trajectory_events(
    conn: AsyncConnection, session_ids: Sequence[str], up_to: int
) -> dict[str, list[tuple[int, int, dict[str, Any]]]]:
    """session -> [(position, schema_version, data)] of its TrajectoryRecorded events up to a position."""
    out: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for chunk in _chunks(list(session_ids)):
        result = await conn.execute(
            select(events.c.session_id, events.c.position, events.c.data, events.c.schema_version).where(
                events.c.session_id.in_(chunk), events.c.type == "TrajectoryRecorded", events.c.position <= up_to
            )
        )
        for session_id, position, data, schema_version in result:
            out.setdefault(session_id, []).append((position, schema_version, data))
    return out


SourceEvent = tuple[str, int, dict[str, Any], "bytes | None"]  # type, schema_version, data, payload


async def source_events(conn: AsyncConnection, positions: Sequence[int]) -> dict[int, SourceEvent]:
    """position -> (type, schema_version, data, payload) for the events queue rows point at."""
    out: dict[int, SourceEvent] = {}
    for chunk in _chunks(sorted(set(positions))):
        result = await conn.execute(
            select(events.c.position, events.c.type, events.c.schema_version, events.c.data, events.c.payload).where(
                events.c.position.in_(chunk)
            )
        )
        for position, type_, schema_version, data, payload in result:
            out[position] = (type_, schema_version, data, bytes(payload) if payload is not None else None)
    return out


async def queue_rows_for(
    conn: AsyncConnection, run: str, partition: str, global_step: int | None, *, kind: str | None = "row"
) -> list[dict[str, Any]]:
    """A step's queue rows in queue order (global_step None selects rows without a step)."""
    query = select(queue_rows).where(queue_rows.c.run == run, queue_rows.c.partition == partition)
    query = query.where(equals(queue_rows.c.global_step, global_step))
    if kind is not None:
        query = query.where(queue_rows.c.kind == kind)
    result = await conn.execute(query.order_by(queue_rows.c.id))
    return [dict(row) for row in result.mappings()]


async def group_status(conn: AsyncConnection, run: str, partition: str, global_step: int | None) -> dict[str, int]:
    """Counts of a step's groups by status (pending / finished / failure)."""
    from sqlalchemy import func

    query = select(groups.c.status, func.count()).where(groups.c.run == run, groups.c.partition == partition)
    query = query.where(equals(groups.c.global_step, global_step))
    result = await conn.execute(query.group_by(groups.c.status))
    return {status: int(count) for status, count in result}


async def metric_rows(
    conn: AsyncConnection, *, run: str | None = None, partition: str | None = None,
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
        metric_counts.c.run, metric_counts.c.partition, metric_counts.c.global_step, metric_counts.c.data_source, metric_counts.c.metric
    )
    return [dict(row) for row in (await conn.execute(query)).mappings()]


async def latest_run(conn: AsyncConnection) -> str | None:
    """The run of the most recent event (the CLI's default --run)."""
    result = await conn.execute(select(events.c.run).order_by(events.c.position.desc()).limit(1))
    return result.scalar_one_or_none()


async def pending_uids(conn: AsyncConnection, run: str, partition: str, global_step: int | None, *, limit: int = 10) -> list[str]:
    """Some of a step's unsettled groups, to name them in a timeout."""
    query = select(groups.c.uid).where(groups.c.run == run, groups.c.partition == partition, groups.c.status == "pending")
    query = query.where(equals(groups.c.global_step, global_step))
    return list((await conn.execute(query.order_by(groups.c.uid).limit(limit))).scalars())
