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

Row = Sequence[Any]


@contextlib.asynccontextmanager
async def driver_connection(engine: AsyncEngine) -> AsyncIterator[Any]:
    """The driver's connection (aiosqlite or asyncpg) behind a pooled one, with no transaction open."""
    async with engine.connect() as conn:
        raw = await conn.get_raw_connection()
        yield raw.driver_connection


class Reader:
    """Keyset-paged reads of `events` as tuples (`data` as JSON text)."""

    def __init__(self, conn: Any, dialect: str) -> None:
        self.conn = conn
        self.postgres = dialect == "postgresql"

    def _select(self, columns: Sequence[str], up_to: bool) -> str:
        chosen = []
        for name in columns:
            if name == "data" and self.postgres:
                chosen.append("data::text")
            else:
                chosen.append(name)
        mark = (lambda i: f"${i}") if self.postgres else (lambda _i: "?")
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

    async def stream(
        self, sql: str, params: Sequence[Any] = (), *, chunk: int = 5000
    ) -> AsyncIterator[list[Row]]:
        """A query's rows in chunks, from one cursor (PostgreSQL: in a read-only transaction)."""
        if self.postgres:
            async with self.conn.transaction(readonly=True):
                cursor = await self.conn.cursor(sql, *params)
                while records := await cursor.fetch(chunk):
                    yield [tuple(record) for record in records]
            return
        cursor = await self.conn.execute(sql, tuple(params))
        try:
            while rows := await cursor.fetchmany(chunk):
                yield list(rows)
        finally:
            await cursor.close()

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Any query in the backend's own parameter style (`?` for SQLite, `$n` for PostgreSQL)."""
        if self.postgres:
            return [tuple(record) for record in await self.conn.fetch(sql, *params)]
        cursor = await self.conn.execute(sql, tuple(params))
        try:
            return list(await cursor.fetchall())
        finally:
            await cursor.close()


@contextlib.asynccontextmanager
async def reader(engine: AsyncEngine) -> AsyncIterator[Reader]:
    async with driver_connection(engine) as conn:
        yield Reader(conn, engine.dialect.name)


class Writer:
    """One write transaction: bulk inserts of tuples, committed by `commit()` or rolled back."""

    def __init__(self, conn: Any, dialect: str) -> None:
        self.conn = conn
        self.postgres = dialect == "postgresql"
        self._transaction: Any = None
        self.open = False

    async def begin(self) -> None:
        if self.postgres:
            self._transaction = self.conn.transaction()
            await self._transaction.start()
        else:
            await self.conn.execute(
                "BEGIN IMMEDIATE"
            )  # the write lock up front, as the projector takes it
        self.open = True

    async def insert(self, table: str, columns: Sequence[str], rows: Sequence[Row]) -> None:
        if not rows:
            return
        if self.postgres:
            await self.conn.copy_records_to_table(table, records=rows, columns=list(columns))
            return
        marks = ", ".join("?" * len(columns))
        await self.conn.executemany(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})", rows
        )

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        """One statement in the backend's own parameter style."""
        if self.postgres:
            await self.conn.execute(sql, *params)
        else:
            cursor = await self.conn.execute(sql, tuple(params))
            await cursor.close()

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """A query inside the transaction, in the backend's own parameter style."""
        return await Reader(self.conn, "postgresql" if self.postgres else "sqlite").fetch(
            sql, params
        )

    async def after_explicit_positions(self, table: str, column: str, last: int) -> None:
        """PostgreSQL: rows inserted with explicit keys bypass the identity; move it past them."""
        if self.postgres:
            await self.conn.execute(
                f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'), $1)", last
            )

    async def commit(self) -> None:
        if self.postgres:
            await self._transaction.commit()
        else:
            await self.conn.execute("COMMIT")
        self.open = False

    async def rollback(self) -> None:
        if not self.open:
            return
        self.open = False
        if self.postgres:
            await self._transaction.rollback()
        else:
            await self.conn.execute("ROLLBACK")


@contextlib.asynccontextmanager
async def writer(engine: AsyncEngine) -> AsyncIterator[Writer]:
    """A write transaction on its own connection; rolled back unless committed."""
    async with driver_connection(engine) as conn:
        write = Writer(conn, engine.dialect.name)
        await write.begin()
        try:
            yield write
        finally:
            await write.rollback()
