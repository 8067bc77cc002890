"""The schema, declared once with SQLAlchemy Core.

Alembic revisions create it (`migrations/`); a test compares the two so they cannot drift.
`events` is the source of truth; every other table is a read model the projector rebuilds
from it (docs/design.md §8).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import BYTEA, JSONB

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

#: 64-bit keys on PostgreSQL; SQLite only autoincrements an INTEGER PRIMARY KEY.
_BigKey = BigInteger().with_variant(Integer(), "sqlite")
_Json = JSON().with_variant(JSONB(), "postgresql")
_Binary = LargeBinary().with_variant(BYTEA(), "postgresql")

SESSION_ID = 128
NAME = 128


def step_key() -> Any:
    """`global_step` as a key part: NULL ("no step") compared equal to itself, as -1 (steps are
    >= 0). Unique indexes treat NULLs as distinct, so every natural key with a step uses this."""
    return func.coalesce(text("global_step"), -1)


#: Only creation events claim a slot in a group (see `uq_events_group_slot`).
_CREATION = text("type = 'SessionCreated'")
#: Only prune records name a pruned step (see `ix_events_pruned_step`).
_PRUNE_RECORD = text("type = 'PayloadsPruned'")

events = Table(
    "events",
    metadata,
    Column("position", _BigKey, primary_key=True, autoincrement=True),
    Column("event_id", String(36), nullable=False, unique=True),
    Column("session_id", String(SESSION_ID), nullable=False),
    Column("version", Integer, nullable=False),
    Column("type", String(64), nullable=False),
    Column("schema_version", Integer, nullable=False),
    Column("run", String(NAME), nullable=False),
    Column("uid", String(NAME), nullable=False),
    Column("partition", String(8), nullable=False),
    Column("global_step", BigInteger, nullable=True),
    Column("data", _Json, nullable=False),
    Column("payload", _Binary, nullable=True),
    Column("recorded_at", DateTime(timezone=True), nullable=False),
    # A SessionCreated's slot in its group, promoted from its data by the writer (NULL on every
    # other event, and on creations written before revision 0004 that repeated a slot): the
    # database itself refuses a second session with the same index in one group, across
    # processes, and the event store checks siblings' group_size against it (store.log.append_sql).
    Column("session_index", Integer, nullable=True),
    Column("group_size", Integer, nullable=True),
    # The prune that replaced this event's payload with a tombstone (revision 0008), NULL on every
    # payload as recorded: a tombstone is known by this column, never by its bytes' shape, so no
    # token sequence can pass for one (sessions.runs.retention).
    Column("pruned_by", String(36), nullable=True),
    UniqueConstraint("session_id", "version"),
    Index(None, "run", "partition", "global_step"),
    Index(None, "run", "uid"),
    # A page of sessions' trajectories, found by session (revision 0006). No index on `type`
    # alone (dropped in 0007): planners without statistics took it for that IN list of sessions
    # and read every trajectory of the log.
    Index(None, "session_id", "type"),
    Index(
        "uq_events_group_slot",
        "run",
        "partition",
        step_key(),
        "uid",
        "session_index",
        unique=True,
        sqlite_where=_CREATION,
        postgresql_where=_CREATION,
    ),
    # A step's prune record (a PayloadsPruned row carries its partition and step, revision 0008):
    # the append looks a creation's step up here to refuse a session in a pruned step.
    Index(
        "ix_events_pruned_step",
        "run",
        "partition",
        "global_step",
        sqlite_where=_PRUNE_RECORD,
        postgresql_where=_PRUNE_RECORD,
    ),
)

sessions = Table(
    "sessions",
    metadata,
    Column("session_id", String(SESSION_ID), primary_key=True),
    Column("run", String(NAME), nullable=False),
    Column("uid", String(NAME), nullable=False),
    Column("session_index", Integer, nullable=False),
    Column("group_size", Integer, nullable=False),
    Column("partition", String(8), nullable=False),
    Column("global_step", BigInteger, nullable=True),
    Column("data_source", String(NAME), nullable=True),
    Column("runner", String(NAME), nullable=True),
    Column("state", String(16), nullable=False),
    Column("version", Integer, nullable=False),
    Column("num_trajectories", Integer, nullable=False),
    Column("selected_rows", Integer, nullable=False),
    Column("reward", Float, nullable=True),
    Column("score_source", String(16), nullable=True),
    Column("reward_info", _Json, nullable=False),
    Column("failure_reason", String(32), nullable=True),
    Column("error_type", String(NAME), nullable=True),
    Column("message", String(512), nullable=True),
    Column("placeholder", Boolean, nullable=False),
    # Revision 0005 (nullable only so they could be added in place; the projector always fills them).
    Column("attempts", Integer, nullable=True),
    Column("failure_origin", String(8), nullable=True),
    Column("metric_policy", String(8), nullable=True),
    Column("partial", Boolean, nullable=True),
    # Revision 0010: model calls started over all attempts, and those that failed (design §15).
    Column("model_calls", Integer, nullable=True),
    Column("model_calls_failed", Integer, nullable=True),
    Column("created_position", BigInteger, nullable=False),
    Column("terminal_position", BigInteger, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("terminal_at", DateTime(timezone=True), nullable=True),
    # Revision 0009: the number of the run's launch the session belongs to (its creation's, or
    # the step's launch then for a session recorded without one); NULL before any launch. A
    # session whose launch is below its step's latest is superseded (the `session_launches` view).
    Column("launch", Integer, nullable=True),
    Index(None, "run", "partition", "global_step"),
    Index(None, "run", "uid"),
    Index(None, "state"),
    # Revision 0011: the OpenTelemetry follower reads sessions in the order they ended.
    Index(None, "terminal_position"),
)

#: A group is (run, partition, global_step, uid): a uid that comes back at a later step is a new
#: group. `members` lists the session indices seen, sorted, so a second session with the same
#: index (in a log written without the database's slot check) is quarantined, not projected.
groups = Table(
    "groups",
    metadata,
    Column("run", String(NAME), nullable=False),
    Column("uid", String(NAME), nullable=False),
    Column("partition", String(8), nullable=False),
    Column("global_step", BigInteger, nullable=True),
    Column("data_source", String(NAME), nullable=True),
    Column("group_size", Integer, nullable=False),
    Column("sessions_seen", Integer, nullable=False),
    Column("terminal", Integer, nullable=False),
    Column("succeeded", Integer, nullable=False),
    Column("failed", Integer, nullable=False),
    Column("cancelled", Integer, nullable=False),
    Column("reward_sum", Float, nullable=False),
    Column("reward_count", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("settled_position", BigInteger, nullable=True),
    Column("members", _Json, nullable=False),
    Column("valid_rows", Integer, nullable=True),  # non-placeholder rows (revision 0005)
    Column("min_valid", Integer, nullable=True),
    Column("launch", Integer, nullable=True),  # its first session's launch (revision 0009)
    # Only the natural key (revision 0007 dropped the plain (run, partition, global_step) index):
    # reads by step spell `coalesce(global_step, -1)` (store.read_models.keys.step_equals), so
    # this is the one index that can serve them, with or without the planner's statistics.
    Index("uq_groups_key", "run", "partition", step_key(), "uid", unique=True),
)

#: Keyed by its natural key (run, partition, global_step, data_source, metric), so a replay cannot
#: differ from the live database by a surrogate id. NULL stands for "no step" and "all data
#: sources", and a unique constraint treats NULLs as distinct, so the key is a unique index on
#: expressions that map NULL to a value no row can hold (-1: steps are >= 0; '': an empty data
#: source is refused at append). The columns stay NULL for SQL users; the metric upsert
#: (`store.read_models.METRIC_UPSERT`) names the same expressions as its conflict target.
metric_counts = Table(
    "metric_counts",
    metadata,
    Column("run", String(NAME), nullable=False),
    Column("partition", String(8), nullable=False),
    Column("global_step", BigInteger, nullable=True),
    Column("data_source", String(NAME), nullable=True),
    Column("metric", String(NAME), nullable=False),
    Column("value", Float, nullable=False),
    Index(
        "uq_metric_counts_scope",
        "run",
        "partition",
        step_key(),
        func.coalesce(text("data_source"), ""),
        "metric",
        unique=True,
    ),
)

queue_rows = Table(
    "queue_rows",
    metadata,
    Column("id", _BigKey, primary_key=True, autoincrement=True),
    Column("run", String(NAME), nullable=False),
    Column("partition", String(8), nullable=False),
    Column("global_step", BigInteger, nullable=True),
    Column("key", String(NAME + 32), nullable=False),
    Column("kind", String(8), nullable=False),
    Column("uid", String(NAME), nullable=False),
    Column("session_id", String(SESSION_ID), nullable=True),
    Column("session_index", Integer, nullable=True),
    Column("data_source", String(NAME), nullable=True),
    Column("source_position", BigInteger, nullable=True),
    Column("reward", Float, nullable=True),
    Column("is_placeholder", Boolean, nullable=False),
    Column("failure_reason", String(32), nullable=True),
    Column("materialization_reason", String(64), nullable=True),
    Column("num_turns", Integer, nullable=True),
    Column("prompt_len", Integer, nullable=True),
    Column("response_len", Integer, nullable=True),
    Column("tags", _Json, nullable=False),
    Column("produced_position", BigInteger, nullable=False),
    Column(
        "is_partial", Boolean, nullable=True
    ),  # a keep_partial failure's trajectory (revision 0005)
    # the weights versions behind a trajectory's response, verl's names (revision 0010)
    Column("min_global_steps", BigInteger, nullable=True),
    Column("max_global_steps", BigInteger, nullable=True),
    Index(None, "run", "partition", "global_step"),
    Index("uq_queue_rows_key", "run", "partition", step_key(), "key", unique=True),
)

queue_claims = Table(
    "queue_claims",
    metadata,
    Column(
        "queue_row_id", _BigKey, ForeignKey("queue_rows.id", ondelete="CASCADE"), primary_key=True
    ),
    Column("consumer", String(NAME), nullable=False),
    Column("claimed_at", DateTime(timezone=True), nullable=False),
    Column("acked_at", DateTime(timezone=True), nullable=True),
)

#: Events the projector could not project, and what it did instead (docs/design.md §7): the session was
#: failed as `unprojectable` where it could be, and projection went on. Keyed by position.
projection_errors = Table(
    "projection_errors",
    metadata,
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("session_id", String(SESSION_ID), nullable=False),
    Column("type", String(64), nullable=False),
    Column("field", String(NAME), nullable=True),
    Column("reason", String(512), nullable=False),
    Column("outcome", String(32), nullable=False),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("name", String(NAME), primary_key=True),
    Column("position", BigInteger, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

#: How far each OpenTelemetry follower has sent the log's settled sessions (revision 0011): the
#: terminal position of the last one sent. A follower's own state, never rebuilt by `replay`.
otel_checkpoints = Table(
    "otel_checkpoints",
    metadata,
    Column("name", String(NAME), primary_key=True),
    Column("position", BigInteger, nullable=False),
    Column("sessions", BigInteger, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

#: Tables the projector owns and `replay` rebuilds (queue_claims is consumer state, not derived).
READ_MODELS = (sessions, groups, metric_counts, queue_rows, projection_errors, checkpoints)
