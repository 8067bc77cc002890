"""A run's launches: the launch each session and group belongs to, and the view that says which
sessions a later launch superseded (issue 39).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06

* `sessions` and `groups` gain `launch`: the number of the run's launch (`RunLaunched.number`)
  that created them; NULL for everything recorded before launches were (there was one launch).
* `session_launches`: every session with its launch and `superseded` (1 when a later launch
  re-ran its step, so the step's batch and figures count the later launch's sessions only).

Nothing to backfill: a log without `RunLaunched` events has one launch per run, NULL throughout,
and nothing superseded, which is what a replay of it makes. Downgrade drops the view and columns.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# A session is superseded when a session of a later launch was created in its step (run,
# partition, global_step): the step's launch is the largest of its sessions'. The subquery reads
# the step's sessions through `ix_sessions_run_partition_global_step`.
SESSION_LAUNCHES = """
CREATE VIEW session_launches AS
SELECT
    s.session_id AS session_id,
    s.run AS run,
    s.partition AS partition,
    s.global_step AS global_step,
    s.uid AS uid,
    s.state AS state,
    s.launch AS launch,
    CASE WHEN COALESCE(s.launch, 0) < (
        SELECT MAX(COALESCE(x.launch, 0)) FROM sessions x
        WHERE x.run = s.run AND x.partition = s.partition
          AND (x.global_step = s.global_step OR (x.global_step IS NULL AND s.global_step IS NULL))
    ) THEN 1 ELSE 0 END AS superseded
FROM sessions s
"""


def upgrade() -> None:
    op.add_column("sessions", sa.Column("launch", sa.Integer(), nullable=True))
    op.add_column("groups", sa.Column("launch", sa.Integer(), nullable=True))
    op.execute(SESSION_LAUNCHES)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS session_launches")
    # Plain DROP COLUMN (SQLite >= 3.35 has it): a batch rebuild would lose the expression indexes.
    op.drop_column("groups", "launch")
    op.drop_column("sessions", "launch")
