"""Group identity by (run, partition, global_step, uid), enforced at append; projection errors.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

* `events` gains `session_index` and `group_size`, promoted from each SessionCreated's data by
  the writer, and a partial unique index on (run, partition, step, uid, session_index) over
  creations: a second session with the same index in one group is refused by the database, in
  any process. Existing creations are backfilled; where an old log already repeats a slot, only
  the first creation (by position) keeps it, and the projector quarantines the others.
* `groups` is keyed by (run, partition, step, uid) instead of (run, uid): a uid that comes back at
  a later step is a new group. It gains `members`, the sorted session indices seen.
* `queue_rows` keys are unique per (run, partition, step, key) instead of (run, partition, key),
  so a reused uid's rows of two steps do not collide.
* `projection_errors` lists the events the projector quarantined.

A NULL step is a key part through coalesce(global_step, -1), as in revision 0003. The views
read `groups`, so they are dropped first and created again after, as revision 0002 defines them.
SQLite cannot drop a primary key or an inline unique constraint, so there the two tables are
rebuilt (queue claims saved around the rebuild: dropping `queue_rows` would cascade to them);
PostgreSQL alters them in place.
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_VIEWS = importlib.import_module("migrations.versions.0002_sql_views").VIEWS
_STEP = "coalesce(global_step, -1)"
_CREATION = sa.text("type = 'SessionCreated'")
_QUEUE_COLUMNS = (
    "id, run, partition, global_step, key, kind, uid, session_id, session_index, data_source, source_position, "
    "reward, is_placeholder, failure_reason, materialization_reason, num_turns, prompt_len, response_len, tags, "
    "produced_position"
)
_GROUP_COLUMNS = (
    "run, uid, partition, global_step, data_source, group_size, sessions_seen, terminal, succeeded, failed, "
    "cancelled, reward_sum, reward_count, status, settled_position"
)


def _json() -> sa.types.TypeEngine:
    return sa.JSON().with_variant(sa.dialects.postgresql.JSONB(), "postgresql")


def _postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def _views(create: bool) -> None:
    if create:
        for _name, sql in _VIEWS:
            op.execute(sql)
    else:
        for name, _sql in reversed(_VIEWS):
            op.execute(f"DROP VIEW IF EXISTS {name}")


def _events() -> None:
    op.add_column("events", sa.Column("session_index", sa.Integer(), nullable=True))
    op.add_column("events", sa.Column("group_size", sa.Integer(), nullable=True))
    if _postgres():
        op.execute(
            "UPDATE events SET session_index = (data->>'session_index')::integer, "
            "group_size = (data->>'group_size')::integer WHERE type = 'SessionCreated'"
        )
    else:
        op.execute(
            "UPDATE events SET session_index = json_extract(data, '$.session_index'), "
            "group_size = json_extract(data, '$.group_size') WHERE type = 'SessionCreated'"
        )
    op.execute(
        "UPDATE events SET session_index = NULL, group_size = NULL WHERE type = 'SessionCreated' AND position NOT IN "
        f"(SELECT min(position) FROM events WHERE type = 'SessionCreated' GROUP BY run, partition, {_STEP}, uid, session_index)"
    )
    op.create_index(
        "uq_events_group_slot",
        "events",
        ["run", "partition", sa.text(_STEP), "uid", "session_index"],
        unique=True,
        sqlite_where=_CREATION,
        postgresql_where=_CREATION,
    )


def _members_sql() -> str:
    """Each group's sorted session indices, as JSON, from the sessions projected so far."""
    if _postgres():
        return (
            "(SELECT coalesce(jsonb_agg(s.session_index ORDER BY s.session_index), '[]'::jsonb) FROM sessions s "
            "WHERE s.run = g.run AND s.uid = g.uid)"
        )
    return (
        "(SELECT coalesce(json_group_array(i), '[]') FROM (SELECT s.session_index AS i FROM sessions s "
        "WHERE s.run = g.run AND s.uid = g.uid ORDER BY s.session_index))"
    )


def _group_columns(members: bool) -> list[sa.Column]:
    columns = [
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
    ]
    if members:
        columns.append(sa.Column("members", _json(), nullable=False))
    else:
        columns.append(sa.PrimaryKeyConstraint("run", "uid", name="pk_groups"))
    return columns


def _rebuild_groups_sqlite(members: bool) -> None:
    op.create_table("groups_new", *_group_columns(members))
    select = f"{_GROUP_COLUMNS}, {_members_sql()}" if members else _GROUP_COLUMNS
    op.execute(
        f"INSERT INTO groups_new ({_GROUP_COLUMNS}{', members' if members else ''}) SELECT {select} FROM groups g"
    )
    op.drop_index("ix_groups_run_partition_global_step", table_name="groups")
    op.drop_table("groups")
    op.rename_table("groups_new", "groups")
    op.create_index(
        "ix_groups_run_partition_global_step",
        "groups",
        ["run", "partition", "global_step"],
        unique=False,
    )


def _groups() -> None:
    if _postgres():
        op.drop_constraint("pk_groups", "groups", type_="primary")
        op.add_column("groups", sa.Column("members", _json(), nullable=True))
        op.execute(f"UPDATE groups g SET members = {_members_sql()}")
        op.alter_column("groups", "members", nullable=False)
    else:
        _rebuild_groups_sqlite(members=True)
    op.create_index(
        "uq_groups_key", "groups", ["run", "partition", sa.text(_STEP), "uid"], unique=True
    )


def _rebuild_queue_rows_sqlite(old_unique: bool) -> None:
    """Rebuild `queue_rows` with (old_unique) or without the (run, partition, key) constraint,
    keeping its rows, ids and claims."""
    op.execute("CREATE TABLE queue_claims_saved AS SELECT * FROM queue_claims")
    op.drop_table("queue_claims")
    constraints = [sa.PrimaryKeyConstraint("id", name="pk_queue_rows")]
    if old_unique:
        constraints.append(
            sa.UniqueConstraint("run", "partition", "key", name="uq_queue_rows_run_partition_key")
        )
    op.create_table(
        "queue_rows_new",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
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
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("produced_position", sa.BigInteger(), nullable=False),
        *constraints,
    )
    op.execute(
        f"INSERT INTO queue_rows_new ({_QUEUE_COLUMNS}) SELECT {_QUEUE_COLUMNS} FROM queue_rows"
    )
    op.drop_index("ix_queue_rows_run_partition_global_step", table_name="queue_rows")
    op.drop_table("queue_rows")
    op.rename_table("queue_rows_new", "queue_rows")
    op.create_index(
        "ix_queue_rows_run_partition_global_step",
        "queue_rows",
        ["run", "partition", "global_step"],
        unique=False,
    )
    op.create_table(
        "queue_claims",
        sa.Column("queue_row_id", sa.Integer(), nullable=False),
        sa.Column("consumer", sa.String(length=128), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["queue_row_id"],
            ["queue_rows.id"],
            name="fk_queue_claims_queue_row_id_queue_rows",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("queue_row_id", name="pk_queue_claims"),
    )
    op.execute("INSERT INTO queue_claims SELECT * FROM queue_claims_saved")
    op.drop_table("queue_claims_saved")


def _queue_rows() -> None:
    if _postgres():
        op.drop_constraint("uq_queue_rows_run_partition_key", "queue_rows", type_="unique")
    else:
        _rebuild_queue_rows_sqlite(old_unique=False)
    op.create_index(
        "uq_queue_rows_key", "queue_rows", ["run", "partition", sa.text(_STEP), "key"], unique=True
    )


def upgrade() -> None:
    _views(create=False)
    _events()
    _groups()
    _queue_rows()
    op.create_table(
        "projection_errors",
        sa.Column("position", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("field", sa.String(length=128), nullable=True),
        sa.Column("reason", sa.String(length=512), nullable=False),
        sa.Column("outcome", sa.String(length=32), nullable=False),
        sa.PrimaryKeyConstraint("position", name="pk_projection_errors"),
    )
    _views(create=True)


def downgrade() -> None:
    """Back to (run, uid) groups and (run, partition, key) queue keys: fails, naming the
    constraint, if a uid was reused across steps (its groups and keys cannot be told apart)."""
    _views(create=False)
    op.drop_table("projection_errors")
    op.drop_index("uq_queue_rows_key", table_name="queue_rows")
    op.drop_index("uq_groups_key", table_name="groups")
    if _postgres():
        op.create_unique_constraint(
            "uq_queue_rows_run_partition_key", "queue_rows", ["run", "partition", "key"]
        )
        op.drop_column("groups", "members")
        op.create_primary_key("pk_groups", "groups", ["run", "uid"])
    else:
        _rebuild_queue_rows_sqlite(old_unique=True)
        _rebuild_groups_sqlite(members=False)
    op.drop_index("uq_events_group_slot", table_name="events")
    op.drop_column("events", "group_size")
    op.drop_column("events", "session_index")
    _views(create=True)
