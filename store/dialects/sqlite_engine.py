"""SQLite connections: the settings the event store relies on, for every connection an engine opens.

WAL (readers never block the writer), a busy timeout, `synchronous=NORMAL` (durable across
process crashes; an OS crash may lose the last commits but never corrupts), foreign keys, and
transactions begun by us rather than by pysqlite so that writers can take the write lock up
front (`BEGIN IMMEDIATE` under `WRITE_LOCK`) and check versions without racing another process.

The busy timeout is how long one statement waits for another process's write lock before
SQLite reports `database is locked`; appends retry that a few times with backoff
(`store.retry.retry_transient`), so the whole budget is about `RETRY_ATTEMPTS` times the
busy timeout. A file's engine also has a synchronous twin with the same settings for the append
writer's thread (`store.log.sqlite_writer`).
"""

from __future__ import annotations

import os
import sqlite3
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool, StaticPool

from store.dialects.base import WRITE_LOCK
from store.errors import StoreError, StoreInputError
from store.stored_json import load_json

__all__ = ["in_memory", "sqlite_engine", "sqlite_file", "writer_twin"]

_SQLITE_BUSY_TIMEOUT_MS = 30_000


def in_memory(parsed: URL) -> bool:
    """Whether a SQLite URL opens a database in memory (no file: a second connection sees another)."""
    database = sqlite_file(parsed)
    return not database or database == ":memory:" or parsed.query.get("mode") == "memory"


def _busy_timeout_ms(seconds: float | None) -> int:
    if seconds is None:
        return _SQLITE_BUSY_TIMEOUT_MS
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not 0 <= seconds < 2**31 / 1000
    ):
        raise StoreInputError(
            f"sqlite_busy_timeout must be a number of seconds >= 0, got {seconds!r}"
        )
    return int(round(seconds * 1000))


def sqlite_file(parsed: Any) -> str | None:
    """The file behind a SQLite URL; for `file:` URIs (`?uri=true`) the path part of the URI."""
    database = parsed.database
    uri = str(parsed.query.get("uri", "")).lower() in ("true", "1")
    if uri and database and database.startswith("file:"):
        path = database[len("file:") :].split("?", 1)[0]
        if path.startswith("//"):  # file://host/path: only an empty host (or localhost) is local
            path = "/" + path[2:].split("/", 1)[1] if "/" in path[2:] else ""
        return path or None
    return database


def _unwritable(database: str) -> str | None:
    """Why the folder of an existing database file cannot be written to, or None if it can."""
    path = Path(database).expanduser()
    if not path.exists():
        return None
    folder = path.resolve().parent
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"its filesystem ({folder}) is mounted read-only"
    except OSError:
        pass
    if not os.access(folder, os.W_OK):
        return f"this process may not write to its folder {folder}"
    return None


def _enable_wal(cursor: Any, busy_ms: int) -> None:
    """Switch the file to WAL unless it already is.

    Only the switch needs an exclusive lock, and it can wait for one that never comes: when
    several connections open a new file at once, one may read "delete", another switch the file
    and stay open (a WAL connection keeps a shared lock on the file), and the first then waits out
    its whole busy timeout. So the switch is tried in short waits, looking again between them
    whether someone else has switched the file meanwhile; the overall budget stays `busy_ms`.
    """

    def mode() -> str:
        cursor.execute("PRAGMA journal_mode")
        return str(cursor.fetchone()[0]).lower()

    if mode() == "wal":
        return
    step = min(busy_ms, _WAL_SWITCH_WAIT_MS)
    cursor.execute(f"PRAGMA busy_timeout={step}")
    try:
        for _ in range(max(1, busy_ms // max(step, 1))):
            try:
                cursor.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as error:
                if "locked" not in str(error).lower():
                    raise
            if mode() == "wal":
                return
        cursor.execute("PRAGMA journal_mode=WAL")  # out of budget: let the error through
    finally:
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")


#: Each wait for the lock that switching a file to WAL needs (see `_enable_wal`).
_WAL_SWITCH_WAIT_MS = 100


def sqlite_engine(
    url: str,
    parsed: Any,
    *,
    busy_timeout: float | None = None,
    read_only: bool = False,
    **kwargs: Any,
) -> AsyncEngine:
    """An async engine on a SQLite URL. `read_only`: its connections neither switch the file to
    WAL nor set its auto_vacuum, and refuse writes (`query_only`), so a verb that only reads
    leaves a file in DELETE mode (a fresh backup) as it found it."""
    database = sqlite_file(parsed)
    busy_ms = _busy_timeout_ms(busy_timeout)
    memory = in_memory(parsed)
    if memory:
        kwargs.setdefault("poolclass", StaticPool)
        kwargs.setdefault("connect_args", {"check_same_thread": False})
    else:
        parent = Path(database).expanduser().resolve().parent
        if not parent.is_dir():
            raise StoreInputError(
                f"cannot create SQLite database {database!r}: folder {parent} does not exist"
            )
    kwargs.setdefault("json_deserializer", load_json)
    engine = create_async_engine(url, **kwargs)
    settings = _SqliteSettings(url, database, busy_ms, memory, read_only)
    _configure_sqlite(engine.sync_engine, settings)
    _SQLITE_SETTINGS[engine.sync_engine] = settings
    return engine


@dataclass(frozen=True, slots=True)
class _SqliteSettings:
    """What a connection to one SQLite file is opened with, kept for its append writer's twin."""

    url: str
    database: str | None
    busy_ms: int
    in_memory: bool
    read_only: bool = False


#: The settings each SQLite engine made by `create_engine` was opened with.
_SQLITE_SETTINGS: weakref.WeakKeyDictionary[sqlalchemy.Engine, _SqliteSettings] = (
    weakref.WeakKeyDictionary()
)


def writer_twin(engine: AsyncEngine) -> sqlalchemy.Engine | None:
    """A synchronous engine on the same SQLite file with the same settings (WAL, busy timeout,
    BEGIN IMMEDIATE under `WRITE_LOCK`), for the append writer's own thread
    (`store.log.sqlite_writer`); None for PostgreSQL, an in-memory database (a second connection
    would see another database), a read-only engine or an engine not made by `create_engine`."""
    settings = _SQLITE_SETTINGS.get(engine.sync_engine)
    if settings is None or settings.in_memory or settings.read_only:
        return None
    url = make_url(settings.url).set(drivername="sqlite+pysqlite")
    sync = sqlalchemy.create_engine(url, poolclass=NullPool, json_deserializer=load_json)
    _configure_sqlite(sync, settings)
    return sync


def _configure_sqlite(sync_engine: sqlalchemy.Engine, settings: _SqliteSettings) -> None:
    """Per-connection pragmas and our own BEGIN, for every connection the engine opens."""
    database, busy_ms, in_memory = settings.database, settings.busy_ms, settings.in_memory
    read_only = settings.read_only

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # We issue BEGIN ourselves (below); pysqlite's implicit transactions would defeat it.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # The busy timeout first: switching to WAL may itself wait for another process's lock.
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        # A new file (no table yet) takes incremental auto_vacuum, so a prune's freed pages can go
        # back to the OS in slices (store.retention); an existing file keeps its mode until a
        # one-time VACUUM converts it (`rollout-ledger prune --convert-vacuum`).
        # Only on an empty file: on one with pages the pragma would want the write lock that
        # another connection (a replay's one transaction) may hold for long.
        if read_only:
            # A reader changes nothing of the file: not its journal mode, not its auto_vacuum.
            cursor.execute("PRAGMA query_only = ON")
        elif not in_memory:
            try:  # the first read of the file: on a read-only filesystem, this is what fails
                cursor.execute("PRAGMA page_count")
                if not cursor.fetchone()[0]:
                    cursor.execute("PRAGMA auto_vacuum = INCREMENTAL")
                _enable_wal(cursor, busy_ms)
            except sqlite3.OperationalError as error:
                problem = _unwritable(database)  # type: ignore[arg-type]
                if problem is None:
                    raise
                raise StoreError(
                    f"cannot open SQLite database {database}: {problem}, and a WAL database needs to create its "
                    f"-wal and -shm files beside it ({error}). To read it without writing, open "
                    f"sqlite+aiosqlite:///file:{database}?immutable=1&uri=true; to write, move it somewhere writable"
                ) from None
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        if conn.get_execution_options().get(WRITE_LOCK):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")
