"""Read-only SQL over the ledger's tables and views: the SQL behind `rollout-ledger sql "SELECT …"`.

It lives in `store` because SQL text and dialect branches do (docs/design.md §10); the CLI only prints
what `run_query` returns.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from store.dialects import dialect_of
from store.errors import LedgerError, StoreError
from store.faults import wraps_faults

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "QueryError",
    "QueryTimeout",
    "WriteRefused",
    "has_separator",
    "projector_lag",
    "run_query",
]

#: `rollout-ledger sql`'s default statement timeout: long enough for any honest read of a ledger.
DEFAULT_TIMEOUT_S = 30.0

_READ_ONLY_START = re.compile(
    r"^\s*(select|with|explain|values|pragma\s+table_info|show)\b", re.IGNORECASE
)
#: First words of statements that change something: these are refused as writes, any other word is a typo.
_WRITES = frozenset(
    "insert update delete drop create alter replace truncate attach detach vacuum reindex grant revoke "
    "pragma begin commit rollback savepoint release copy merge analyze cluster comment lock set reset "
    "call do refresh upsert".split()
)
_DOLLAR_TAG = re.compile(r"\$[A-Za-z_]*\$")


class WriteRefused(LedgerError, ValueError):
    """A statement that would change the database; `sql` only reads."""


class QueryError(StoreError, ValueError):
    """A read-only query that is empty or that the database rejected (its message says why)."""


class QueryTimeout(QueryError):
    """A query stopped by `run_query`'s statement timeout."""


def _code_of(statement: str) -> str:
    """`statement` with quoted text, quoted names, comments and `$tag$` bodies blanked out.

    One pass, each hidden part skipped with `str.find`, so the check costs O(len) however many
    comments or quotes the statement holds (the regular expression it replaces was quadratic on
    comment-heavy text). An unterminated quote or comment hides the rest: the database rejects it.
    """
    out: list[str] = []
    i, n, start = 0, len(statement), 0
    while i < n:
        ch = statement[i]
        if ch in "'\"":
            end = i + 1
            while True:  # '' (or "") inside escapes the quote
                end = statement.find(ch, end)
                if end < 0 or statement[end + 1 : end + 2] != ch:
                    break
                end += 2
            close = n if end < 0 else end + 1
        elif statement.startswith("--", i):
            end = statement.find("\n", i)
            close = n if end < 0 else end
        elif statement.startswith("/*", i):
            end = statement.find("*/", i + 2)
            close = n if end < 0 else end + 2
        elif ch == "$" and (tag := _DOLLAR_TAG.match(statement, i)):
            end = statement.find(tag[0], tag.end())
            close = n if end < 0 else end + len(tag[0])
        else:
            i += 1
            continue
        out.append(statement[start:i])
        out.append(" ")
        i = start = close
    out.append(statement[start:])
    return "".join(out)


def has_separator(statement: str) -> bool:
    """Whether `statement` holds a ';' outside literals, quoted names and comments."""
    return ";" in _code_of(statement)


def check_read_only(statement: str) -> str:
    """The statement without its trailing ';', or WriteRefused / QueryError before it reaches the database."""
    statement = statement.strip().rstrip(";")
    code = _code_of(statement)
    if not code.strip():
        raise QueryError(
            'empty query: pass a SELECT statement, e.g. rollout-ledger sql "SELECT * FROM sessions LIMIT 5"'
        )
    if ";" in code:
        raise WriteRefused("one statement at a time: remove the ';' separators")
    if not _READ_ONLY_START.match(code):
        word = code.split()[0]
        if word.lower() not in _WRITES:
            raise QueryError(
                f"not a query: {word[:40]!r} is not SELECT, WITH, EXPLAIN or VALUES (a typo?)"
            )
        raise WriteRefused(
            f"refused: `sql` runs read-only queries (SELECT / WITH / EXPLAIN), not {word.upper()}; "
            "the read models are rebuilt from events — change the log through the API instead"
        )
    return statement


@wraps_faults("reading the projector's lag")
async def projector_lag(engine: AsyncEngine) -> int:
    """How many events the log holds past the projector's checkpoint (0: the read models are current)."""
    async with engine.connect() as conn:
        result = await conn.execute(
            text(
                "SELECT (SELECT COUNT(*) FROM events WHERE position > "
                "COALESCE((SELECT position FROM checkpoints WHERE name = 'projector'), 0))"
            )
        )
        return int(result.scalar_one() or 0)


def _timed_out(message: str) -> bool:
    lowered = message.lower()
    return (
        "interrupted" in lowered
        or "statement timeout" in lowered
        or "canceling statement" in lowered
    )


@wraps_faults("running the query")
async def run_query(
    engine: AsyncEngine,
    statement: str,
    *,
    limit: int | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one read-only statement; returns (column names, rows).

    Refused before it reaches the database unless it starts like a query; and run inside a
    read-only transaction (PostgreSQL) or with `query_only` on (SQLite), so a write hidden in a
    CTE or function is refused by the database itself. A statement still running after `timeout`
    seconds (None or 0: no limit) is stopped by the database (`statement_timeout`) or by SQLite's
    progress handler, and raises QueryTimeout.
    """
    statement = check_read_only(statement)
    timeout = timeout or None
    async with engine.connect() as conn:
        dialect = dialect_of(conn)
        await dialect.start_read_only(conn, timeout)
        try:
            # Sent as written: text() would read ` :name` inside a literal as a bind parameter.
            result = await conn.exec_driver_sql(statement)
            columns = list(result.keys())
            rows = [tuple(row) for row in (result.fetchmany(limit) if limit else result.fetchall())]
        except DBAPIError as error:
            message = (
                str(error.orig).splitlines()[0] if str(error.orig) else type(error.orig).__name__
            )
            if timeout and _timed_out(message):
                raise QueryTimeout(
                    f"query stopped after the {timeout:g} s statement timeout "
                    "(pass --timeout SECONDS for longer, 0 for none)"
                ) from None
            if (
                "read-only" in message.lower()
                or "readonly" in message.lower()
                or "query_only" in message.lower()
            ):
                raise WriteRefused(f"refused: the statement tries to write ({message})") from None
            raise QueryError(f"query failed: {message}") from None
        finally:
            await dialect.end_read_only(conn, timeout)
            await conn.rollback()
    return columns, rows
