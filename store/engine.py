"""Engines: URL normalisation, and an async engine with the settings the ledger relies on.

What a backend's connections are opened with (SQLite: WAL, a busy timeout, our own BEGIN so a
writer can take the write lock up front; PostgreSQL: pre-ping) is its dialect's answer
(`store.dialects`). Set SQLite's busy timeout with `create_engine(url, sqlite_busy_timeout=SECONDS)`
(and so `Ledger.open(url, sqlite_busy_timeout=SECONDS)`). A read-only SQLite file opens with
`?mode=ro&uri=true` on a `file:` URL: `sqlite+aiosqlite:///file:/path/ledger.db?mode=ro&uri=true`.

`create_engine(url, require_ledger=True)` first checks, reading only, that a SQLite file is a
rollout-ledger database at head (`store.schema.ledger_file`), and raises `SchemaError` saying what
it found otherwise; on PostgreSQL connecting changes nothing, and `check_schema` does it.
`create_engine(url, read_only=True)` opens for reading only: a SQLite file is not switched to WAL.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from store.dialects import describe_error, dialect_of, find_dialect
from store.errors import StoreInputError
from store.schema.ledger_file import require_ledger_file

__all__ = [
    "DEFAULT_URL",
    "ENV_VAR",
    "create_engine",
    "describe_database",
    "describe_driver_error",
    "normalize_url",
]

DEFAULT_URL = "sqlite+aiosqlite:///rollouts.db"
ENV_VAR = "ROLLOUT_LEDGER_DB"


def _default_url() -> str:
    """`ROLLOUT_LEDGER_DB` if set, else a SQLite file in the working directory."""
    return os.environ.get(ENV_VAR) or DEFAULT_URL


def normalize_url(url: str | os.PathLike[str] | None) -> str:
    """Accept a SQLAlchemy URL, a bare file path (SQLite) or None (the default).

    Sync driver names are mapped to their async counterparts so users can paste the URL they
    already use elsewhere (`postgresql://…`, `sqlite:///…`).
    """
    if url is None:
        url = _default_url()
    text = os.fspath(url)
    if "://" not in text:
        return f"sqlite+aiosqlite:///{Path(text)}"
    try:
        parsed = make_url(text)
    except (ArgumentError, ValueError) as error:
        raise StoreInputError(
            f"cannot parse the database URL {text!r} ({error}): use sqlite+aiosqlite:///FILE, a "
            "bare file path, or postgresql+asyncpg://USER@HOST/DATABASE"
        ) from error
    dialect = find_dialect(parsed.get_backend_name())
    if dialect is None:
        raise StoreInputError(
            f"unsupported database URL {parsed.render_as_string(hide_password=True)!r}: "
            "use sqlite+aiosqlite:///FILE, a bare file path, or postgresql+asyncpg://…"
        )
    if parsed.drivername != dialect.async_driver:
        parsed = parsed.set(drivername=dialect.async_driver)
    return parsed.render_as_string(hide_password=False)


def create_engine(
    url: str | os.PathLike[str] | None = None,
    *,
    sqlite_busy_timeout: float | None = None,
    require_ledger: bool = False,
    read_only: bool = False,
    **kwargs: Any,
) -> AsyncEngine:
    """Create an async engine with the settings the ledger depends on.

    `sqlite_busy_timeout` (seconds, SQLite only; default 30) bounds each wait for another
    process's write lock. `require_ledger` (SQLite: checked here, before any connection;
    PostgreSQL: `check_schema` does it, connecting changes nothing there) refuses a file that is
    missing, empty, not a ledger or not at head, so that opening it writes nothing.
    `read_only` is for a caller that only reads (`audit`, `sql`, `history`, …): a SQLite file
    keeps its journal mode and its bytes (no switch to WAL) and writes are refused.
    """
    text = normalize_url(url)
    parsed = make_url(text)
    dialect = dialect_of(parsed)
    if require_ledger:
        database = dialect.local_file(parsed)
        if database is not None:
            require_ledger_file(database)
    return dialect.create_engine(
        text, parsed, sqlite_busy_timeout=sqlite_busy_timeout, read_only=read_only, **kwargs
    )


def local_database_file(url: str | os.PathLike[str] | None) -> str | None:
    """The file behind a database URL or path (a SQLite file), or None (in memory, a server)."""
    parsed = make_url(normalize_url(url))
    return dialect_of(parsed).local_file(parsed)


def describe_database(url: str | os.PathLike[str] | None) -> str:
    """How a message names the database at `url`: its dialect's words ("SQLite file x.db",
    "PostgreSQL database postgresql://user@host/db", the password hidden)."""
    parsed = make_url(normalize_url(url))
    return dialect_of(parsed).describe(parsed)[0]


def describe_driver_error(
    error: BaseException | None,
    message: str,
    where: str,
    databases: Sequence[str | os.PathLike[str] | None] = (),
) -> str:
    """The CLI's one line for a driver's own error (or the one a SQLAlchemy error wraps) whose
    first line is `message`: what it means for `where` (the databases as the CLI names them) and
    what to do, where a backend's dialect knows (`store.dialects.describe_error`: an error names
    no backend, so each is asked in turn), else `where: message`. `databases` are the URLs the
    verb opened, so that a SQLite file's problem can be told from the file system."""
    urls: list[URL] = []
    for url in databases:
        try:
            urls.append(make_url(normalize_url(url)))
        except (ValueError, SQLAlchemyError):  # StoreInputError is a ValueError
            continue
    return describe_error(error, message, where, urls) or f"{where}: {message}"
