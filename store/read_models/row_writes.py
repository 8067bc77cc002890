"""Read-model rows to the driver: each statement compiled once by SQLAlchemy, each row a tuple.

The projector writes thousands of read-model rows a page. An `execute(statement, [dicts])`
makes SQLAlchemy process every row's parameters in Python (`construct_params`, then a bind
processor per value): the largest Python cost of a page's writes, and without it the projection
benchmark's `Projector.run` is 13% faster (docs/benchmarks.md, section 5). Here each
statement is compiled once per dialect and set of columns, rows become tuples in its parameter
order, and only the values whose type has a bind processor (JSON, floats, SQLite's timestamps) pass
through it: the processors SQLAlchemy itself would apply, so the stored values are the same
(`tests/store/test_row_writes.py` writes generated rows both ways and compares). The statements run
through `exec_driver_sql`: in the caller's transaction, past the engine's cursor events.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from sqlalchemy import Table, and_, bindparam, update
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import ClauseElement

from store.errors import StoreInvariantError

__all__ = ["execute_rows", "insert_rows", "update_rows"]

Row = dict[str, Any]
_Processor = Callable[[Any], Any]


@dataclass(frozen=True)
class Plan:
    """A compiled statement and how a row dict becomes its positional parameters."""

    sql: str
    #: the row key each positional parameter takes its value from
    keys: tuple[str, ...]
    #: (parameter index, processor) for the parameters whose type processes its values
    processors: tuple[tuple[int, _Processor], ...]

    def parameters(self, rows: Sequence[Row]) -> list[tuple[Any, ...]]:
        if len(self.keys) == 1:
            only = self.keys[0]
            tuples = [(row[only],) for row in rows]
        else:
            pick = itemgetter(*self.keys)
            tuples = [pick(row) for row in rows]
        if not self.processors:
            return tuples
        # column by column, so the loops run in C (`zip`, `map`) but for the processors' own
        # calls; None goes through them too (JSON's makes it the text "null")
        columns: list[Any] = list(zip(*tuples))
        for index, process in self.processors:
            columns[index] = map(process, columns[index])
        return list(zip(*columns))


#: Plans per dialect object (an engine's), so a dialect's own settings (its JSON serializer)
#: are the ones compiled in, and a disposed engine's plans go with it.
_PLANS: weakref.WeakKeyDictionary[Dialect, dict[Hashable, Plan]] = weakref.WeakKeyDictionary()


def plan_for(
    dialect: Dialect,
    key: Hashable,
    build: Callable[[], ClauseElement],
    row_key: Callable[[str], str] = str,
    column_keys: Sequence[str] | None = None,
) -> Plan:
    """The plan of the statement `build()` makes, cached under `key` for this dialect.
    `row_key` maps a bind parameter's name to the row key its value comes from; `column_keys`
    are an insert's columns."""
    plans = _PLANS.setdefault(dialect, {})
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _compile(dialect, build(), row_key, column_keys)
    return plan


def _compile(
    dialect: Dialect,
    statement: ClauseElement,
    row_key: Callable[[str], str],
    column_keys: Sequence[str] | None,
) -> Plan:
    compiled = statement.compile(
        dialect=dialect, column_keys=None if column_keys is None else list(column_keys)
    )
    names = compiled.positiontup
    if names is None:
        raise StoreInvariantError(
            f"the {dialect.name} dialect compiled a read-model write with named parameters "
            f"(paramstyle {dialect.paramstyle!r}); this library writes positionally: report it "
            "with the SQLAlchemy and driver versions"
        )
    processors = []
    for index, name in enumerate(names):
        process = compiled.binds[name].type.dialect_impl(dialect).bind_processor(dialect)
        if process is not None:
            processors.append((index, process))
    return Plan(compiled.string, tuple(row_key(name) for name in names), tuple(processors))


async def execute_rows(conn: AsyncConnection, plan: Plan, rows: Sequence[Row]) -> None:
    """Run `plan`'s statement once per row (one `executemany`)."""
    if rows:
        await conn.exec_driver_sql(plan.sql, plan.parameters(rows))


async def insert_rows(conn: AsyncConnection, table: Table, rows: Sequence[Row]) -> None:
    """Insert rows, each with the columns of the first (as `execute(table.insert(), rows)`)."""
    if not rows:
        return
    columns = tuple(c.name for c in table.columns if c.name in rows[0])
    unknown = rows[0].keys() - set(columns)
    if unknown:
        raise StoreInvariantError(
            f"rows for {table.name} name columns it does not have: {sorted(unknown)}"
        )
    plan = plan_for(
        conn.dialect, ("insert", table.name, columns), table.insert, column_keys=columns
    )
    await execute_rows(conn, plan, rows)


def _unprefixed(name: str) -> str:
    """`k_run` / `v_state` -> `run` / `state`: an update's binds name the key and set columns
    apart, since a key column may also be set."""
    return name[2:]


async def update_rows(
    conn: AsyncConnection,
    table: Table,
    keys: Sequence[str],
    columns: Sequence[str],
    rows: Sequence[Row],
    *,
    build: Callable[[], ClauseElement] | None = None,
) -> None:
    """Set `columns` of the rows matched on `keys`: an UPDATE whose binds are `k_<key>` for the
    match and `v_<column>` for the values (a key column may be set too). `build`, if given,
    makes that statement itself (where plain equality on the keys would miss an index)."""

    def by_equality() -> ClauseElement:
        return (
            update(table)
            .where(and_(*(table.c[k] == bindparam(f"k_{k}") for k in keys)))
            .values({c: bindparam(f"v_{c}") for c in columns})
        )

    plan = plan_for(
        conn.dialect,
        ("update", table.name, tuple(keys), tuple(columns)),
        build or by_equality,
        _unprefixed,
    )
    await execute_rows(conn, plan, rows)
