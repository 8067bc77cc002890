"""Cost curves: the reads whose cost is one step's or one page's stay bounded by it as
the log grows, because the planner takes an index that starts with what they ask for.

Each test runs the store's own function on a migrated database, captures every statement it sends
(with its parameters) and asks the backend for that exact statement's plan:

* SQLite (no statistics: what `Ledger.open` gives): `EXPLAIN QUERY PLAN` must SEARCH the intended
  index with the key columns the query names, never SCAN the table nor take `ix_events_type`
  (the walk over every event of a type that grew with the log).
* PostgreSQL plans by statistics, which a small, empty test table cannot stand in for (its
  planner may take any index there). What the test can honestly hold: with `enable_seqscan = off`
  no sequential scan, and the statement spells the intended index's leading expressions
  (`coalesce(global_step, -1)`, the partial index's literal type, the session IN list), the
  predicate shape that index can serve.

Inputs (how many sessions, uids, scopes, which steps) are generated, so IN lists of more than one
chunk and the NULL step are covered.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event

from store import create_engine, upgrade
from store import read_models as rm
from store.log.append_sql import AppendRequest, GroupSlots
from store.log.records import NewEvent
from store.reads import export_reads
from tests.conftest import backend_of

_SETTINGS = settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
_steps = st.one_of(st.none(), st.integers(0, 10_000))
_partitions = st.sampled_from(["train", "val"])


@pytest.fixture(scope="module")
def migrated(module_db_url: str) -> str:
    async def go() -> None:
        engine = create_engine(module_db_url)
        try:
            await upgrade(engine)
        finally:
            await engine.dispose()

    asyncio.run(go())
    return module_db_url


Call = Callable[[Any], Awaitable[Any]]


async def _plans(url: str, call: Call, table: str) -> list[tuple[str, str]]:
    """(statement, plan text) of every statement `call(conn)` sends that reads `table`."""
    engine = create_engine(url)
    sent: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if f"FROM {table}" in statement and statement.lstrip().upper().startswith("SELECT"):
            sent.append((statement, params))

    try:
        async with engine.connect() as conn:
            event.listen(engine.sync_engine, "before_cursor_execute", capture)
            try:
                await call(conn)
            finally:
                event.remove(engine.sync_engine, "before_cursor_execute", capture)
            out = []
            postgres = conn.dialect.name == "postgresql"
            if postgres:
                await conn.exec_driver_sql("SET enable_seqscan = off")
            for statement, params in sent:
                if postgres:
                    rows = await conn.exec_driver_sql(
                        f"EXPLAIN (FORMAT JSON) {statement}", tuple(params)
                    )
                    value = rows.scalar_one()
                    value = json.loads(value) if isinstance(value, str) else value
                    plan = _pg_nodes(value[0]["Plan"])
                else:
                    rows = await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params)
                    plan = " | ".join(row[-1] for row in rows)
                out.append((statement, plan))
            await conn.rollback()
    finally:
        await engine.dispose()
    assert out, f"the call sent no SELECT from {table}"
    return out


def _pg_nodes(node: dict[str, Any]) -> str:
    """The plan's scans, one `type index: condition` each."""
    parts = []
    if "Scan" in node["Node Type"]:
        parts.append(
            f"{node['Node Type']} {node.get('Index Name', '')}: "
            f"{node.get('Index Cond', '')} {node.get('Recheck Cond', '')}"
        )
    for child in node.get("Plans", ()):
        parts.append(_pg_nodes(child))
    return " | ".join(p for p in parts if p)


def _check(
    url: str,
    plans: list[tuple[str, str]],
    table: str,
    index: str | tuple[str, ...],
    keys: list[str],
    pg_keys: list[str],
) -> None:
    """SQLite: every plan searches `index` (or one of them) with `keys` in its condition, no scan
    of the table, no `ix_events_type`. PostgreSQL: no sequential scan with `enable_seqscan = off`
    and the statement spells `pg_keys`, the intended index's leading expressions (on an empty
    table its statistics-free planner may pick another index; see the module docstring)."""
    indexes = (index,) if isinstance(index, str) else index
    for statement, plan in plans:
        where = f"{statement}\nplan: {plan}"
        if backend_of(url) == "sqlite":
            assert any(name in plan for name in indexes), where
            assert "ix_events_type" not in plan, where
            assert f"SCAN {table}" not in plan, where
            for key in keys:
                assert f"{key}=?" in plan, where
        else:
            assert "Seq Scan" not in plan, where
            for key in pg_keys:
                assert key in statement, where


def _run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- (a) group slots
def _creation(run: str, partition: str, step: int | None, uid: str, index: int) -> AppendRequest:
    creation = NewEvent(
        event_id=f"{uid}-{index}-{step}",
        session_id=f"{uid}-{index}",
        version=1,
        type="SessionCreated",
        schema_version=1,
        run=run,
        uid=uid,
        partition=partition,
        global_step=step,
        data={},
        payload=None,
        recorded_at=datetime.now(timezone.utc),
        slot=(index, 4),
    )
    return AppendRequest(creation.session_id, 0, [creation], future=None)  # type: ignore[arg-type]


@_SETTINGS
@given(
    groups=st.lists(
        st.tuples(_partitions, _steps, st.integers(1, 700)), min_size=1, max_size=3, unique=True
    )
)
def test_group_slots_read_only_the_creations_of_their_groups(
    migrated: str, groups: list[tuple[str, int | None, int]]
) -> None:
    """`GroupSlots.load` per commit batch: was `ix_events_type (type=?)`, every SessionCreated
    of the log; now `uq_events_group_slot` down to the uid (or `ix_events_run_uid`, which SQLite's
    planner takes for a short IN list: bounded by the uids too)."""
    batch = [
        _creation("r", partition, step, f"u{g}", g % 4)
        for partition, step, uids in groups
        for g in range(uids)
    ]
    plans = _run(_plans(migrated, lambda conn: GroupSlots.load(conn, batch), "events"))
    assert len(plans) >= len({(partition, step) for partition, step, _ in groups})
    # the group slot index, or (SQLite, for a few uids) run+uid: either reads only the groups'
    pg_keys = ["events.type = 'SessionCreated'", "coalesce(events.global_step, -1) = "]
    _check(
        migrated,
        plans,
        "events",
        ("uq_events_group_slot", "ix_events_run_uid"),
        ["run", "uid"],
        pg_keys,
    )


# -------------------------------------------------------------------- (b) a page's trajectories
_session_ids = st.integers(1, 1100).map(lambda n: [f"s{i}" for i in range(n)])


@_SETTINGS
@given(session_ids=_session_ids, up_to=st.integers(0, 10**12))
def test_export_trajectories_are_read_by_session(
    migrated: str, session_ids: list[str], up_to: int
) -> None:
    """`export_reads.trajectory_events` (export-dataset's page): was `ix_events_type (type=? AND
    rowid<?)`, every trajectory of the log per page of 500 sessions."""
    plans = _run(
        _plans(
            migrated,
            lambda conn: export_reads.trajectory_events(conn, session_ids, up_to),
            "events",
        )
    )
    _check(
        migrated,
        plans,
        "events",
        "ix_events_session_id_type",
        ["session_id", "type"],
        ["events.session_id IN", "events.type IN"],
    )


@_SETTINGS
@given(session_ids=_session_ids, up_to=st.integers(0, 10**12))
def test_projector_trajectories_are_read_by_session(
    migrated: str, session_ids: list[str], up_to: int
) -> None:
    """`read_models.trajectory_events` (a projector catching up on ending sessions whose
    trajectories it does not hold): the same walk as export's, the same fix."""
    plans = _run(
        _plans(migrated, lambda conn: rm.trajectory_events(conn, session_ids, up_to), "events")
    )
    _check(
        migrated,
        plans,
        "events",
        "ix_events_session_id_type",
        ["session_id", "type"],
        ["events.session_id IN", "events.type IN"],
    )


# -------------------------------------------------------------------------- (c) metrics
@_SETTINGS
@given(partition=_partitions, step=_steps)
def test_metric_rows_of_one_step_search_the_step(
    migrated: str, partition: str, step: int | None
) -> None:
    """`metric_rows` (`Ledger.metrics(partition, step)`): `global_step = ?` cannot be matched to
    the key's `coalesce(global_step, -1)`, so every step of the run was read."""
    plans = _run(
        _plans(
            migrated,
            lambda conn: rm.metric_rows(conn, run="r", partition=partition, global_step=step),
            "metric_counts",
        )
    )
    _check(
        migrated,
        plans,
        "metric_counts",
        "uq_metric_counts_scope",
        ["run", "partition", "<expr>"],
        ["coalesce(metric_counts.global_step, -1) = "],
    )


@_SETTINGS
@given(
    scopes=st.lists(
        st.tuples(st.just("r"), _partitions, _steps, st.sampled_from([None, "math", "code"])),
        min_size=1,
        max_size=6,
        unique=True,
    )
)
def test_projector_metrics_search_their_scopes(
    migrated: str, scopes: list[tuple[str, str, int | None, str | None]]
) -> None:
    """`load_metrics`: the projector's scopes, each by the whole key."""
    plans = _run(_plans(migrated, lambda conn: rm.load_metrics(conn, scopes), "metric_counts"))
    if backend_of(migrated) == "sqlite":
        for statement, plan in plans:  # one SEARCH per OR-ed scope: step and data source too
            assert "<expr>=? AND <expr>=?" in plan, f"{statement}\nplan: {plan}"
    _check(
        migrated,
        plans,
        "metric_counts",
        "uq_metric_counts_scope",
        ["run", "partition"],
        ["coalesce(metric_counts.global_step, -1) = ", "coalesce(metric_counts.data_source, '')"],
    )


# -------------------------------------------------------------------------- (d) groups
@_SETTINGS
@given(
    groups=st.lists(
        st.tuples(_partitions, _steps, st.integers(1, 700)), min_size=1, max_size=3, unique=True
    )
)
def test_projector_groups_search_the_natural_key(
    migrated: str, groups: list[tuple[str, int | None, int]]
) -> None:
    """`load_groups` per page: was `SCAN groups` (no index starts with uid)."""
    keys = [
        ("r", partition, step, f"u{g}") for partition, step, uids in groups for g in range(uids)
    ]
    plans = _run(_plans(migrated, lambda conn: rm.load_groups(conn, keys), "groups"))
    _check(
        migrated,
        plans,
        "groups",
        "uq_groups_key",
        ["run", "partition", "<expr>", "uid"],
        ["coalesce(groups.global_step, -1) = ", "groups.uid IN"],
    )
