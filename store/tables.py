"""The schema, declared once with SQLAlchemy Core.

Alembic revisions create it (`migrations/`); a test compares the two so they cannot drift.
`events` is the source of truth; every other table is a read model the projector rebuilds
from it (DESIGN §8).
"""

from __future__ import annotations

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
BigKey = BigInteger().with_variant(Integer(), "sqlite")
Json = JSON().with_variant(JSONB(), "postgresql")
Binary = LargeBinary().with_variant(BYTEA(), "postgresql")

SESSION_ID = 128
NAME = 128

events = Table(
    "events",
    metadata,
    Column("position", BigKey, primary_key=True, autoincrement=True),
    Column("event_id", String(36), nullable=False, unique=True),
    Column("session_id", String(SESSION_ID), nullable=False),
    Column("version", Integer, nullable=False),
    Column("type", String(64), nullable=False),
    Column("schema_version", Integer, nullable=False),
    Column("run", String(NAME), nullable=False),
    Column("uid", String(NAME), nullable=False),
    Column("partition", String(8), nullable=False),
    Column("global_step", BigInteger, nullable=True),
    Column("data", Json, nullable=False),
    Column("payload", Binary, nullable=True),
    Column("recorded_at", DateTime(timezone=True), nullable=False),
    UniqueConstraint("session_id", "version"),
    Index(None, "run", "partition", "global_step"),
    Index(None, "run", "uid"),
    Index(None, "type"),
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
    Column("reward_info", Json, nullable=False),
    Column("failure_reason", String(32), nullable=True),
    Column("error_type", String(NAME), nullable=True),
    Column("message", String(512), nullable=True),
    Column("placeholder", Boolean, nullable=False),
    Column("created_position", BigInteger, nullable=False),
    Column("terminal_position", BigInteger, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("terminal_at", DateTime(timezone=True), nullable=True),
    Index(None, "run", "partition", "global_step"),
    Index(None, "run", "uid"),
    Index(None, "state"),
)

groups = Table(
    "groups",
    metadata,
    Column("run", String(NAME), primary_key=True),
    Column("uid", String(NAME), primary_key=True),
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
    Index(None, "run", "partition", "global_step"),
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
        "uq_metric_counts_scope", "run", "partition", func.coalesce(text("global_step"), -1),
        func.coalesce(text("data_source"), ""), "metric", unique=True,
    ),
)

queue_rows = Table(
    "queue_rows",
    metadata,
    Column("id", BigKey, primary_key=True, autoincrement=True),
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
    Column("tags", Json, nullable=False),
    Column("produced_position", BigInteger, nullable=False),
    UniqueConstraint("run", "partition", "key"),
    Index(None, "run", "partition", "global_step"),
)

queue_claims = Table(
    "queue_claims",
    metadata,
    Column("queue_row_id", BigKey, ForeignKey("queue_rows.id", ondelete="CASCADE"), primary_key=True),
    Column("consumer", String(NAME), nullable=False),
    Column("claimed_at", DateTime(timezone=True), nullable=False),
    Column("acked_at", DateTime(timezone=True), nullable=True),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("name", String(NAME), primary_key=True),
    Column("position", BigInteger, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

#: Tables the projector owns and `replay` rebuilds (queue_claims is consumer state, not derived).
READ_MODELS = (sessions, groups, metric_counts, queue_rows, checkpoints)
