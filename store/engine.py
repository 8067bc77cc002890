"""Engine set-up: URL normalisation and the per-backend settings the event store relies on.

SQLite: WAL (readers never block the writer), a busy timeout, `synchronous=NORMAL` (durable
across process crashes; an OS crash may lose the last commits but never corrupts), and
transactions begun by us rather than by pysqlite so that writers can take the write lock up
front (`BEGIN IMMEDIATE`) and check versions without racing another process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

DEFAULT_URL = "sqlite+aiosqlite:///rollouts.db"
ENV_VAR = "ROLLOUT_LEDGER_DB"

#: Execution option a connection sets to begin its transactions with the write lock held.
WRITE_LOCK = "rollout_ledger_write"

SQLITE_BUSY_TIMEOUT_MS = 30_000


def default_url() -> str:
    """`ROLLOUT_LEDGER_DB` if set, else a SQLite file in the working directory."""
    return os.environ.get(ENV_VAR) or DEFAULT_URL


def normalize_url(url: str | os.PathLike[str] | None) -> str:
    """Accept a SQLAlchemy URL, a bare file path (SQLite) or None (the default).

    Sync driver names are mapped to their async counterparts so users can paste the URL they
    already use elsewhere (`postgresql://…`, `sqlite:///…`).
    """
    if url is None:
        url = default_url()
    text = os.fspath(url)
    if "://" not in text:
        return f"sqlite+aiosqlite:///{Path(text)}"
    parsed = make_url(text)
    backend = parsed.get_backend_name()
    if backend == "sqlite" and parsed.drivername != "sqlite+aiosqlite":
        parsed = parsed.set(drivername="sqlite+aiosqlite")
    elif backend == "postgresql" and parsed.drivername != "postgresql+asyncpg":
        parsed = parsed.set(drivername="postgresql+asyncpg")
    elif backend not in ("sqlite", "postgresql"):
        raise ValueError(
            f"unsupported database URL {parsed.render_as_string(hide_password=True)!r}: "
            "use sqlite+aiosqlite:///FILE, a bare file path, or postgresql+asyncpg://…"
        )
    return parsed.render_as_string(hide_password=False)


def is_sqlite(engine_or_url: AsyncEngine | str) -> bool:
    return _backend(engine_or_url) == "sqlite"


def is_postgres(engine_or_url: AsyncEngine | str) -> bool:
    return _backend(engine_or_url) == "postgresql"


def _backend(engine_or_url: AsyncEngine | str) -> str:
    if isinstance(engine_or_url, AsyncEngine):
        return engine_or_url.dialect.name
    return make_url(engine_or_url).get_backend_name()


def create_engine(url: str | os.PathLike[str] | None = None, **kwargs: Any) -> AsyncEngine:
    """Create an async engine with the settings the ledger depends on."""
    text = normalize_url(url)
    parsed = make_url(text)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(text, parsed.database, **kwargs)
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(text, **kwargs)


def _sqlite_engine(url: str, database: str | None, **kwargs: Any) -> AsyncEngine:
    in_memory = not database or database == ":memory:"
    if in_memory:
        kwargs.setdefault("poolclass", StaticPool)
        kwargs.setdefault("connect_args", {"check_same_thread": False})
    else:
        parent = Path(database).expanduser().resolve().parent
        if not parent.is_dir():
            raise ValueError(f"cannot create SQLite database {database!r}: folder {parent} does not exist")
    engine = create_async_engine(url, **kwargs)

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # We issue BEGIN ourselves (below); pysqlite's implicit transactions would defeat it.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        if not in_memory:
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        if conn.get_execution_options().get(WRITE_LOCK):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")

    return engine
