"""Key-ordered scans of the read-model tables, as the audit compares two databases.

Both sides must come back in the same key order whatever the backend, so PostgreSQL is told to
sort strings by byte and NULLs first, as SQLite does. Rows travel raw (driver tuples); `typed`
applies SQLAlchemy's own result processors (JSON, datetimes, booleans) to a row that differs raw,
so text that encodes equal values is no divergence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Boolean, DateTime, String
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.types import JSON

from store.dialects import dialect_of
from store.read_models.keys import GROUP_KEY
from store.schema.tables import groups, metric_counts, projection_errors, queue_rows, sessions

#: Each read model and its natural key, in the order the audit compares them. Every column is
#: compared, `queue_rows.id` included: the projector numbers queue rows itself, so a replay must
#: reproduce the numbers.
READ_MODEL_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sessions", ("session_id",)),
    ("groups", GROUP_KEY),
    ("metric_counts", ("run", "partition", "global_step", "data_source", "metric")),
    ("queue_rows", ("run", "partition", "global_step", "key")),
    ("projection_errors", ("position",)),
)
_TABLES = {t.name: t for t in (sessions, groups, metric_counts, queue_rows, projection_errors)}


@dataclass(frozen=True)
class TableScan:
    table: str
    columns: tuple[str, ...]
    keys: tuple[str, ...]
    processors: tuple[Callable[[Any], Any] | None, ...]
    sql: str

    def typed(self, row: Sequence[Any]) -> dict[str, Any]:
        return {
            c: (p(v) if p is not None and v is not None else v)
            for c, p, v in zip(self.columns, self.processors, row)
        }


def scan(engine: AsyncEngine, table_name: str, keys: Sequence[str]) -> TableScan:
    """The whole table in key order, NULLs first, strings by code point (= UTF-8 bytes)."""
    table = _TABLES[table_name]
    dialect = engine.dialect
    ours = dialect_of(engine)
    columns = tuple(c.name for c in table.c)
    processors = tuple(
        c.type.dialect_impl(dialect).result_processor(dialect, None)
        if isinstance(c.type, (JSON, DateTime, Boolean))
        else None
        for c in table.c
    )
    order = [ours.key_order(name, isinstance(table.c[name].type, String)) for name in keys]
    sql = f"SELECT {', '.join(columns)} FROM {table.name} ORDER BY {', '.join(order)}"
    return TableScan(table.name, columns, tuple(keys), processors, sql)
