"""PostgreSQL's answers: many writer processes on many hosts, asyncpg for the async engine.

Appends serialise on a table lock so positions become visible in commit order (a tailing reader
never skips an event that commits later, docs/design.md §8), and insert a group commit's rows
with one statement of column arrays; projector pages, migrators and the followers' leader
serialise on advisory locks; lease times come from the server's clock. Errors are judged by
asyncpg's texts and the server's SQLSTATE; a live database is backed up with PostgreSQL's tools.
"""

from __future__ import annotations

import shlex
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from types import MappingProxyType
from typing import Any

from sqlalchemy import String, any_, bindparam, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from store.dialects.base import Dialect, DriverCalls, Row
from store.errors import StoreInputError

__all__ = [
    "DISK_FULL_TEXTS",
    "LOCK_TIMEOUT_TEXTS",
    "PG_LOCK_TIMEOUT",
    "PostgresDialect",
]

#: Advisory lock ids ("RLPR", "RLLD", "RLMI"): one projector page at a time; one leading
#: follower; one migrator (any constants unique to this project).
_PG_PROJECTOR_LOCK = 0x524C5052
_PG_LEADER_LOCK = 0x524C4C44
_PG_MIGRATION_LOCK = 0x524C4D49
#: Give up waiting for the append lock after this long rather than hang forever.
PG_LOCK_TIMEOUT = "10s"

#: Settings every ledger connection starts with (a caller's own `server_settings` win).
#: `plan_cache_mode`: asyncpg prepares and caches each statement per connection; after five runs
#: PostgreSQL keeps a generic plan whose cost it estimated when the table was small, and with
#: no fresh statistics (autovacuum off, or a table growing faster than autoanalyze) it never
#: replans. On a growing log that plan was a sequential scan of `sessions` for the projector's
#: `session_id IN (...)`: 2 ms became 0.2-2 s a page (issue 28). A custom plan per execution
#: costs well under a millisecond here and always sees the table as it is.
#: `jit`: the same missing statistics inflate row estimates past `jit_above_cost`, and PostgreSQL
#: then JIT-compiles a query that runs in a millisecond: `recover`'s sweep of 256 open sessions
#: at 10^6 events took 71 ms (128 ms cold), ~100 ms of it compiling, against 1.5-2 ms without.
#: The ledger's statements are short, and the report's whole-run reads ran no faster with it.
_SERVER_SETTINGS = {"plan_cache_mode": "force_custom_plan", "jit": "off"}

#: Texts of a connection that broke: the server ended it, or asyncpg's protocol was left
#: mid-operation by a dropped connection ("another operation", "cannot switch to state").
_CONNECTION_LOST_TEXTS = (
    "connection was closed",
    "terminating connection",
    "connection is closed",
    "connection refused",
    "server closed the connection",
    "another operation",
    "cannot switch to state",
)
#: Texts of the append lock's `lock_timeout` running out.
LOCK_TIMEOUT_TEXTS = ("lock timeout", "lock_timeout")
#: The server's "could not extend file ...: No space left on device".
DISK_FULL_TEXTS = ("no space left",)

#: SQLSTATE (or its class, two characters) -> what to do.
_SQLSTATE_HINTS = MappingProxyType(
    {
        "3D000": "create it (createdb NAME) or fix the database name in the URL",
        "28000": "check the user name in the URL (and pg_hba.conf)",
        "28P01": "check the user and password in the URL",
        "42P01": "the database lacks a table its schema revision promises, so it was altered outside rollout-ledger — restore it from a backup",
        "42703": "the database lacks a column its schema revision promises, so it was altered outside rollout-ledger — restore it from a backup",
        "53300": "the server has too many connections: close some, or retry later",
        "08": "the connection failed: check the server and run the command again",
        "57": "the server is shutting down or restarting: run the command again once it is up",
        "53": "the server is out of resources (disk or memory): free some and run the command again",
    }
)

#: How a PostgreSQL ledger is backed up (the `backup` verb copies SQLite files only).
_BACKUP_TOOLS = (
    "a PostgreSQL ledger is backed up with PostgreSQL's own tools: "
    "`pg_dump -Fc -f ledger.dump DBNAME` while it runs, and `createdb NEW && "
    "pg_restore -d NEW ledger.dump` to restore (docs/operations.md)"
)

#: The array type each inserted column is bound as (`insert_sql`).
_ARRAY_TYPES = {
    "event_id": "varchar[]",
    "session_id": "varchar[]",
    "version": "integer[]",
    "type": "varchar[]",
    "schema_version": "integer[]",
    "run": "varchar[]",
    "uid": "varchar[]",
    "partition": "varchar[]",
    "global_step": "bigint[]",
    "data": "text[]",
    "payload": "bytea[]",
    "recorded_at": "timestamptz[]",
    "session_index": "integer[]",
    "group_size": "integer[]",
}


def insert_sql(columns: Sequence[str]) -> str:
    """A group commit's rows as one INSERT: one array per column (`_insert_params`), unnested by
    the server in row order, so positions follow the rows. One Bind/Execute whatever the count,
    where `executemany` sends one per row: the insert is what the append lock is held for."""
    arrays = ", ".join(f"${i}::{_ARRAY_TYPES[c]}" for i, c in enumerate(columns, start=1))
    names = ", ".join(columns)
    picked = ", ".join(f"r.{c}::jsonb" if c == "data" else f"r.{c}" for c in columns)
    return (
        f"INSERT INTO events ({names}) SELECT {picked} "
        f"FROM unnest({arrays}) WITH ORDINALITY AS r({names}, n) ORDER BY r.n"
    )


def _insert_params(rows: Sequence[Row]) -> tuple[list[Any], ...]:
    """Row tuples as the column arrays `insert_sql` binds."""
    return tuple(list(column) for column in zip(*rows))


class _AsyncpgCalls(DriverCalls):
    """asyncpg's API: `$n` marks, `COPY` for inserts, transactions as objects."""

    async def fetch(self, conn: Any, sql: str, params: Sequence[Any]) -> list[Row]:
        return [tuple(record) for record in await conn.fetch(sql, *params)]

    async def stream(
        self, conn: Any, sql: str, params: Sequence[Any], chunk: int
    ) -> AsyncIterator[list[Row]]:
        async with conn.transaction(readonly=True):  # asyncpg's cursors live in a transaction
            cursor = await conn.cursor(sql, *params)
            while records := await cursor.fetch(chunk):
                yield [tuple(record) for record in records]

    async def execute(self, conn: Any, sql: str, params: Sequence[Any]) -> None:
        await conn.execute(sql, *params)

    async def begin(self, conn: Any) -> Any:
        transaction = conn.transaction()
        await transaction.start()
        return transaction

    async def commit(self, conn: Any, transaction: Any) -> None:
        await transaction.commit()

    async def rollback(self, conn: Any, transaction: Any) -> None:
        await transaction.rollback()

    async def insert(
        self, conn: Any, table: str, columns: Sequence[str], rows: Sequence[Row]
    ) -> None:
        await conn.copy_records_to_table(table, records=rows, columns=list(columns))

    async def after_explicit_keys(self, conn: Any, table: str, column: str, last: int) -> None:
        # rows inserted with explicit keys bypass the identity: move it past them
        await conn.execute(
            f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'), $1)", last
        )


class PostgresDialect(Dialect):
    name = "postgresql"
    async_driver = "postgresql+asyncpg"
    page_lock_sql = f"SELECT pg_advisory_xact_lock({_PG_PROJECTOR_LOCK})"
    migration_lock_sql = f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})"
    # EXCLUSIVE mode blocks other writers but not readers, for the insert transaction only; the
    # lock timeout turns a stuck writer elsewhere into an error, not a hang.
    append_lock_sql = (
        f"SET LOCAL lock_timeout = '{PG_LOCK_TIMEOUT}'",
        "LOCK TABLE events IN EXCLUSIVE MODE",
    )
    append_rows_before_lock = True
    try_leader_sql = f"SELECT pg_try_advisory_lock({_PG_LEADER_LOCK})"
    release_leader_sql = f"SELECT pg_advisory_unlock({_PG_LEADER_LOCK})"
    backup_tools = _BACKUP_TOOLS
    driver = _AsyncpgCalls()
    driver_modules = ("asyncpg",)  # judged by name: asyncpg need not be installed
    driver_install = ("the PostgreSQL driver asyncpg", "postgres")
    connection_lost_texts = _CONNECTION_LOST_TEXTS
    lock_timeout_texts = LOCK_TIMEOUT_TEXTS
    disk_full_texts = DISK_FULL_TEXTS
    sqlstate_hints = _SQLSTATE_HINTS

    def mark(self, index: int) -> str:
        return f"${index}"

    def append_insert(self, columns: tuple[str, ...]) -> str | None:
        return insert_sql(columns)

    def append_params(self, rows: Sequence[Row]) -> Any:
        return _insert_params(rows)

    def describe_error(
        self, error: BaseException | None, message: str, where: str, urls: Sequence[URL]
    ) -> str | None:
        # asyncpg's errors, and SQLAlchemy's adaptations of them, carry the server's SQLSTATE
        state = str(getattr(error, "sqlstate", "") or "")
        hint = self.sqlstate_hints.get(state) or self.sqlstate_hints.get(state[:2])
        return f"{where}: {message}; {hint}" if hint else None

    def json_text(self, column: str) -> str:
        return f"{column}::text"  # asyncpg would decode jsonb; bulk reads hand the text on

    def member_of(self, column: Any, values: list[Any]) -> Any:
        # `= ANY(array)`: one parameter, one cached plan, whatever the count
        return column == any_(bindparam("members", values, type_=ARRAY(String())))

    def upsert(self, table: Any) -> Any:
        return postgresql.insert(table)

    def key_order(self, column: str, textual: bool) -> str:
        # SQLite's order: strings by byte (= code point in UTF-8), NULLs first
        return f'{column} COLLATE "C" NULLS FIRST' if textual else f"{column} NULLS FIRST"

    async def lease_now(self, conn: AsyncConnection) -> datetime:
        # the server's clock: consumers on hosts with skewed clocks agree
        return (await conn.execute(text("SELECT now()"))).scalar_one()  # type: ignore[no-any-return]

    async def start_read_only(self, conn: AsyncConnection, timeout: float | None) -> None:
        await conn.execute(text("SET TRANSACTION READ ONLY"))
        if timeout:
            await conn.exec_driver_sql(
                f"SET LOCAL statement_timeout = {max(1, int(timeout * 1000))}"
            )

    async def end_read_only(self, conn: AsyncConnection, timeout: float | None) -> None:
        """Nothing to undo: both settings end with the transaction the caller rolls back."""
        return None

    def create_engine(
        self,
        url: str,
        parsed: URL,
        *,
        sqlite_busy_timeout: float | None,
        read_only: bool = False,
        **kwargs: Any,
    ) -> AsyncEngine:
        # `read_only` needs nothing here: connecting to a server changes nothing of the database,
        # and the `sql` verb makes its own statements read-only (`start_read_only`).
        if sqlite_busy_timeout is not None:
            raise StoreInputError(
                "sqlite_busy_timeout applies to SQLite databases only (PostgreSQL appends use a lock timeout)"
            )
        kwargs.setdefault("pool_pre_ping", True)
        connect_args = dict(kwargs.pop("connect_args", None) or {})
        connect_args["server_settings"] = {
            **_SERVER_SETTINGS,
            **(connect_args.get("server_settings") or {}),
        }
        return create_async_engine(url, connect_args=connect_args, **kwargs)

    async def bytes_in_use(self, conn: AsyncConnection) -> int:
        size = await conn.exec_driver_sql("SELECT pg_database_size(current_database())")
        return int(size.scalar_one())

    def unreachable_hint(self, parsed: URL) -> str:
        host, port = parsed.host or "localhost", parsed.port or 5432
        return (
            f"is the server running? Check that PostgreSQL listens on {host}:{port} and accepts "
            f"TCP connections from this host (`pg_isready -h {host} -p {port}`), and that the "
            "host and port in the URL point at it"
        )

    def describe(self, parsed: URL) -> tuple[str, str]:
        # as a user would type it
        shown = parsed.set(drivername="postgresql").render_as_string(hide_password=True)
        return f"PostgreSQL database {shown}", shlex.quote(shown)
