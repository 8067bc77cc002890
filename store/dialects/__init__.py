"""What differs between SQLite and PostgreSQL, answered by one `Dialect` object per backend.

As Alembic's `ddl/` registry: one module per database (`sqlite.py`, `postgresql.py`), each a
subclass of `base.Dialect`, and `dialect_of` picks the instance for an engine, a connection, a
URL or a backend name. Code elsewhere in `store` asks that object (lock statements, parameter
marks, upsert and member-of forms, timestamps, key order, the lease clock, connection settings,
the `sql` verb's read-only guard, driver-level calls) and never branches on a backend's name.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import URL, make_url

from store.dialects.base import WRITE_LOCK, Dialect, DriverCalls
from store.dialects.postgresql import PostgresDialect
from store.dialects.sqlite import SqliteDialect
from store.errors import StoreInputError

__all__ = [
    "POSTGRES",
    "SQLITE",
    "WRITE_LOCK",
    "Dialect",
    "DriverCalls",
    "dialect_of",
    "find_dialect",
]

SQLITE = SqliteDialect()
POSTGRES = PostgresDialect()
#: Every backend the ledger runs on, by SQLAlchemy's backend name.
_REGISTRY: dict[str, Dialect] = {d.name: d for d in (SQLITE, POSTGRES)}


def find_dialect(name: str) -> Dialect | None:
    """The dialect of a SQLAlchemy backend name, or None for a backend the ledger does not run on."""
    return _REGISTRY.get(name)


def dialect_of(bind: Any) -> Dialect:
    """The dialect of an engine or connection (async or not), a URL (text or `URL`), a backend
    name, or a SQLAlchemy dialect. Raises ValueError for a backend the ledger does not run on."""
    if isinstance(bind, Dialect):
        return bind
    if isinstance(bind, str):
        name = bind if bind in _REGISTRY else make_url(bind).get_backend_name()
    elif isinstance(bind, URL):
        name = bind.get_backend_name()
    elif hasattr(bind, "dialect"):  # engines and connections, async or not
        name = bind.dialect.name
    else:  # a SQLAlchemy dialect
        name = bind.name
    dialect = _REGISTRY.get(name)
    if dialect is None:
        raise StoreInputError(
            f"unsupported database backend {name!r}: rollout-ledger runs on SQLite "
            "(sqlite+aiosqlite:///FILE) and PostgreSQL (postgresql+asyncpg://…)"
        )
    return dialect
