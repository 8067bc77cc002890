"""The projector's driver-level row writes store what SQLAlchemy's own executemany stores.

`store.read_models.row_writes` compiles each statement once and applies the columns' bind
processors itself. Rows are generated from the table declarations (every column's storable
values, `store.schema.columns`), written once through `conn.execute(statement, [dicts])` and
once through `row_writes`, and read back: the two must be equal, on both backends, for inserts
and for updates of generated column sets (groups through their coalesced-step key).
"""

from __future__ import annotations

import asyncio
import string
from datetime import datetime, timezone
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Table, and_, bindparam, select, update

from store import create_engine
from store.read_models import group_update, save_metrics
from store.read_models.keys import GROUP_KEY
from store.read_models.row_writes import insert_rows, update_rows
from store.schema.columns import column_spec
from store.schema.tables import groups, metric_counts, projection_errors, queue_rows, sessions
from tests.conftest import backend_of, wipe

SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
EXAMPLES = {"sqlite": 30, "postgres": 12}
TABLES = [sessions, groups, queue_rows, projection_errors]

#: characters both backends store as text (no lone surrogates, no NUL)
_chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
_text = st.text(_chars, max_size=12)
_finite = st.floats(allow_nan=False, allow_infinity=False)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _finite | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)


def _values(table: Table, name: str) -> st.SearchStrategy[Any]:
    """Any value the column can store, from its declaration."""
    spec = column_spec(f"{table.name}.{name}")
    base = {
        "str": st.text(_chars, max_size=min(spec.max_length or 40, 40)),
        "int": st.integers(*(spec.int_range or (-(2**63), 2**63 - 1))),
        "float": _finite,
        "bool": st.booleans(),
        "json": _json,
        "bytes": st.binary(max_size=16),
        "datetime": st.datetimes(
            datetime(2000, 1, 1), datetime(2100, 1, 1), timezones=st.just(timezone.utc)
        ),
    }[spec.kind]
    return st.none() | base if spec.nullable else base


def _unique_columns(table: Table) -> set[str]:
    """Columns of the primary key and of unique indexes: given distinct values per row."""
    out = {c.name for c in table.primary_key.columns}
    for index in table.indexes:
        if index.unique:
            out |= {c.name for c in index.columns}
    return out


def _distinct(table: Table, name: str, i: int) -> Any:
    kind = column_spec(f"{table.name}.{name}").kind
    return i + 1 if kind == "int" else f"k{i}" + string.ascii_lowercase[i % 26]


@st.composite
def table_rows(draw: Any, table: Table) -> list[dict[str, Any]]:
    unique = _unique_columns(table)
    count = draw(st.integers(1, 6))
    return [
        {
            c.name: _distinct(table, c.name, i)
            if c.name in unique
            else draw(_values(table, c.name))
            for c in table.columns
        }
        for i in range(count)
    ]


@st.composite
def updates(draw: Any, table: Table, rows: list[dict[str, Any]]) -> tuple[list[str], list[dict]]:
    keys = _key_columns(table)
    settable = [c.name for c in table.columns if c.name not in keys]
    columns = draw(st.lists(st.sampled_from(settable), min_size=1, max_size=4, unique=True))
    changed = [
        {**row, **{name: draw(_values(table, name)) for name in columns}}
        for row in draw(st.lists(st.sampled_from(rows), min_size=1, max_size=len(rows)))
    ]
    return columns, changed


def _key_columns(table: Table) -> tuple[str, ...]:
    return GROUP_KEY if table is groups else tuple(c.name for c in table.primary_key.columns)


def _sqlalchemy_update(table: Table, columns: list[str]) -> Any:
    """The update as SQLAlchemy would bind it from dicts (what the projector ran before)."""
    if table is groups:
        return group_update(columns)
    keys = _key_columns(table)
    return (
        update(table)
        .where(and_(*(table.c[k] == bindparam(f"k_{k}") for k in keys)))
        .values({c: bindparam(f"v_{c}") for c in columns})
    )


def _prefixed(table: Table, columns: list[str], row: dict[str, Any]) -> dict[str, Any]:
    return {
        **{f"k_{k}": row[k] for k in _key_columns(table)},
        **{f"v_{c}": row[c] for c in columns},
    }


async def _stored(url: str, table: Table, rows, change, *, driver_level: bool) -> list[tuple]:
    """Wipe, insert `rows`, apply `change`, read the table back in key order."""
    await wipe(url)
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            if driver_level:
                await insert_rows(conn, table, rows)
            else:
                await conn.execute(table.insert(), rows)
            if change is not None:
                columns, changed = change
                if driver_level:
                    build = (lambda: group_update(columns)) if table is groups else None
                    await update_rows(
                        conn, table, _key_columns(table), columns, changed, build=build
                    )
                else:
                    params = [_prefixed(table, columns, row) for row in changed]
                    await conn.execute(_sqlalchemy_update(table, columns), params)
        async with engine.connect() as conn:
            order = [table.c[c.name] for c in table.primary_key.columns] or list(table.c)
            return [tuple(row) for row in await conn.execute(select(table).order_by(*order))]
    finally:
        await engine.dispose()


def test_inserts_and_updates_store_what_sqlalchemy_stores(module_db_url: str) -> None:
    url = module_db_url

    @settings(SETTINGS, max_examples=EXAMPLES[backend_of(url)])
    @given(data=st.data(), table=st.sampled_from(TABLES))
    def same_rows(data: st.DataObject, table: Table) -> None:
        rows = data.draw(table_rows(table))
        change = data.draw(st.none() | updates(table, rows))
        expected = asyncio.run(_stored(url, table, rows, change, driver_level=False))
        found = asyncio.run(_stored(url, table, rows, change, driver_level=True))
        assert found == expected

    same_rows()


def test_metric_upserts_keep_the_last_value_of_each_scope(module_db_url: str) -> None:
    url = module_db_url
    scopes = st.tuples(
        st.sampled_from(["r1", "r2"]),
        st.sampled_from(["train", "val"]),
        st.none() | st.integers(0, 3),
        st.none() | st.sampled_from(["gsm8k", "math"]),
    )
    pages = st.lists(
        st.dictionaries(
            scopes, st.dictionaries(st.sampled_from(["a", "b/c"]), _finite, min_size=1), max_size=4
        ),
        min_size=1,
        max_size=3,
    )

    async def upsert(changes: list[dict]) -> dict[tuple, float]:
        await wipe(url)
        engine = create_engine(url)
        try:
            for changed in changes:
                async with engine.begin() as conn:
                    await save_metrics(conn, changed)
            async with engine.connect() as conn:
                result = await conn.execute(select(metric_counts))
                return {
                    (r.run, r.partition, r.global_step, r.data_source, r.metric): r.value
                    for r in result
                }
        finally:
            await engine.dispose()

    @settings(SETTINGS, max_examples=EXAMPLES[backend_of(url)])
    @given(changes=pages)
    def last_value_wins(changes: list[dict]) -> None:
        expected: dict[tuple, float] = {}
        for changed in changes:
            for scope, values in changed.items():
                for metric, value in values.items():
                    expected[(*scope, metric)] = value
        assert asyncio.run(upsert(changes)) == expected

    last_value_wins()
