"""What differs between SQLite and PostgreSQL, answered by one `Dialect` object per backend.

As Alembic's `ddl/` registry: one module per database (`sqlite.py`, `postgresql.py`), each a
subclass of `base.Dialect`, and `dialect_of` picks the instance for an engine, a connection, a
URL or a backend name. Code elsewhere in `store` asks that object (lock statements, parameter
marks, upsert and member-of forms, timestamps, key order, the lease clock, connection settings,
the `sql` verb's read-only guard, driver-level calls, the append's insert, what the driver's
errors mean) and never branches on a backend's name nor names a driver. An error carries no
engine: what it means is asked of every registered dialect in turn (`registered`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import URL, make_url

from store.dialects.base import WRITE_LOCK, Dialect, DriverCalls
from store.errors import StoreInputError

__all__ = [
    "POSTGRES",
    "SQLITE",
    "WRITE_LOCK",
    "Dialect",
    "DriverCalls",
    "describe_error",
    "dialect_of",
    "driver_install_hint",
    "find_dialect",
    "raised_by_driver",
    "registered",
]

#: Every backend the ledger runs on, by SQLAlchemy's backend name, in the order an error is
#: asked about (the first answer wins): the module and class of its dialect. A module is imported
#: when its backend is first asked for, so a command on a SQLite file that does not import the
#: schema (the `sql` verb; the schema's partial indexes name `postgresql_where`) loads nothing of
#: SQLAlchemy's PostgreSQL package (~30-70 ms of a start on 2 cores), nor the reverse.
_MODULES: dict[str, tuple[str, str]] = {
    "sqlite": ("store.dialects.sqlite", "SqliteDialect"),
    "postgresql": ("store.dialects.postgresql", "PostgresDialect"),
}
#: The module-level names of the two instances, loaded on first use (`__getattr__`).
_CONSTANTS = {"SQLITE": "sqlite", "POSTGRES": "postgresql"}
_LOADED: dict[str, Dialect] = {}
if TYPE_CHECKING:
    from store.dialects.postgresql import PostgresDialect
    from store.dialects.sqlite import SqliteDialect

    SQLITE: SqliteDialect
    POSTGRES: PostgresDialect


def _load(name: str) -> Dialect:
    dialect = _LOADED.get(name)
    if dialect is None:
        module, cls = _MODULES[name]
        # setdefault: two threads loading at once still share one instance
        dialect = _LOADED.setdefault(name, getattr(importlib.import_module(module), cls)())
    return dialect


def __getattr__(attribute: str) -> Dialect:
    if attribute in _CONSTANTS:
        return _load(_CONSTANTS[attribute])
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")


def registered() -> tuple[Dialect, ...]:
    """Every backend's dialect, in registration order (this loads every one: asked on an
    error's path, not on a command's)."""
    return tuple(_load(name) for name in _MODULES)


def find_dialect(name: str) -> Dialect | None:
    """The dialect of a SQLAlchemy backend name, or None for a backend the ledger does not run on."""
    return _load(name) if name in _MODULES else None


def dialect_of(bind: Any) -> Dialect:
    """The dialect of an engine or connection (async or not), a URL (text or `URL`), a backend
    name, or a SQLAlchemy dialect. Raises ValueError for a backend the ledger does not run on."""
    if isinstance(bind, Dialect):
        return bind
    if isinstance(bind, str):
        name = bind if bind in _MODULES else make_url(bind).get_backend_name()
    elif isinstance(bind, URL):
        name = bind.get_backend_name()
    elif hasattr(bind, "dialect"):  # engines and connections, async or not
        name = bind.dialect.name
    else:  # a SQLAlchemy dialect
        name = bind.name
    if name not in _MODULES:
        raise StoreInputError(
            f"unsupported database backend {name!r}: rollout-ledger runs on SQLite "
            "(sqlite+aiosqlite:///FILE) and PostgreSQL (postgresql+asyncpg://…)"
        )
    return _load(name)


def raised_by_driver(error: BaseException | None) -> bool:
    """Whether `error` is one of a registered driver's own errors (sqlite3's, asyncpg's), not
    SQLAlchemy's wrapper of one."""
    return error is not None and any(d.owns(error) for d in registered())


def describe_error(
    error: BaseException | None, message: str, where: str, urls: Sequence[URL]
) -> str | None:
    """The line of the dialect whose driver raised `error` (`Dialect.describe_error`) — or, for an
    error no registered driver owns, the first registered dialect's that has one — each shown
    only the `urls` of its own backend; None where none has one. Only the owner is asked about
    its driver's error, so a PostgreSQL error is never read in SQLite's words for a damaged file."""
    cause = getattr(error, "orig", None) or error
    owners = [d for d in registered() if cause is not None and d.owns(cause)]
    for dialect in owners or registered():
        own = [url for url in urls if url.get_backend_name() == dialect.name]
        line = dialect.describe_error(error, message, where, own)
        if line is not None:
            return line
    return None


def driver_install_hint(module: str) -> tuple[str, str] | None:
    """(what the driver is, the extra that installs it) when `module` is a registered driver the
    package does not always install, else None."""
    for dialect in registered():
        if module in dialect.driver_modules and dialect.driver_install is not None:
            return dialect.driver_install
    return None
