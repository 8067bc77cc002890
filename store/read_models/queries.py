"""The reads behind `Ledger.batch`, `metrics`, the CLI and recovery: a step's queue rows and group
counts (of the step's latest launch), metric rows, quarantined events, runs, the log's end and
the sessions left open."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from types import EllipsisType
from typing import Any

from sqlalchemy import column, func, literal_column, select, table
from sqlalchemy.ext.asyncio import AsyncConnection

from store.faults import wraps_faults
from store.read_models.keys import chunks, equals, step_equals
from store.schema.tables import (
    events,
    groups,
    metric_counts,
    projection_errors,
    queue_rows,
    sessions,
)


@wraps_faults()
async def session_reward_infos(
    conn: AsyncConnection, session_ids: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Each session's projected `reward_info` (what its rewards posted, merged by key)."""
    out: dict[str, dict[str, Any]] = {}
    for chunk in chunks(sorted(set(session_ids))):
        result = await conn.execute(
            select(sessions.c.session_id, sessions.c.reward_info).where(
                sessions.c.session_id.in_(chunk)
            )
        )
        out.update({sid: dict(info or {}) for sid, info in result.all()})
    return out


@wraps_faults()
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


def _of_latest_launch(run: str, partition: str, global_step: int | None) -> Any:
    """A condition on `groups`: the group belongs to its step's latest launch (the largest
    `launch` of the step's groups, NULL counted as 0). A step a later launch re-ran is settled,
    batched and named on that launch's groups only; the earlier ones stay for SQL."""
    latest = (
        select(func.max(func.coalesce(groups.c.launch, 0)))
        .where(
            groups.c.run == run,
            groups.c.partition == partition,
            step_equals(groups.c.global_step, global_step),
        )
        .scalar_subquery()
    )
    return func.coalesce(groups.c.launch, 0) == latest


@wraps_faults()
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
    query = query.where(
        queue_rows.c.uid.in_(
            select(groups.c.uid).where(
                groups.c.run == run,
                groups.c.partition == partition,
                step_equals(groups.c.global_step, global_step),
                _of_latest_launch(run, partition, global_step),
            )
        )
    )
    result = await conn.execute(query.order_by(queue_rows.c.id))
    return [dict(row) for row in result.mappings()]


@wraps_faults()
async def group_status(
    conn: AsyncConnection, run: str, partition: str, global_step: int | None
) -> dict[str, int]:
    """Counts of a step's groups by status (pending / finished / failure)."""
    query = select(groups.c.status, func.count()).where(
        groups.c.run == run, groups.c.partition == partition
    )
    query = query.where(
        step_equals(groups.c.global_step, global_step),
        _of_latest_launch(run, partition, global_step),
    )
    result = await conn.execute(query.group_by(groups.c.status))
    return {status: int(count) for status, count in result}


@wraps_faults()
async def group_min_valid(
    conn: AsyncConnection, run: str, partition: str, global_step: int | None
) -> dict[str, int | None]:
    """Each group of a step's latest launch and the `min_valid` its sessions recorded (None:
    the default then in force)."""
    query = select(groups.c.uid, groups.c.min_valid).where(
        groups.c.run == run,
        groups.c.partition == partition,
        step_equals(groups.c.global_step, global_step),
        _of_latest_launch(run, partition, global_step),
    )
    return {str(uid): mv for uid, mv in await conn.execute(query)}


@wraps_faults()
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
        query = query.where(step_equals(metric_counts.c.global_step, global_step))
    query = query.order_by(
        metric_counts.c.run,
        metric_counts.c.partition,
        metric_counts.c.global_step,
        metric_counts.c.data_source,
        metric_counts.c.metric,
    )
    return [dict(row) for row in (await conn.execute(query)).mappings()]


@wraps_faults()
async def latest_run(conn: AsyncConnection) -> str | None:
    """The run of the most recent event (the CLI's default --run)."""
    result = await conn.execute(select(events.c.run).order_by(events.c.position.desc()).limit(1))
    return result.scalar_one_or_none()


@wraps_faults()
async def recent_runs(conn: AsyncConnection, *, limit: int = 20) -> list[str]:
    """Run names of the log, most recent event first: what an error names when a run matches none
    (read from the log, so a run the projector has not reached is named too)."""
    last = func.max(events.c.position)
    result = await conn.execute(
        select(events.c.run).group_by(events.c.run).order_by(last.desc()).limit(limit)
    )
    return [run for (run,) in result]


@wraps_faults()
async def log_end(conn: AsyncConnection) -> int:
    """The log's last position (0 when it is empty)."""
    return int(
        (await conn.execute(select(func.coalesce(func.max(events.c.position), 0)))).scalar_one()
    )


@wraps_faults()
async def pending_uids(
    conn: AsyncConnection, run: str, partition: str, global_step: int | None, *, limit: int = 10
) -> list[str]:
    """Some of a step's unsettled groups, to name them in a timeout."""
    query = select(groups.c.uid).where(
        groups.c.run == run, groups.c.partition == partition, groups.c.status == "pending"
    )
    query = query.where(
        step_equals(groups.c.global_step, global_step),
        _of_latest_launch(run, partition, global_step),
    )
    return list((await conn.execute(query.order_by(groups.c.uid).limit(limit))).scalars())


@wraps_faults()
async def open_sessions_last_event(
    conn: AsyncConnection, *, run: str | None = None
) -> list[tuple[str, datetime]]:
    """(session_id, recorded_at of its latest event) for every projected session still open
    (created or running), in one run or all; timestamps in UTC.

    Bounded by the open sessions, not the log (issue 28): each one's events are read through its
    own key (a correlated subquery, where a join let PostgreSQL hash-join a scan of every event),
    and the run is compared here, not in SQL, where an unanalysed planner AND-ed the whole run's
    index into the few open sessions `ix_sessions_state` finds."""
    latest = (
        select(func.max(events.c.recorded_at))
        .where(events.c.session_id == sessions.c.session_id)
        .scalar_subquery()
    )
    query = select(sessions.c.session_id, sessions.c.run, latest).where(
        sessions.c.state.in_(("created", "running"))
    )
    out = []
    for session_id, session_run, last in await conn.execute(query):
        if last is None or (run is not None and session_run != run):
            continue
        out.append(
            (session_id, last if last.tzinfo is not None else last.replace(tzinfo=timezone.utc))
        )
    return out


@wraps_faults()
async def run_last_steps(conn: AsyncConnection, run: str) -> dict[str, int | None]:
    """Each partition the run has sessions in, with its last step (None: only step-less ones),
    read from the log: what a launch records it resumes."""
    result = await conn.execute(
        select(events.c.partition, func.max(events.c.global_step))
        .where(events.c.run == run, events.c.type == "SessionCreated")
        .group_by(events.c.partition)
    )
    return {partition: None if step is None else int(step) for partition, step in result}


@wraps_faults()
async def open_sessions_before_launch(conn: AsyncConnection, run: str, launch: int) -> list[str]:
    """The run's projected sessions still open (created, running or retrying) that belong to a
    launch before `launch` (or to none): the sessions a dead launch left behind."""
    query = select(sessions.c.session_id).where(
        sessions.c.state.in_(("created", "running", "retrying")),
        sessions.c.run == run,
        func.coalesce(sessions.c.launch, 0) < launch,
    )
    return sorted((await conn.execute(query)).scalars())


_model_calls = table(
    "model_calls",
    column("session_id"),
    column("run"),
    column("partition"),
    column("global_step"),
    column("attempt"),
    column("outcome"),
    column("response_tokens"),
)
_session_attempts = table(
    "session_attempts",
    column("session_id"),
    column("attempt"),
    column("outcome"),
    column("reason"),
)


def _wasted(run: str, partition: str | None, global_step: Any, min_valid: int) -> list[Any]:
    """The two selects behind the wasted-token reads, each giving (partition, global_step, cause,
    reason, tokens); `partition` None and `global_step` ... select every one."""
    m, a = _model_calls, _session_attempts

    def scoped(query: Any) -> Any:
        query = query.where(m.c.run == run, m.c.outcome == "recorded")
        if partition is not None:
            query = query.where(m.c.partition == partition)
        if global_step is not ...:
            query = query.where(equals(m.c.global_step, global_step))
        return query

    ended = scoped(
        select(
            m.c.partition, m.c.global_step, a.c.outcome, a.c.reason, func.sum(m.c.response_tokens)
        )
        .select_from(m.join(a, (a.c.session_id == m.c.session_id) & (a.c.attempt == m.c.attempt)))
        .where(a.c.outcome.in_(("retried", "failed")))
    ).group_by(m.c.partition, m.c.global_step, a.c.outcome, a.c.reason)
    no_signal = literal_column("'no_signal'")
    weak = scoped(
        select(
            m.c.partition,
            m.c.global_step,
            no_signal,
            literal_column("'below_min_valid'"),
            func.sum(m.c.response_tokens),
        )
        .select_from(
            m.join(sessions, sessions.c.session_id == m.c.session_id).join(
                groups,
                (groups.c.run == sessions.c.run)
                & (groups.c.partition == sessions.c.partition)
                & (groups.c.uid == sessions.c.uid)
                & (
                    func.coalesce(groups.c.global_step, -1)
                    == func.coalesce(sessions.c.global_step, -1)
                ),
            )
        )
        .where(
            sessions.c.state == "succeeded",
            m.c.attempt == sessions.c.attempts,
            func.coalesce(groups.c.valid_rows, 0) < func.coalesce(groups.c.min_valid, min_valid),
        )
    ).group_by(m.c.partition, m.c.global_step)
    return [ended, weak]


@wraps_faults()
async def wasted_call_tokens(
    conn: AsyncConnection,
    run: str,
    partition: str | None = None,
    global_step: int | None | EllipsisType = ...,
    *,
    default_min_valid: int,
) -> list[tuple[str, int | None, str, str, int]]:
    """Model-call response tokens that trained nothing, as (partition, global_step, cause,
    reason, tokens), for one step or (`partition` None, `global_step` ...) all of the run's:
    `retried` and `failed` (the attempt the tokens came from ended so, with its reason), and
    `no_signal` (a successful session's last attempt in a group with fewer valid rows than its
    `min_valid`, `default_min_valid` where the group records none: GRPO gives its rows
    advantage 0; reason `below_min_valid`). Earlier launches' groups of a re-run step count too:
    their tokens were spent."""
    out = []
    for query in _wasted(run, partition, global_step, default_min_valid):
        for part, step, cause, reason, tokens in await conn.execute(query):
            if tokens:
                out.append((str(part), step, str(cause), str(reason), int(tokens)))
    return out


@wraps_faults()
async def retries_taken(
    conn: AsyncConnection, run: str, partition: str, global_step: int | None, uid: str
) -> tuple[int, int]:
    """The retries (`AttemptFailed` events) a group's sessions and its step's sessions of the
    partition have taken: what `RetryPolicy.group_budget` and `step_budget` bound."""
    step = (
        select(events.c.uid, func.count())
        .where(
            events.c.run == run,
            events.c.partition == partition,
            equals(events.c.global_step, global_step),
            events.c.type == "AttemptFailed",
        )
        .group_by(events.c.uid)
    )
    counts = {str(u): int(n) for u, n in await conn.execute(step)}
    return counts.get(uid, 0), sum(counts.values())


@wraps_faults()
async def refused_retries(
    conn: AsyncConnection, run: str, partition: str, global_step: int | None
) -> dict[str, str]:
    """The step's sessions whose retry a spent budget refused: session id -> the budget
    (`SessionFailed.retry_refused`, schema 3; older failures have none)."""
    result = await conn.execute(
        select(events.c.session_id, events.c.data).where(
            events.c.run == run,
            events.c.partition == partition,
            equals(events.c.global_step, global_step),
            events.c.type == "SessionFailed",
            events.c.schema_version >= 3,
        )
    )
    out: dict[str, str] = {}
    for session_id, data in result:
        refused = data.get("retry_refused") if isinstance(data, dict) else None
        if isinstance(refused, str):
            out[str(session_id)] = refused
    return out
