"""Initial schema: the event log and the read models the projector rebuilds from it.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_checkpoints")),
    )
    op.create_table(
        "events",
        sa.Column(
            "position",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("event_id", sa.String(length=36), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("schema_version", sa.Integer(), nullable=False),
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("uid", sa.String(length=128), nullable=False),
        sa.Column("partition", sa.String(length=8), nullable=False),
        sa.Column("global_step", sa.BigInteger(), nullable=True),
        sa.Column(
            "data",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "payload",
            sa.LargeBinary().with_variant(postgresql.BYTEA(), "postgresql"),
            nullable=True,
        ),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("position", name=op.f("pk_events")),
        sa.UniqueConstraint("event_id", name=op.f("uq_events_event_id")),
        sa.UniqueConstraint("session_id", "version", name=op.f("uq_events_session_id_version")),
    )
    op.create_index(
        op.f("ix_events_run_partition_global_step"),
        "events",
        ["run", "partition", "global_step"],
        unique=False,
    )
    op.create_index(op.f("ix_events_run_uid"), "events", ["run", "uid"], unique=False)
    op.create_index(op.f("ix_events_type"), "events", ["type"], unique=False)

    op.create_table(
        "groups",
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("uid", sa.String(length=128), nullable=False),
        sa.Column("partition", sa.String(length=8), nullable=False),
        sa.Column("global_step", sa.BigInteger(), nullable=True),
        sa.Column("data_source", sa.String(length=128), nullable=True),
        sa.Column("group_size", sa.Integer(), nullable=False),
        sa.Column("sessions_seen", sa.Integer(), nullable=False),
        sa.Column("terminal", sa.Integer(), nullable=False),
        sa.Column("succeeded", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("cancelled", sa.Integer(), nullable=False),
        sa.Column("reward_sum", sa.Float(), nullable=False),
        sa.Column("reward_count", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("settled_position", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("run", "uid", name=op.f("pk_groups")),
    )
    op.create_index(
        op.f("ix_groups_run_partition_global_step"),
        "groups",
        ["run", "partition", "global_step"],
        unique=False,
    )

    op.create_table(
        "metric_counts",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("partition", sa.String(length=8), nullable=False),
        sa.Column("global_step", sa.BigInteger(), nullable=True),
        sa.Column("data_source", sa.String(length=128), nullable=True),
        sa.Column("metric", sa.String(length=128), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_metric_counts")),
    )
    op.create_index(
        op.f("ix_metric_counts_run_partition_global_step_data_source_metric"),
        "metric_counts",
        ["run", "partition", "global_step", "data_source", "metric"],
        unique=False,
    )

    op.create_table(
        "queue_rows",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("partition", sa.String(length=8), nullable=False),
        sa.Column("global_step", sa.BigInteger(), nullable=True),
        sa.Column("key", sa.String(length=160), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("uid", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=True),
        sa.Column("session_index", sa.Integer(), nullable=True),
        sa.Column("data_source", sa.String(length=128), nullable=True),
        sa.Column("source_position", sa.BigInteger(), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("is_placeholder", sa.Boolean(), nullable=False),
        sa.Column("failure_reason", sa.String(length=32), nullable=True),
        sa.Column("materialization_reason", sa.String(length=64), nullable=True),
        sa.Column("num_turns", sa.Integer(), nullable=True),
        sa.Column("prompt_len", sa.Integer(), nullable=True),
        sa.Column("response_len", sa.Integer(), nullable=True),
        sa.Column(
            "tags",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("produced_position", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_queue_rows")),
        sa.UniqueConstraint(
            "run", "partition", "key", name=op.f("uq_queue_rows_run_partition_key")
        ),
    )
    op.create_index(
        op.f("ix_queue_rows_run_partition_global_step"),
        "queue_rows",
        ["run", "partition", "global_step"],
        unique=False,
    )

    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("uid", sa.String(length=128), nullable=False),
        sa.Column("session_index", sa.Integer(), nullable=False),
        sa.Column("group_size", sa.Integer(), nullable=False),
        sa.Column("partition", sa.String(length=8), nullable=False),
        sa.Column("global_step", sa.BigInteger(), nullable=True),
        sa.Column("data_source", sa.String(length=128), nullable=True),
        sa.Column("runner", sa.String(length=128), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("num_trajectories", sa.Integer(), nullable=False),
        sa.Column("selected_rows", sa.Integer(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("score_source", sa.String(length=16), nullable=True),
        sa.Column(
            "reward_info",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("failure_reason", sa.String(length=32), nullable=True),
        sa.Column("error_type", sa.String(length=128), nullable=True),
        sa.Column("message", sa.String(length=512), nullable=True),
        sa.Column("placeholder", sa.Boolean(), nullable=False),
        sa.Column("created_position", sa.BigInteger(), nullable=False),
        sa.Column("terminal_position", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("terminal_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_sessions")),
    )
    op.create_index(
        op.f("ix_sessions_run_partition_global_step"),
        "sessions",
        ["run", "partition", "global_step"],
        unique=False,
    )
    op.create_index(op.f("ix_sessions_run_uid"), "sessions", ["run", "uid"], unique=False)
    op.create_index(op.f("ix_sessions_state"), "sessions", ["state"], unique=False)

    op.create_table(
        "queue_claims",
        sa.Column(
            "queue_row_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("consumer", sa.String(length=128), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["queue_row_id"],
            ["queue_rows.id"],
            name=op.f("fk_queue_claims_queue_row_id_queue_rows"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("queue_row_id", name=op.f("pk_queue_claims")),
    )


def downgrade() -> None:
    op.drop_table("queue_claims")
    op.drop_index(op.f("ix_sessions_state"), table_name="sessions")
    op.drop_index(op.f("ix_sessions_run_uid"), table_name="sessions")
    op.drop_index(op.f("ix_sessions_run_partition_global_step"), table_name="sessions")

    op.drop_table("sessions")
    op.drop_index(op.f("ix_queue_rows_run_partition_global_step"), table_name="queue_rows")

    op.drop_table("queue_rows")
    op.drop_index(
        op.f("ix_metric_counts_run_partition_global_step_data_source_metric"),
        table_name="metric_counts",
    )

    op.drop_table("metric_counts")
    op.drop_index(op.f("ix_groups_run_partition_global_step"), table_name="groups")

    op.drop_table("groups")
    op.drop_index(op.f("ix_events_type"), table_name="events")
    op.drop_index(op.f("ix_events_run_uid"), table_name="events")
    op.drop_index(op.f("ix_events_run_partition_global_step"), table_name="events")

    op.drop_table("events")
    op.drop_table("checkpoints")
