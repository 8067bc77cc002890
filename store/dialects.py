"""What differs between SQLite and PostgreSQL, in one place per concern (as Alembic's `ddl/`).

Code elsewhere asks `dialect_of(engine)` for the answer instead of branching on the backend's
name itself: lock ids and lock statements, parameter marks, the metric upsert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: PostgreSQL advisory lock ids ("RLPR", "RLLD"): one projector page at a time; one leading follower.
PG_PROJECTOR_LOCK = 0x524C5052
PG_LEADER_LOCK = 0x524C4C44


@dataclass(frozen=True)
class Dialect:
    """The SQLite answers; `PostgresDialect` overrides them."""

    name: str = "sqlite"
    #: Whether the backend serialises projector pages by an explicit lock statement (SQLite's page
    #: transaction takes the file's write lock with BEGIN IMMEDIATE instead: `store.engine.WRITE_LOCK`).
    page_lock_sql: str | None = None

    def mark(self, index: int) -> str:
        """The driver's parameter mark for the `index`-th (1-based) parameter."""
        return "?"


@dataclass(frozen=True)
class PostgresDialect(Dialect):
    name: str = "postgresql"
    page_lock_sql: str | None = f"SELECT pg_advisory_xact_lock({PG_PROJECTOR_LOCK})"
    try_leader_sql: str = f"SELECT pg_try_advisory_lock({PG_LEADER_LOCK})"
    release_leader_sql: str = f"SELECT pg_advisory_unlock({PG_LEADER_LOCK})"

    def mark(self, index: int) -> str:
        return f"${index}"


SQLITE = Dialect()
POSTGRES = PostgresDialect()


def dialect_of(bind: Any) -> Dialect:
    """The dialect of an engine, a connection, or a dialect name."""
    name = bind if isinstance(bind, str) else bind.dialect.name
    return POSTGRES if name == "postgresql" else SQLITE
