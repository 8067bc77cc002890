"""The OpenTelemetry follower's checkpoints, and sessions in the order they ended (issue 45).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06

* `otel_checkpoints`: one row per named follower (`rollout-ledger export-otel --follow`): the
  terminal position of the last session it sent, and how many sessions it has sent. A restart
  reads its row and goes on after that position, so no settled session is skipped or sent twice
  (docs/otel.md).
* `ix_sessions_terminal_position`: the follower reads the sessions that ended after its position,
  page by page; without the index each page would scan every session of the database.

Nothing to backfill: a follower that has never run has no row, and starts at the beginning.
Downgrade drops both.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "otel_checkpoints",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("sessions", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_otel_checkpoints")),
    )
    op.create_index("ix_sessions_terminal_position", "sessions", ["terminal_position"])


def downgrade() -> None:
    op.drop_index("ix_sessions_terminal_position", table_name="sessions")
    op.drop_table("otel_checkpoints")
