"""Model calls: per-session call counts, the weights versions of each queue row, the model_calls view.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06

* `sessions` gains `model_calls` (calls started, over all attempts) and `model_calls_failed`;
  sessions projected before this revision recorded none (no such events existed), so 0.
* `queue_rows` gains `min_global_steps` and `max_global_steps` (verl's names): the lowest and
  highest weights version behind a row's response, null where unknown and for placeholders. Rows
  projected before this revision had no versions recorded, so they stay null.
* `model_calls`: one row per model call (its `ModelCallStarted`, and its `ModelCallRecorded` or
  `ModelCallFailed` in the same attempt), read straight from the log like `session_attempts`.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def _postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def _text(column: str, key: str) -> str:
    return f"({column}->>'{key}')" if _postgres() else f"json_extract({column}, '$.{key}')"


def _number(column: str, key: str, kind: str) -> str:
    """A JSON number as SQL `kind` (PostgreSQL's ->> gives text; SQLite's json_extract a number)."""
    return f"CAST({_text(column, key)} AS {kind})"


def _model_calls_view() -> str:
    ends = "('ModelCallRecorded', 'ModelCallFailed')"
    integer, real = "BIGINT", ("DOUBLE PRECISION" if _postgres() else "REAL")
    return f"""
CREATE VIEW model_calls AS
SELECT
    st.session_id AS session_id,
    st.run AS run,
    st.uid AS uid,
    st.partition AS partition,
    st.global_step AS global_step,
    (SELECT COUNT(*) FROM events p
      WHERE p.session_id = st.session_id AND p.type = 'SessionStarted' AND p.version <= st.version) AS attempt,
    {_text("st.data", "call_id")} AS call_id,
    {_number("st.data", "turn", integer)} AS turn,
    CASE en.type
        WHEN 'ModelCallRecorded' THEN 'recorded'
        WHEN 'ModelCallFailed' THEN 'failed'
        ELSE 'open'
    END AS outcome,
    CASE WHEN en.type = 'ModelCallRecorded'
        THEN {_number("en.data", "prompt_shared", integer)} + {_number("en.data", "prompt_len", integer)}
    END AS prompt_tokens,
    {_number("en.data", "response_len", integer)} AS response_tokens,
    {_number("en.data", "latency_s", real)} AS latency_s,
    {_number("en.data", "min_version", integer)} AS min_version,
    {_number("en.data", "max_version", integer)} AS max_version,
    {_text("en.data", "finish_reason")} AS finish_reason,
    {_text("en.data", "server")} AS server,
    CASE WHEN en.type = 'ModelCallFailed' THEN {_text("en.data", "error_type")} END AS error_type,
    CASE WHEN en.type = 'ModelCallFailed' THEN {_text("en.data", "message")} END AS error,
    st.position AS started_position,
    st.recorded_at AS started_at,
    en.position AS ended_position,
    en.recorded_at AS ended_at
FROM events st
LEFT JOIN events en ON en.session_id = st.session_id AND en.type IN {ends}
    AND en.version > st.version
    AND {_text("en.data", "call_id")} = {_text("st.data", "call_id")}
    AND NOT EXISTS (
        SELECT 1 FROM events a
        WHERE a.session_id = st.session_id AND a.type = 'AttemptFailed'
          AND a.version > st.version AND a.version < en.version
    )
WHERE st.type = 'ModelCallStarted'
"""


def upgrade() -> None:
    op.add_column("sessions", sa.Column("model_calls", sa.Integer(), nullable=True))
    op.add_column("sessions", sa.Column("model_calls_failed", sa.Integer(), nullable=True))
    op.execute("UPDATE sessions SET model_calls = 0, model_calls_failed = 0")
    op.add_column("queue_rows", sa.Column("min_global_steps", sa.BigInteger(), nullable=True))
    op.add_column("queue_rows", sa.Column("max_global_steps", sa.BigInteger(), nullable=True))
    op.execute(_model_calls_view())


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS model_calls")
    # Plain DROP COLUMN (SQLite >= 3.35 has it): a batch rebuild would lose the expression indexes.
    op.drop_column("queue_rows", "max_global_steps")
    op.drop_column("queue_rows", "min_global_steps")
    op.drop_column("sessions", "model_calls_failed")
    op.drop_column("sessions", "model_calls")
