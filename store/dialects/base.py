"""What a backend must answer, asked by the rest of `store` instead of branching on its name.

One subclass per database (`sqlite.py`, `postgresql.py`, as Alembic's `ddl/` has one module per
dialect); `store.dialects.dialect_of` picks the instance for an engine, a connection or a URL.
Each question is one concern: lock statements, parameter marks, SQL forms, connection settings,
the lease clock, the `sql` verb's read-only guard, the driver-level calls of bulk I/O and of the
append's insert, and what the driver's errors look like (transient or not, what to tell a user).
Only `store/dialects/` knows a driver by name (tests/store/test_dialect_boundary.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import sqlalchemy
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store.errors import StoreInputError

__all__ = ["WRITE_LOCK", "Dialect", "DriverCalls", "Row"]

#: Execution option a connection sets to begin its transactions with the write lock held (SQLite:
#: `BEGIN IMMEDIATE`; PostgreSQL serialises writers with explicit locks and ignores it).
WRITE_LOCK = "rollout_ledger_write"

Row = Sequence[Any]


class DriverCalls(ABC):
    """The driver's own API (aiosqlite or asyncpg) for bulk work: plain tuples in and out, SQL in
    the backend's parameter style, no SQLAlchemy row or bind processing (`store.bulk.driver`)."""

    @abstractmethod
    async def fetch(self, conn: Any, sql: str, params: Sequence[Any]) -> list[Row]: ...

    @abstractmethod
    def stream(
        self, conn: Any, sql: str, params: Sequence[Any], chunk: int
    ) -> AsyncIterator[list[Row]]:
        """A query's rows in chunks, from one cursor (an async generator: closing it closes the
        cursor)."""

    @abstractmethod
    async def execute(self, conn: Any, sql: str, params: Sequence[Any]) -> None: ...

    @abstractmethod
    async def begin(self, conn: Any) -> Any:
        """Open a write transaction; returns what `commit` and `rollback` need."""

    @abstractmethod
    async def commit(self, conn: Any, transaction: Any) -> None: ...

    @abstractmethod
    async def rollback(self, conn: Any, transaction: Any) -> None: ...

    @abstractmethod
    async def insert(
        self, conn: Any, table: str, columns: Sequence[str], rows: Sequence[Row]
    ) -> None:
        """Rows (tuples in `columns` order) into `table`, in the open transaction."""

    async def after_explicit_keys(self, conn: Any, table: str, column: str, last: int) -> None:
        """Rows inserted with explicit keys: move the table's key generator past `last` (nothing
        to do where the next key is taken from the table's largest)."""
        return None


class Dialect(ABC):
    """One backend's answers. Subclasses set the class attributes and override the methods."""

    #: SQLAlchemy's backend name (`engine.dialect.name`, `URL.get_backend_name()`).
    name: str = ""
    #: The async driver `normalize_url` maps any driver of this backend to.
    async_driver: str = ""
    #: Alembic: alter tables by copying them (`render_as_batch`), for a backend without ALTER.
    alembic_batch: bool = False
    #: The statement that serialises projector pages inside their transaction, or None where the
    #: page transaction's own BEGIN takes the lock (`WRITE_LOCK`).
    page_lock_sql: str | None = None
    #: The statement that serialises concurrent migrators, or None (the BEGIN takes the lock).
    migration_lock_sql: str | None = None
    #: Statements run first in an append transaction so positions become visible in commit order.
    append_lock_sql: tuple[str, ...] = ()
    #: Appends build and encode every row before taking the append lock and insert them with one
    #: statement under it (a lock other writer processes wait on, so it is held for as little as
    #: the contract allows), rather than deciding and inserting row by row inside the transaction.
    append_rows_before_lock: bool = False
    #: The ledger copies a live database itself (`store.backup`, with `copy_live`); False where
    #: the backend's own tools do it (docs/operations.md), which `backup_tools` names.
    online_backup: bool = False
    #: How a ledger of this backend is backed up when `online_backup` is False.
    backup_tools: str = ""
    #: Followers' leader election (a lock held by the leader's session), or None: every follower
    #: leads (one file on one host: the page lock alone serialises them).
    try_leader_sql: str | None = None
    release_leader_sql: str | None = None
    #: The driver-level calls of bulk I/O (each subclass sets its driver's).
    driver: DriverCalls
    #: The driver's top-level modules. An error whose class one of them defines is the driver's
    #: own (`owns`, judged by name so the driver need not be installed or imported), and no
    #: module outside `store/dialects/` imports or names them.
    driver_modules: tuple[str, ...] = ()
    #: (what the driver is, the extra that installs it), for a driver the package does not
    #: always install: the CLI's advice when one of `driver_modules` is missing.
    driver_install: tuple[str, str] | None = None
    #: Lower-case fragments of the driver's messages, by what they mean. A connection that broke
    #: under a statement (whatever was in flight on it may have committed):
    connection_lost_texts: tuple[str, ...] = ()
    #: a lock not had in time (the statement was refused, nothing of it committed):
    lock_timeout_texts: tuple[str, ...] = ()
    #: a full disk:
    disk_full_texts: tuple[str, ...] = ()
    #: and what the CLI's hints (`describe_error`) recognise.
    hint_texts: tuple[str, ...] = ()
    #: SQLSTATE (or its two-character class) -> the CLI's advice, for a driver whose errors
    #: carry one (`describe_error`).
    sqlstate_hints: Mapping[str, str] = MappingProxyType({})

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    # ------------------------------------------------------------------ SQL forms
    @abstractmethod
    def mark(self, index: int) -> str:
        """The driver's parameter mark for the `index`-th (1-based) parameter."""

    def json_text(self, column: str) -> str:
        """A JSON column read as its text (what bulk reads hand on without decoding)."""
        return column

    def member_of(self, column: Any, values: list[Any]) -> Any:
        """`column IN (values)`, in the form the backend plans best."""
        return column.in_(values)

    @abstractmethod
    def upsert(self, table: Any) -> Any:
        """An INSERT construct with `on_conflict_do_update` and `returning`."""

    def timestamp_param(self, value: datetime) -> Any:
        """A UTC datetime as the driver-level insert binds it."""
        return value

    def key_order(self, column: str, textual: bool) -> str:
        """An ORDER BY term that sorts NULLs first and text by code point, as every backend must
        for two databases' scans to come back in the same order."""
        return column

    @abstractmethod
    async def lease_now(self, conn: AsyncConnection) -> datetime:
        """The clock queue leases are measured by."""

    # ------------------------------------------------------------------ the `sql` verb
    @abstractmethod
    async def start_read_only(self, conn: AsyncConnection, timeout: float | None) -> None:
        """Make `conn`'s next statements read-only, stopped after `timeout` seconds (None: never)."""

    async def end_read_only(self, conn: AsyncConnection, timeout: float | None) -> None:
        """Undo `start_read_only` before the connection goes back to the pool (nothing to do where
        it ends with the transaction)."""
        return None

    # ------------------------------------------------------------------ engines and URLs
    @abstractmethod
    def create_engine(
        self,
        url: str,
        parsed: URL,
        *,
        sqlite_busy_timeout: float | None,
        read_only: bool = False,
        **kwargs: Any,
    ) -> AsyncEngine:
        """An async engine on a normalised URL, with the settings the ledger relies on;
        `read_only` for a caller that only reads: its connections change nothing of the database
        by being opened (a file's journal mode) and refuse writes where the backend can."""

    def local_file(self, parsed: URL) -> str | None:
        """The database file a URL opens on this host, checked read-only before any connection
        when the caller requires a ledger; None where connecting alters nothing."""
        return None

    def unreachable_hint(self, parsed: URL) -> str:
        """What to check when connecting to `parsed` found no server (refused, reset, unknown host)."""
        return "is the server running, and reachable from this host at the URL's host and port?"

    @abstractmethod
    def describe(self, parsed: URL) -> tuple[str, str]:
        """How to name the database in a message, and the `--db` value that reaches it."""

    def append_thread_engine(self, engine: AsyncEngine) -> sqlalchemy.Engine | None:
        """A synchronous engine whose own thread runs the group commits, or None (appends run on
        the async engine's connection)."""
        return None

    @abstractmethod
    async def bytes_in_use(self, conn: AsyncConnection) -> int:
        """The database's size in bytes as a retention budget counts it (space in use)."""

    async def auto_vacuum_mode(self, conn: AsyncConnection) -> str | None:
        """How freed pages go back to the OS (SQLite's `auto_vacuum`: none / full /
        incremental), or None where the backend's own vacuum reclaims space."""
        return None

    def attachable_file(self, url: URL) -> str | None:
        """The file another database of this backend may ATTACH to copy from, or None."""
        return None

    def copy_live(
        self,
        source: Path,
        target: Path,
        *,
        pages: int,
        progress: Callable[[int, int, int], None],
    ) -> None:
        """Copy the live database file `source` into the new file `target` as one snapshot,
        `pages` at a time, calling `progress(status, remaining, total)` after each slice (for
        `online_backup`; the caller checks that first)."""
        raise StoreInputError(f"backup copies no {self.name} database; {self.backup_tools}")

    # ------------------------------------------------------------------ the append's insert
    def append_insert(self, columns: tuple[str, ...]) -> str | None:
        """One driver-level statement inserting a group commit's rows (built before the append
        lock, `append_rows_before_lock`) with `append_params(rows)` as its parameters, positions
        in row order; None: the events insert SQLAlchemy compiles, one parameter tuple per row."""
        return None

    def append_params(self, rows: Sequence[Row]) -> Any:
        """Row tuples (in `columns` order) as the parameters `append_insert` binds."""
        return list(rows)

    # ------------------------------------------------------------------ the driver's errors
    def owns(self, error: BaseException) -> bool:
        """Whether `error` is one of the driver's own errors (not SQLAlchemy's wrapper of one)."""
        return type(error).__module__.split(".")[0] in self.driver_modules

    def connection_lost(self, error: BaseException) -> bool:
        """The connection broke under the statement (SQLAlchemy saw it invalidated, or the
        driver's message says so): unlike a refused lock, a commit in flight may have landed."""
        if isinstance(error, DBAPIError) and error.connection_invalidated:
            return not isinstance(error, IntegrityError)
        return _says(error, self.connection_lost_texts)

    def is_transient(self, error: BaseException) -> bool:
        """Worth retrying: the connection dropped, or a lock could not be had in time."""
        return self.connection_lost(error) or _says(error, self.lock_timeout_texts)

    def disk_full(self, message: str) -> bool:
        """Whether a driver's message says the disk is full."""
        lowered = message.lower()
        return any(text in lowered for text in self.disk_full_texts)

    def describe_error(
        self, error: BaseException | None, message: str, where: str, urls: Sequence[URL]
    ) -> str | None:
        """The CLI's one line for a driver error whose first line is `message`, naming the
        database as `where` (`urls`: the verb's databases of this backend); None where this
        backend has nothing to add."""
        return None

    def error_texts(self) -> frozenset[str]:
        """Every message fragment this dialect declares, for the boundary scan to keep inside
        `store/dialects/` (tests/store/test_dialect_boundary.py)."""
        return frozenset(
            self.connection_lost_texts
            + self.lock_timeout_texts
            + self.disk_full_texts
            + self.hint_texts
        )


def _says(error: BaseException, texts: tuple[str, ...]) -> bool:
    """A SQLAlchemy-wrapped driver error (an integrity error never counts) whose message holds
    one of `texts`."""
    if not texts or not isinstance(error, DBAPIError) or isinstance(error, IntegrityError):
        return False
    message = str(error.orig).lower()
    return any(text in message for text in texts)
