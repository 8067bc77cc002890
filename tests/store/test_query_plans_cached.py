"""On PostgreSQL: a statement run many times on one connection is planned for the table
as it is now, not as it was when the connection first ran it.

asyncpg prepares and caches every statement per connection. After five executions PostgreSQL may
keep a generic plan, costed once, and with no fresh statistics (autovacuum off, or a table
growing faster than autoanalyze) it never looks again. On a growing log the projector's
`session_id IN (...)` kept the sequential scan it was given when `sessions` was small: 2 ms became
0.2-2 s a page, and a 10^6-event growth ran at a fifth of its first rate. The ledger's
connections start with `plan_cache_mode = force_custom_plan` (`store/dialects/postgresql.py`).

`pg_prepared_statements` counts, per statement of the connection, the generic and the custom
plans it ran (PostgreSQL 14 and later).

The same missing statistics inflate estimates past `jit_above_cost`, and a 2 ms sweep of open
sessions was JIT-compiled for ~100 ms: the connections also run with `jit = off`, checked on a
connection told to JIT everything (`jit_above_cost = 0`), beside the control with JIT on.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from store import create_engine, upgrade
from store import read_models as rm
from tests.conftest import fresh_database

pytestmark = pytest.mark.postgres

#: More than the five custom plans after which PostgreSQL may switch to a generic one.
RUNS = 8
GROWN = 50_000

_FILL_SESSIONS = """
    INSERT INTO sessions (session_id, run, uid, session_index, group_size, partition, global_step,
                          state, version, num_trajectories, selected_rows, reward_info,
                          placeholder, created_position, created_at)
    SELECT 's' || s, 'r', 'u' || (s / 4), s % 4, 4, 'train', s / 256, 'succeeded', 5, 1, 1, '{}',
           false, s, now()
    FROM generate_series(CAST(:first AS integer), CAST(:last AS integer)) s"""


async def _plan_counts(conn: Any, table: str) -> list[tuple[str, int, int]]:
    """(statement, generic plans, custom plans) of this connection's prepared statements on
    `table` that take parameters (one without any has only the one plan, counted as generic)."""
    rows = await conn.execute(
        text(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE :table"
        ),
        {"table": f"%FROM {table}%"},
    )
    return [tuple(row) for row in rows if "$1" in row.statement]


async def _grow_and_read(
    url: str, count: int, server_settings: dict[str, str] | None
) -> list[tuple[str, int, int]]:
    engine = create_engine(
        url, connect_args={"server_settings": server_settings} if server_settings else {}
    )
    try:
        await upgrade(engine)
        async with engine.connect() as conn:
            await conn.execute(text(_FILL_SESSIONS), {"first": 0, "last": count - 1})
            await conn.commit()
            ids = [f"s{i}" for i in range(count)]
            for _ in range(RUNS):  # long enough for the plan cache to settle on the small table
                await rm.load_sessions(conn, ids)
            await conn.execute(text(_FILL_SESSIONS), {"first": count, "last": GROWN})
            await conn.commit()
            for _ in range(RUNS):
                await rm.load_sessions(conn, ids)
            return await _plan_counts(conn, "sessions")
    finally:
        await engine.dispose()


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(count=st.integers(2, 300))
def test_a_table_that_grew_is_read_through_its_index(count: int) -> None:
    with fresh_database("postgres") as url:
        counts = asyncio.run(_grow_and_read(url, count, None))
    assert [custom for _, _, custom in counts] == [2 * RUNS], counts
    assert [generic for _, generic, _ in counts] == [0], counts


def test_without_custom_plans_the_grown_table_is_scanned() -> None:
    """The hazard itself, on this server: with PostgreSQL's default the cached plan stays generic."""
    with fresh_database("postgres") as url:
        counts = asyncio.run(_grow_and_read(url, 64, {"plan_cache_mode": "auto"}))
    ((_, generic, _),) = counts
    assert generic > RUNS, counts


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=st.lists(st.integers(0, 999), min_size=1, max_size=200, unique=True),
    step=st.integers(0, 3),
)
def test_every_read_is_planned_with_its_values(ids: list[int], step: int) -> None:
    """The store's reads, run more often than the plan cache waits, are custom plans every time."""
    session_ids = [f"s{i}" for i in ids]
    keys = [("r", "train", step, f"u{i // 4}") for i in ids]

    async def reads(conn: Any) -> None:
        for _ in range(RUNS):
            await rm.load_sessions(conn, session_ids)
            await rm.load_groups(conn, keys)
            await rm.trajectory_events(conn, session_ids, 10_000)

    async def check(url: str) -> list[tuple[str, int, int]]:
        engine = create_engine(url)
        try:
            await upgrade(engine)
            async with engine.connect() as conn:
                await conn.execute(text(_FILL_SESSIONS), {"first": 0, "last": 999})
                await reads(conn)
                return await _plan_counts(conn, "")
        finally:
            await engine.dispose()

    with fresh_database("postgres") as url:
        counts = asyncio.run(check(url))
    read = [c for c in counts if "pg_prepared_statements" not in c[0]]
    assert sum(custom for _, _, custom in read) >= 3 * RUNS, counts
    assert [c for c in read if c[1]] == [], counts


async def _jit_of(url: str, server_settings: dict[str, str] | None) -> tuple[bool, bool]:
    """(whether the server can JIT at all, whether a store read was JIT-compiled), on a
    connection told to JIT everything it may (`jit_above_cost = 0`)."""
    engine = create_engine(
        url, connect_args={"server_settings": server_settings} if server_settings else {}
    )
    try:
        await upgrade(engine)
        async with engine.connect() as conn:
            await conn.execute(text(_FILL_SESSIONS), {"first": 0, "last": 999})
            available = bool((await conn.execute(text("SELECT pg_jit_available()"))).scalar())
            await conn.execute(text("SET jit_above_cost = 0"))
            raw = (await conn.get_raw_connection()).driver_connection
            plan = await raw.fetchval(
                "EXPLAIN (ANALYZE, FORMAT JSON) SELECT sessions.session_id, (SELECT "
                "max(events.recorded_at) FROM events WHERE events.session_id = "
                "sessions.session_id) FROM sessions WHERE state IN ('created', 'running')"
            )
            await conn.rollback()
            # the engine's connection decodes JSON; a bare asyncpg one would give the text
            (top,) = json.loads(plan) if isinstance(plan, str) else plan
            return available, "JIT" in top
    finally:
        await engine.dispose()


def test_no_statement_is_jit_compiled() -> None:
    """Unanalysed tables inflate estimates past `jit_above_cost`: a 2 ms sweep took 71 ms,
    most of it compiling. The ledger's connections run with JIT off."""
    with fresh_database("postgres") as url:
        _, jitted = asyncio.run(_jit_of(url, None))
    assert not jitted


def test_with_jit_on_the_same_read_is_compiled() -> None:
    """The control: the check above sees JIT when the server uses it."""
    with fresh_database("postgres") as url:
        available, jitted = asyncio.run(_jit_of(url, {"jit": "on"}))
    if not available:
        pytest.skip("this PostgreSQL server was built without JIT (pg_jit_available() is false)")
    assert jitted
