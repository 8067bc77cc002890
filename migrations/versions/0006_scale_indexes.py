"""Scale indexes: reads bounded by the sessions they ask for, not by the log (issue 28).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

* `events` gains `ix_events_session_id_type` on (session_id, type): the trajectories of a page of
  sessions (`store.reads.export_reads.trajectory_events`, the projector's
  `store.read_models.log_reads.trajectory_events`, a tracker's trajectory reads) are found by
  session, so a read costs the sessions it names. Without it SQLite's planner, which has no
  statistics, preferred `ix_events_type (type=? AND rowid<?)` for an IN list of hundreds of
  sessions and read every trajectory event of the log.

The other queries issue 28 names need no new index: they now spell the existing natural keys
(`uq_events_group_slot`, `uq_groups_key`, `uq_metric_counts_scope`) the way those indexes are
declared. Building the index reads the whole `events` table once; on PostgreSQL it holds a lock
that blocks writers for that long (run the upgrade while no run is recording).
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_events_session_id_type", "events", ["session_id", "type"])


def downgrade() -> None:
    op.drop_index("ix_events_session_id_type", table_name="events")
