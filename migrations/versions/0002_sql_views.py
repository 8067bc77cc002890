"""Documented SQL views over the event log and the read models (docs/sql.md).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

Portable SQL only (the same text runs on SQLite and PostgreSQL): no JSON access, no dialect
functions, booleans only tested for truth; one window function (SQLite >= 3.25). The SQL is
frozen here on purpose: a later revision that changes a view drops it and creates its own copy.

Maintenance note for later revisions: on SQLite a batch ("move and copy") table rebuild renames
a temporary table over the original, which SQLite refuses while a view names the dropped table;
on PostgreSQL a table a view reads cannot be dropped and its columns cannot change type. A
revision that rebuilds or retypes `events`, `sessions`, `groups` or `metric_counts` must drop
these views first and create them again after.
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# One row per event, with the session's current (projected) state. LEFT JOIN: events the
# projector has not reached yet still show, with a NULL state.
SESSION_TIMELINE = """
CREATE VIEW session_timeline AS
SELECT
    e.session_id AS session_id,
    e.position AS position,
    e.version AS version,
    e.type AS type,
    e.recorded_at AS recorded_at,
    e.run AS run,
    e.uid AS uid,
    e.partition AS partition,
    e.global_step AS global_step,
    s.data_source AS data_source,
    s.state AS state
FROM events e
LEFT JOIN sessions s ON s.session_id = e.session_id
"""

# Failed sessions by reason per step, all data sources together.
FAILURE_BREAKDOWN = """
CREATE VIEW failure_breakdown AS
SELECT
    run,
    partition,
    global_step,
    failure_reason,
    COUNT(*) AS sessions,
    SUM(CASE WHEN placeholder THEN 1 ELSE 0 END) AS placeholders
FROM sessions
WHERE state = 'failed'
GROUP BY run, partition, global_step, failure_reason
"""

# metric_counts pivoted to one row per scope (data_source NULL = all data sources), in one pass
# (no self-join: a NULL-safe join on the scope defeats the index on SQLite). The metric names are
# those of sessions/metrics.py. `reward/mean@<n>` is read for the largest n the scope has (a scope
# normally has one group size): 'reward/mean@' is 12 characters, so n is SUBSTR(metric, 13), cast
# under a CASE so no other metric name is ever cast; a window (SQLite >= 3.25) gives each row its
# scope's largest n.
REWARD_BY_STEP = """
CREATE VIEW reward_by_step AS
SELECT
    run,
    partition,
    global_step,
    data_source,
    MAX(CASE WHEN metric = 'reward/mean' THEN value END) AS reward_mean,
    MAX(CASE WHEN metric = 'reward/mean_success_only' THEN value END) AS reward_mean_success_only,
    MAX(n) AS n,
    MAX(CASE WHEN n = top_n THEN value END) AS reward_mean_at_n,
    CAST(COALESCE(MAX(CASE WHEN metric = 'sessions/total' THEN value END), 0) AS INTEGER) AS sessions_total,
    CAST(COALESCE(MAX(CASE WHEN metric = 'sessions/succeeded' THEN value END), 0) AS INTEGER) AS sessions_succeeded,
    CAST(COALESCE(MAX(CASE WHEN metric = 'sessions/failed' THEN value END), 0) AS INTEGER) AS sessions_failed,
    CAST(COALESCE(MAX(CASE WHEN metric = 'sessions/cancelled' THEN value END), 0) AS INTEGER) AS sessions_cancelled,
    CAST(COALESCE(MAX(CASE WHEN metric = 'placeholders' THEN value END), 0) AS INTEGER) AS placeholders,
    MAX(CASE WHEN metric = 'coverage' THEN value END) AS coverage
FROM (
    SELECT
        run, partition, global_step, data_source, metric, value, n,
        MAX(n) OVER (PARTITION BY run, partition, global_step, data_source) AS top_n
    FROM (
        SELECT
            run, partition, global_step, data_source, metric, value,
            CASE WHEN metric LIKE 'reward/mean@%' THEN CAST(SUBSTR(metric, 13) AS INTEGER) END AS n
        FROM metric_counts
    ) named
) ranked
GROUP BY run, partition, global_step, data_source
"""

# One row per group (uid). mean_reward is NULL until a session of the group has a row.
GROUP_STATUS = """
CREATE VIEW group_status AS
SELECT
    run,
    partition,
    global_step,
    uid,
    data_source,
    group_size,
    sessions_seen,
    terminal,
    succeeded,
    failed,
    cancelled,
    status,
    CASE WHEN reward_count > 0 THEN reward_sum / reward_count END AS mean_reward
FROM groups
"""

VIEWS = (
    ("session_timeline", SESSION_TIMELINE),
    ("failure_breakdown", FAILURE_BREAKDOWN),
    ("reward_by_step", REWARD_BY_STEP),
    ("group_status", GROUP_STATUS),
)


def upgrade() -> None:
    for _name, create in VIEWS:
        op.execute(create)


def downgrade() -> None:
    for name, _create in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")
