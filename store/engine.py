"""Engine set-up: URL normalisation and the per-backend settings the event store relies on.

SQLite: WAL (readers never block the writer), a busy timeout, `synchronous=NORMAL` (durable
across process crashes; an OS crash may lose the last commits but never corrupts), and
transactions begun by us rather than by pysqlite so that writers can take the write lock up
front (`BEGIN IMMEDIATE`) and check versions without racing another process.

The busy timeout is how long one statement waits for another process's write lock before
SQLite reports `database is locked`; appends retry that a few times with backoff
(`store.retry.retry_transient`), so the whole budget is about `RETRY_ATTEMPTS` times the
busy timeout. Set it with `create_engine(url, sqlite_busy_timeout=SECONDS)` (and so
`Ledger.open(url, sqlite_busy_timeout=SECONDS)`). A read-only SQLite file opens with
`?mode=ro&uri=true` on a `file:` URL: `sqlite+aiosqlite:///file:/path/ledger.db?mode=ro&uri=true`.

Connecting to a SQLite file creates it if it is missing and switches it to WAL, which a reader must
not do to a mistyped path or another application's file: `create_engine(url, require_ledger=True)`
first checks, reading only, that the file is a rollout-ledger database at head (see
`require_ledger_file`), and raises `SchemaError` saying what it found otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import sqlalchemy
import sqlalchemy.exc
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool, StaticPool

from store.errors import StoreError

DEFAULT_URL = "sqlite+aiosqlite:///rollouts.db"
ENV_VAR = "ROLLOUT_LEDGER_DB"

#: Execution option a connection sets to begin its transactions with the write lock held.
WRITE_LOCK = "rollout_ledger_write"

SQLITE_BUSY_TIMEOUT_MS = 30_000


class StoredJSONError(StoreError, ValueError):
    """A JSON column holds text that is not JSON: the database was altered outside the library.

    SQLite stores JSON as text, so a hand edit can leave it malformed (PostgreSQL's JSONB refuses
    such a write). Raised on read instead of a bare `JSONDecodeError`; a `ValueError`, so replay
    and audit treat it as a damaged log.
    """


def load_json(text: str | bytes) -> object:
    """`json.loads` for stored JSON columns, with an error that says what is wrong and what to do."""
    try:
        return json.loads(text)
    except ValueError as error:
        excerpt = text[:80] if isinstance(text, (str, bytes)) else text
        where = f" at char {error.pos}" if isinstance(error, json.JSONDecodeError) else ""
        raise StoredJSONError(
            f"stored JSON is malformed ({getattr(error, 'msg', error)}{where}): {excerpt!r}; the database was "
            "altered outside rollout-ledger — run `rollout-ledger audit` and restore the row from a backup"
        ) from None


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


def create_engine(
    url: str | os.PathLike[str] | None = None,
    *,
    sqlite_busy_timeout: float | None = None,
    require_ledger: bool = False,
    **kwargs: Any,
) -> AsyncEngine:
    """Create an async engine with the settings the ledger depends on.

    `sqlite_busy_timeout` (seconds, SQLite only; default 30) bounds each wait for another
    process's write lock. `require_ledger` (SQLite: checked here, before any connection;
    PostgreSQL: `check_schema` does it, connecting changes nothing there) refuses a file that is
    missing, empty, not a ledger or not at head, so that opening it writes nothing.
    """
    text = normalize_url(url)
    parsed = make_url(text)
    if parsed.get_backend_name() == "sqlite":
        database = sqlite_file(parsed)
        if (
            require_ledger
            and database
            and database != ":memory:"
            and parsed.query.get("mode") != "memory"
        ):
            require_ledger_file(database)
        return _sqlite_engine(text, parsed, busy_timeout=sqlite_busy_timeout, **kwargs)
    if sqlite_busy_timeout is not None:
        raise ValueError(
            "sqlite_busy_timeout applies to SQLite databases only (PostgreSQL appends use a lock timeout)"
        )
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(text, **kwargs)


def _busy_timeout_ms(seconds: float | None) -> int:
    if seconds is None:
        return SQLITE_BUSY_TIMEOUT_MS
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not 0 <= seconds < 2**31 / 1000
    ):
        raise ValueError(f"sqlite_busy_timeout must be a number of seconds >= 0, got {seconds!r}")
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


#: The first 16 bytes of every SQLite database file.
SQLITE_HEADER = b"SQLite format 3\x00"


def require_ledger_file(database: str) -> None:
    """Raise SchemaError unless `database` is an existing rollout-ledger SQLite file at head.

    Reads only: the file is opened read-only (`mode=ro`, or `immutable=1` when nothing has it open),
    so a missing path is not created, and another application's file is neither migrated nor
    switched to WAL.
    """
    from store.errors import SchemaError
    from store.schema.migrate import read_state, schema_problem

    path = Path(database).expanduser()
    where, target = f"SQLite file {database}", shlex.quote(database)
    create = f"`rollout-ledger demo --db {target}` or `rollout-ledger migrate --db {target}`"
    if path.is_dir():
        raise SchemaError(
            f"{database} is a directory, not a SQLite file: pass a file path such as "
            f"{os.path.join(database, 'rollouts.db')}"
        )
    if not path.exists():
        raise SchemaError(
            f"no SQLite file {database}: check --db (is the path mistyped?); this command "
            f"never creates a database — {create} creates a ledger there"
        )
    if not os.access(path, os.R_OK):
        raise SchemaError(
            f"permission denied: this process may not read the SQLite file {database}; "
            "check its owner and mode"
        )
    with open(path, "rb") as file:
        header = file.read(len(SQLITE_HEADER))
    wal = Path(f"{path}-wal")
    if not header and not (wal.exists() and wal.stat().st_size):
        raise SchemaError(
            f"{where} is empty (0 bytes), not a rollout-ledger database: check --db, or run {create} "
            "to make it one"
        )
    if header and header != SQLITE_HEADER:
        raise SchemaError(
            f"{database} is not a database (not a SQLite file: it starts with bytes {header[:8].hex()}, "
            "not 'SQLite format 3'): point --db at a rollout-ledger database, or restore it from a backup"
        )
    # Without a -wal or -journal beside it no connection has the file open and it holds every commit,
    # so it is read as immutable: not even the -shm and -wal files a WAL reader creates appear.
    busy = any(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-journal"))
    uri = f"file:{quote(str(path.resolve()))}?{'mode=ro' if busy else 'immutable=1'}"
    sync = sqlalchemy.create_engine(
        "sqlite://", creator=lambda: sqlite3.connect(uri, uri=True), poolclass=NullPool
    )
    try:
        with sync.connect() as conn:
            state = read_state(conn)
    except sqlalchemy.exc.DBAPIError as error:
        raise error.orig from None  # sqlite3's own error ("file is not a database", "malformed", …)
    finally:
        sync.dispose()
    problem = schema_problem(state, where, target)
    if problem:
        raise SchemaError(problem)


#: Each wait for the lock that switching a file to WAL needs (see `_enable_wal`).
_WAL_SWITCH_WAIT_MS = 100


def _sqlite_engine(
    url: str, parsed: Any, *, busy_timeout: float | None = None, **kwargs: Any
) -> AsyncEngine:
    database = sqlite_file(parsed)
    busy_ms = _busy_timeout_ms(busy_timeout)
    in_memory = not database or database == ":memory:" or parsed.query.get("mode") == "memory"
    if in_memory:
        kwargs.setdefault("poolclass", StaticPool)
        kwargs.setdefault("connect_args", {"check_same_thread": False})
    else:
        parent = Path(database).expanduser().resolve().parent
        if not parent.is_dir():
            raise ValueError(
                f"cannot create SQLite database {database!r}: folder {parent} does not exist"
            )
    kwargs.setdefault("json_deserializer", load_json)
    engine = create_async_engine(url, **kwargs)
    settings = _SqliteSettings(url, database, busy_ms, in_memory)
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


#: The settings each SQLite engine made by `create_engine` was opened with.
_SQLITE_SETTINGS: weakref.WeakKeyDictionary[sqlalchemy.Engine, _SqliteSettings] = (
    weakref.WeakKeyDictionary()
)


def sqlite_writer_engine(engine: AsyncEngine) -> sqlalchemy.Engine | None:
    """A synchronous engine on the same SQLite file with the same settings (WAL, busy timeout,
    BEGIN IMMEDIATE under `WRITE_LOCK`), for the append writer's own thread
    (`store.log.sqlite_writer`); None for PostgreSQL, an in-memory database (a second connection
    would see another database) or an engine not made by `create_engine`."""
    settings = _SQLITE_SETTINGS.get(engine.sync_engine)
    if settings is None or settings.in_memory:
        return None
    url = make_url(settings.url).set(drivername="sqlite+pysqlite")
    sync = sqlalchemy.create_engine(url, poolclass=NullPool, json_deserializer=load_json)
    _configure_sqlite(sync, settings)
    return sync


def _configure_sqlite(sync_engine: sqlalchemy.Engine, settings: _SqliteSettings) -> None:
    """Per-connection pragmas and our own BEGIN, for every connection the engine opens."""
    database, busy_ms, in_memory = settings.database, settings.busy_ms, settings.in_memory

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # We issue BEGIN ourselves (below); pysqlite's implicit transactions would defeat it.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # The busy timeout first: switching to WAL may itself wait for another process's lock.
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        if not in_memory:
            try:
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
