"""Failure semantics: attempts, origins, metric policy, partial rows, min_valid; the attempts view.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

* `sessions` gains `attempts` (attempts started), `failure_origin` (infra / policy),
  `metric_policy` (zero / exclude) and `partial` (a keep_partial failure sent its trajectory).
* `groups` gains `valid_rows` (non-placeholder rows) and `min_valid` (GRPO's threshold).
* `queue_rows` gains `is_partial`.
* `session_attempts`: one row per attempt, read straight from the log (no projection lag).
* `session_timeline` leaves out the runs' configuration streams (`RunConfigured`, no session).

The columns are nullable so they can be added in place on both backends (SQLite cannot add a NOT
NULL column without a default, nor drop a default after); the projector always fills them.
Existing rows are backfilled from what the log meant before this revision: one attempt per
SessionStarted, the built-in reasons' default origins, metric policy `zero`, no partial rows,
`min_valid` 2 — and so are the metric counters these new columns feed, so a replay of an upgraded
database equals it.
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

#: `sessions.failure_origin` of failures recorded before this revision (the defaults then in force).
_INFRA_REASONS = ("sandbox_error", "finalize_error", "orphaned", "unprojectable")
_TIMELINE_0002 = importlib.import_module("migrations.versions.0002_sql_views").SESSION_TIMELINE
_TIMELINE = _TIMELINE_0002.rstrip() + "\nWHERE e.type <> 'RunConfigured'\n"


def _postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def _json_text(column: str, key: str) -> str:
    return f"({column}->>'{key}')" if _postgres() else f"json_extract({column}, '$.{key}')"


# One row per attempt: its SessionStarted, and the first event after it that ends the attempt
# (AttemptFailed: superseded; or the session's terminal event). The attempt number is the count of
# SessionStarted events up to it, so it holds whether or not the writer numbered them.
def _attempts_view() -> str:
    ends = "('AttemptFailed', 'SessionSucceeded', 'SessionFailed', 'SessionCancelled')"
    return f"""
CREATE VIEW session_attempts AS
SELECT
    st.session_id AS session_id,
    st.run AS run,
    st.uid AS uid,
    st.partition AS partition,
    st.global_step AS global_step,
    (SELECT COUNT(*) FROM events p
      WHERE p.session_id = st.session_id AND p.type = 'SessionStarted' AND p.version <= st.version) AS attempt,
    CASE en.type
        WHEN 'AttemptFailed' THEN 'retried'
        WHEN 'SessionSucceeded' THEN 'succeeded'
        WHEN 'SessionFailed' THEN 'failed'
        WHEN 'SessionCancelled' THEN 'cancelled'
        ELSE 'running'
    END AS outcome,
    CASE WHEN en.type IN ('AttemptFailed', 'SessionFailed') THEN {_json_text("en.data", "reason")} END AS reason,
    CASE WHEN en.type = 'AttemptFailed' THEN 1 ELSE 0 END AS superseded,
    st.position AS started_position,
    st.recorded_at AS started_at,
    en.position AS ended_position,
    en.recorded_at AS ended_at
FROM events st
LEFT JOIN events en ON en.session_id = st.session_id AND en.version = (
    SELECT MIN(x.version) FROM events x
    WHERE x.session_id = st.session_id AND x.version > st.version AND x.type IN {ends}
)
WHERE st.type = 'SessionStarted'
"""


def _metric_from_sessions(metric_sql: str, value_sql: str, where: str, by: str = "") -> str:
    """INSERT a counter per scope (each data source, and all of them) from the sessions table;
    `by` names a further column the metric's name is made of."""
    extra = f", {by}" if by else ""
    return f"""
INSERT INTO metric_counts (run, partition, global_step, data_source, metric, value)
SELECT run, partition, global_step, data_source, {metric_sql}, {value_sql} FROM sessions
WHERE data_source IS NOT NULL AND {where} GROUP BY run, partition, global_step, data_source{extra}
UNION ALL
SELECT run, partition, global_step, NULL, {metric_sql}, {value_sql} FROM sessions
WHERE {where} GROUP BY run, partition, global_step{extra}
"""


def upgrade() -> None:
    op.add_column("sessions", sa.Column("attempts", sa.Integer(), nullable=True))
    op.add_column("sessions", sa.Column("failure_origin", sa.String(length=8), nullable=True))
    op.add_column("sessions", sa.Column("metric_policy", sa.String(length=8), nullable=True))
    op.add_column("sessions", sa.Column("partial", sa.Boolean(), nullable=True))
    op.add_column("groups", sa.Column("valid_rows", sa.Integer(), nullable=True))
    op.add_column("groups", sa.Column("min_valid", sa.Integer(), nullable=True))
    op.add_column("queue_rows", sa.Column("is_partial", sa.Boolean(), nullable=True))

    infra = ", ".join(f"'{reason}'" for reason in _INFRA_REASONS)
    op.execute(
        "UPDATE sessions SET attempts = (SELECT COUNT(*) FROM events e WHERE e.session_id = sessions.session_id "
        "AND e.type = 'SessionStarted'), partial = " + ("false" if _postgres() else "0")
    )
    op.execute(
        f"UPDATE sessions SET failure_origin = CASE WHEN failure_reason IN ({infra}) THEN 'infra' ELSE 'policy' END, "
        "metric_policy = 'zero' WHERE state = 'failed'"
    )
    op.execute("UPDATE queue_rows SET is_partial = " + ("false" if _postgres() else "0"))
    op.execute(
        "UPDATE groups SET min_valid = 2, valid_rows = (SELECT COUNT(*) FROM queue_rows q WHERE q.run = groups.run "
        "AND q.partition = groups.partition AND coalesce(q.global_step, -1) = coalesce(groups.global_step, -1) "
        "AND q.uid = groups.uid AND q.kind = 'row' AND NOT q.is_placeholder)"
    )

    # The counters the projector now keeps, for what was projected before (recomputed whole: a
    # database downgraded past 0005 and upgraded again still holds the old ones).
    op.execute(
        "DELETE FROM metric_counts WHERE metric IN ('attempts/total', 'groups/below_min_valid', "
        "'reward/mean_default_rule') OR metric LIKE 'failed!_origin/%' ESCAPE '!'"
    )
    op.execute(_metric_from_sessions("'attempts/total'", "SUM(attempts)", "attempts > 0"))
    op.execute(
        _metric_from_sessions(
            "'failed_origin/' || failure_origin",
            "COUNT(*)",
            "state = 'failed'",
            by="failure_origin",
        )
    )
    op.execute(
        "INSERT INTO metric_counts (run, partition, global_step, data_source, metric, value) "
        "SELECT run, partition, global_step, data_source, 'groups/below_min_valid', COUNT(*) FROM groups "
        "WHERE data_source IS NOT NULL AND partition = 'train' AND status <> 'pending' AND valid_rows < 2 "
        "GROUP BY run, partition, global_step, data_source "
        "UNION ALL "
        "SELECT run, partition, global_step, NULL, 'groups/below_min_valid', COUNT(*) FROM groups "
        "WHERE partition = 'train' AND status <> 'pending' AND valid_rows < 2 GROUP BY run, partition, global_step"
    )
    op.execute(
        "INSERT INTO metric_counts (run, partition, global_step, data_source, metric, value) "
        "SELECT run, partition, global_step, data_source, 'reward/mean_default_rule', value FROM metric_counts "
        "WHERE metric = 'reward/mean'"
    )
    op.execute(_attempts_view())
    op.execute("DROP VIEW IF EXISTS session_timeline")
    op.execute(_TIMELINE)


def downgrade() -> None:
    """Drop what 0005 added; its metric counters stay (rows an older projector never reads)."""
    op.execute("DROP VIEW IF EXISTS session_attempts")
    op.execute("DROP VIEW IF EXISTS session_timeline")
    op.execute(_TIMELINE_0002)
    # Plain DROP COLUMN (SQLite >= 3.35 has it): a batch rebuild would lose the expression indexes.
    for table, column in (
        ("queue_rows", "is_partial"),
        ("groups", "min_valid"),
        ("groups", "valid_rows"),
        ("sessions", "partial"),
        ("sessions", "metric_policy"),
        ("sessions", "failure_origin"),
        ("sessions", "attempts"),
    ):
        op.drop_column(table, column)
