"""Driver-level access for bulk work: plain tuples in and out, no SQLAlchemy row or bind processing.

Replay and audit move whole tables; per row, SQLAlchemy's result and parameter processing costs
more than the database does. These helpers borrow a pooled connection and talk to its driver
(aiosqlite or asyncpg) through the driver's public API: keyset pages of tuples, `executemany`
on SQLite, `COPY` on PostgreSQL. JSON columns travel as text: `data` is read with `::text` on
PostgreSQL, and JSON values to write are passed as already-serialised text (the asyncpg codec
SQLAlchemy installs takes text for `jsonb`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from store.dialects import Dialect, dialect_of
from store.dialects.base import Row

__all__ = ["Reader", "Row", "Writer", "driver_connection", "reader", "writer"]


@contextlib.asynccontextmanager
async def driver_connection(engine: AsyncEngine) -> AsyncIterator[Any]:
    """The driver's connection (aiosqlite or asyncpg) behind a pooled one, with no transaction open."""
    async with engine.connect() as conn:
        raw = await conn.get_raw_connection()
        yield raw.driver_connection


class Reader:
    """Keyset-paged reads of `events` as tuples (`data` as JSON text)."""

    def __init__(self, conn: Any, dialect: Dialect | str) -> None:
        self.conn = conn
        self.dialect = dialect_of(dialect)
        self._calls = self.dialect.driver

    def _select(self, columns: Sequence[str], up_to: bool) -> str:
        mark = self.dialect.mark
        chosen = [self.dialect.json_text(name) if name == "data" else name for name in columns]
        where = f"position > {mark(1)}" + (f" AND position <= {mark(2)}" if up_to else "")
        limit = mark(3 if up_to else 2)
        return (
            f"SELECT {', '.join(chosen)} FROM events WHERE {where} ORDER BY position LIMIT {limit}"
        )

    async def events_page(
        self, columns: Sequence[str], *, after: int, limit: int, up_to: int | None = None
    ) -> list[Row]:
        """Up to `limit` events after position `after` (and at or before `up_to`), in position order.

        `columns` (names or SQL expressions) must start with `position`.
        """
        params = (after, limit) if up_to is None else (after, up_to, limit)
        return await self.fetch(self._select(columns, up_to is not None), params)

    def stream(
        self, sql: str, params: Sequence[Any] = (), *, chunk: int = 5000
    ) -> AsyncIterator[list[Row]]:
        """A query's rows in chunks, from one cursor (PostgreSQL: in a read-only transaction);
        the driver's own async generator, so closing it closes the cursor."""
        return self._calls.stream(self.conn, sql, params, chunk)

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Any query in the backend's own parameter style (`self.dialect.mark`)."""
        return await self._calls.fetch(self.conn, sql, params)


@contextlib.asynccontextmanager
async def reader(engine: AsyncEngine) -> AsyncIterator[Reader]:
    async with driver_connection(engine) as conn:
        yield Reader(conn, dialect_of(engine))


class Writer:
    """One write transaction: bulk inserts of tuples, committed by `commit()` or rolled back."""

    def __init__(self, conn: Any, dialect: Dialect | str) -> None:
        self.conn = conn
        self.dialect = dialect_of(dialect)
        self._calls = self.dialect.driver
        self._transaction: Any = None
        self.open = False

    async def begin(self) -> None:
        """Open the transaction (SQLite: with the write lock up front, as the projector takes it)."""
        self._transaction = await self._calls.begin(self.conn)
        self.open = True

    async def insert(self, table: str, columns: Sequence[str], rows: Sequence[Row]) -> None:
        """`executemany` on SQLite, `COPY` on PostgreSQL."""
        if rows:
            await self._calls.insert(self.conn, table, columns, rows)

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        """One statement in the backend's own parameter style."""
        await self._calls.execute(self.conn, sql, params)

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """A query inside the transaction, in the backend's own parameter style."""
        return await self._calls.fetch(self.conn, sql, params)

    async def after_explicit_positions(self, table: str, column: str, last: int) -> None:
        """Rows inserted with explicit keys: move the table's identity past them (PostgreSQL)."""
        await self._calls.after_explicit_keys(self.conn, table, column, last)

    async def commit(self) -> None:
        await self._calls.commit(self.conn, self._transaction)
        self.open = False

    async def rollback(self) -> None:
        if not self.open:
            return
        self.open = False
        await self._calls.rollback(self.conn, self._transaction)


@contextlib.asynccontextmanager
async def writer(engine: AsyncEngine) -> AsyncIterator[Writer]:
    """A write transaction on its own connection; rolled back unless committed."""
    async with driver_connection(engine) as conn:
        write = Writer(conn, dialect_of(engine))
        await write.begin()
        try:
            yield write
        finally:
            await write.rollback()
