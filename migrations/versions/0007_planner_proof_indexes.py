"""Planner-proof indexes: drop the two an unanalysed planner took instead of a natural key (issue 28).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03

A PostgreSQL table without statistics (autovacuum off, or a log bulk-loaded or caught up faster
than autovacuum's next pass) is planned from defaults, and at 10^6 events the planner took:

* `ix_events_type` (type IN (...) AND position <= ?, a bitmap over 400,000 trajectory events)
  for a page of sessions' trajectories, instead of `ix_events_session_id_type`: 682 ms a page
  instead of 13 ms. Every read of the log by type names its sessions (`store.read_models.
  log_reads`, `store.reads.export_reads`, `store.reads.tracker_reads`, `store.retention`), and the
  append checks slots through the partial `uq_events_group_slot`, so no read needs it.
* `ix_groups_run_partition_global_step` with only (run, partition) as its condition, a walk over
  every group of the run, for the projector's groups of one step and each group's UPDATE (47 ms
  a read instead of 0.17 ms, once per group per step): `uq_groups_key` starts with the same
  (run, partition, coalesce(global_step, -1)) and every read of groups by step now spells that.

With them gone the only index that can serve those reads is the intended one, with statistics
or without. Dropping an index takes a brief exclusive lock; no data changes. Downgrade recreates
both (reading the whole table once each).
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_events_type", table_name="events")
    op.drop_index("ix_groups_run_partition_global_step", table_name="groups")


def downgrade() -> None:
    op.create_index(
        "ix_groups_run_partition_global_step", "groups", ["run", "partition", "global_step"]
    )
    op.create_index("ix_events_type", "events", ["type"])
