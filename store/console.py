"""Read-only SQL over the ledger's tables and views: the SQL behind `rollout-ledger sql "SELECT …"`.

It lives in `store` because SQL text and dialect branches do (DESIGN §10); the CLI only prints
what `run_query` returns.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from store.errors import LedgerError, StoreError

__all__ = ["QueryError", "WriteRefused", "has_separator", "run_query"]

_READ_ONLY_START = re.compile(r"^\s*(select|with|explain|values|pragma\s+table_info|show)\b", re.IGNORECASE)


class WriteRefused(LedgerError, ValueError):
    """A statement that would change the database; `sql` only reads."""


class QueryError(StoreError, ValueError):
    """A read-only query that is empty or that the database rejected (its message says why)."""


#: What can hide a ';' that separates nothing: quoted text, quoted names, comments, $tag$ bodies.
_NOT_CODE = re.compile(
    r"'(?:[^']|'')*'"  # 'string', '' escapes a quote
    r'|"(?:[^"]|"")*"'  # "identifier"
    r"|--[^\n]*"  # -- line comment
    r"|/\*.*?\*/"  # /* block comment */
    r"|(\$[A-Za-z_]*\$).*?\1",  # PostgreSQL $tag$ ... $tag$
    re.DOTALL,
)


def has_separator(statement: str) -> bool:
    """Whether `statement` holds a ';' outside literals, quoted names and comments."""
    return ";" in _NOT_CODE.sub(" ", statement)


def check_read_only(statement: str) -> str:
    """The statement without its trailing ';', or WriteRefused / QueryError before it reaches the database."""
    statement = statement.strip().rstrip(";")
    if not statement:
        raise QueryError("empty query: pass a SELECT statement, e.g. rollout-ledger sql \"SELECT * FROM sessions LIMIT 5\"")
    if has_separator(statement):
        raise WriteRefused("one statement at a time: remove the ';' separators")
    if not _READ_ONLY_START.match(statement):
        raise WriteRefused(
            f"refused: `sql` runs read-only queries (SELECT / WITH / EXPLAIN), not {statement.split()[0].upper()}; "
            "the read models are rebuilt from events — change the log through the API instead"
        )
    return statement


async def run_query(engine: AsyncEngine, statement: str, *, limit: int | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one read-only statement; returns (column names, rows).

    Refused before it reaches the database unless it starts like a query; and run inside a
    read-only transaction (PostgreSQL) or with `query_only` on (SQLite), so a write hidden in a
    CTE or function is refused by the database itself.
    """
    statement = check_read_only(statement)
    async with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SET TRANSACTION READ ONLY"))
        else:
            await conn.exec_driver_sql("PRAGMA query_only = ON")
        try:
            # Sent as written: text() would read ` :name` inside a literal as a bind parameter.
            result = await conn.exec_driver_sql(statement)
            columns = list(result.keys())
            rows = [tuple(row) for row in (result.fetchmany(limit) if limit else result.fetchall())]
        except DBAPIError as error:
            message = str(error.orig).splitlines()[0]
            if "read-only" in message.lower() or "readonly" in message.lower() or "query_only" in message.lower():
                raise WriteRefused(f"refused: the statement tries to write ({message})") from None
            raise QueryError(f"query failed: {message}") from None
        finally:
            if conn.dialect.name != "postgresql":
                await conn.exec_driver_sql("PRAGMA query_only = OFF")
            await conn.rollback()
    return columns, rows
