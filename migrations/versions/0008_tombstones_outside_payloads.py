"""Tombstones outside the payload bytes, and each prune record on its own step (issue 40).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06

Until now a pruned payload was recognised by its bytes: 64 of them, starting with a magic
prefix. A trajectory whose int32 token ids spell those bytes was taken for a tombstone, so an
untouched log failed `audit` and its step could not be pruned. From this revision the fact that
a payload was pruned lives in the row, not in the bytes:

* `events.pruned_by` names the prune that replaced the payload (NULL for every payload as
  recorded). The tombstone's bytes keep their layout (length and SHA-256 of the original), so
  every recorded prune's digest over them still holds, but they are read only where this column
  says a prune wrote them.
* A `PayloadsPruned` row carries its step's partition and `global_step`, and
  `ix_events_pruned_step` (partial, on those rows only) lets the append refuse a session created
  in a pruned step.

Existing logs migrate: each `PayloadsPruned` row gets the partition and the step its data names
(every prune so far recorded one step), and an old tombstone becomes the new form only where a
recorded prune wrote it: 64 bytes with the magic prefix and that prune's id, on an event of the
prune's run, partition and step, at a position before the prune's record. A token payload that
merely spells those bytes matches none of that and stays a payload. Everything runs in the
revision's one transaction (SQLite and PostgreSQL). Downgrade drops the column and the index and
clears the steps; the tombstones' bytes are those the older code reads.
"""

from __future__ import annotations

import json
import struct
import uuid
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The old tombstone layout, as `sessions.runs.retention` wrote it (a revision never imports the
# code it migrates: the code may change later, the revision may not).
_MAGIC = b"\x00RLPRUN\x01"
_LAYOUT = struct.Struct("<8s16sQ32s")
_RUN_PREFIX = "@run:"
_PRUNE_RECORD = sa.text("type = 'PayloadsPruned'")


def _data(raw: Any) -> dict[str, Any]:
    value = raw if isinstance(raw, dict) else json.loads(raw)
    return value if isinstance(value, dict) else {}


def _run_of(conn: sa.Connection, position: int) -> str:
    """A run stream's run, as its events store it (a long run name is hashed in the stream id)."""
    return str(
        conn.execute(
            sa.text("SELECT run FROM events WHERE position = :p"), {"p": position}
        ).scalar_one()
    )


def _migrate_prunes(conn: sa.Connection) -> None:
    records = conn.execute(
        sa.text(
            "SELECT position, data FROM events WHERE type = 'PayloadsPruned' "
            "AND session_id LIKE :prefix ORDER BY position"
        ),
        {"prefix": _RUN_PREFIX + "%"},
    ).all()
    for position, raw in records:
        try:
            data = _data(raw)
            prune_id = str(uuid.UUID(str(data["prune_id"])))
            partition = str(data["partition"])
            steps = [int(step) for step in data["steps"]]
        except (ValueError, KeyError, TypeError):
            continue  # unreadable: `audit` names it; nothing here to convert
        run = _run_of(conn, position)
        if len(steps) == 1:
            conn.execute(
                sa.text(
                    "UPDATE events SET partition = :partition, global_step = :step WHERE position = :p"
                ),
                {"partition": partition, "step": steps[0], "p": position},
            )
        for step in steps:
            candidates = conn.execute(
                sa.text(
                    "SELECT position, payload FROM events WHERE run = :run AND partition = :partition "
                    "AND global_step = :step AND position < :record AND payload IS NOT NULL "
                    "AND length(payload) = :size"
                ),
                {
                    "run": run,
                    "partition": partition,
                    "step": step,
                    "record": position,
                    "size": _LAYOUT.size,
                },
            ).all()
            for event_position, payload in candidates:
                magic, embedded, _length, _digest = _LAYOUT.unpack(bytes(payload))
                if magic == _MAGIC and str(uuid.UUID(bytes=embedded)) == prune_id:
                    conn.execute(
                        sa.text("UPDATE events SET pruned_by = :prune WHERE position = :p"),
                        {"prune": prune_id, "p": event_position},
                    )


def upgrade() -> None:
    op.add_column("events", sa.Column("pruned_by", sa.String(36), nullable=True))
    op.create_index(
        "ix_events_pruned_step",
        "events",
        ["run", "partition", "global_step"],
        sqlite_where=_PRUNE_RECORD,
        postgresql_where=_PRUNE_RECORD,
    )
    _migrate_prunes(op.get_bind())


def downgrade() -> None:
    op.execute("UPDATE events SET partition = '', global_step = NULL WHERE type = 'PayloadsPruned'")
    op.drop_index("ix_events_pruned_step", table_name="events")
    op.drop_column("events", "pruned_by")
