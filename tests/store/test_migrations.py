"""Schema only through Alembic (docs/design.md §8): the CLI migrates an empty database on both backends,
the revisions match `store.tables.metadata`, an unknown revision is refused clearly, and
metric_counts is keyed by its natural key (revision 0003) without losing a stored row."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, inspect, text
from sqlalchemy.exc import IntegrityError

from store import SchemaError, create_engine, current_revision, head_revision, upgrade
from store.schema.tables import metadata
from tests import REPO

ROOT = REPO
TABLES = {
    "events",
    "sessions",
    "groups",
    "metric_counts",
    "queue_rows",
    "queue_claims",
    "checkpoints",
}


def alembic(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("alembic")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "alembic"]
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    result = subprocess.run(
        [*command, "-c", str(ROOT / "alembic.ini"), "-x", f"db={url}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (
        f"alembic {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    )
    return result


def _expression_indexes() -> dict[str, tuple[str, bool]]:
    """Indexes of the metadata on expressions (e.g. coalesce over a NULLable key part): name -> (table, unique)."""
    return {
        index.name: (table.name, index.unique)
        for table in metadata.tables.values()
        for index in table.indexes
        if any(not isinstance(e, Column) for e in index.expressions)
    }


def _compare(context: MigrationContext, target: Any) -> list:
    """compare_metadata, minus SQLite's two warnings that it cannot reflect (so cannot compare) our
    expression indexes; `test_every_expression_index_is_created` checks those on both backends."""
    names = "|".join(re.escape(name) for name in _expression_indexes())
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=f"Skipped unsupported reflection of expression-based index ({names})$"
        )
        warnings.filterwarnings(
            "ignore",
            message=f"autogenerate skipping metadata-specified expression-based index '({names})'",
        )
        return compare_metadata(context, target)


def _diff(sync_conn) -> list:  # type: ignore[no-untyped-def]
    context = MigrationContext.configure(
        sync_conn, opts={"compare_type": True, "compare_server_default": True}
    )
    return _compare(context, metadata)


def _tables(sync_conn) -> set[str]:  # type: ignore[no-untyped-def]
    return set(inspect(sync_conn).get_table_names())


async def schema_state(url: str) -> tuple[str | None, set[str], list]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            tables = await conn.run_sync(_tables)
            diff = await conn.run_sync(_diff) if "events" in tables else []
        return await current_revision(engine), tables, diff
    finally:
        await engine.dispose()


def test_the_revisions_read_without_alembic_are_alembics() -> None:
    """store.schema.state reads the history from the revision files' own lines (no Alembic on a
    reader's start-up): every revision and the head must be what Alembic itself finds there."""
    from alembic.script import ScriptDirectory

    from store.schema.migrate import alembic_config
    from store.schema.state import known_revisions

    script = ScriptDirectory.from_config(alembic_config())
    revisions, head = known_revisions()
    assert head == script.get_current_head() == head_revision()
    assert sorted(revisions) == sorted(r.revision for r in script.walk_revisions())


def test_a_reader_checks_the_schema_without_importing_alembic(tmp_path: Path) -> None:
    """A read verb's open (create_engine(require_ledger=True) + check_schema) loads no Alembic."""
    db = tmp_path / "ledger.db"
    probe = (
        "import asyncio, sys\n"
        "from store import check_schema, create_engine, upgrade\n"
        "from sqlalchemy.ext.asyncio import create_async_engine\n"
        "async def main():\n"
        "    e = create_engine(sys.argv[1], require_ledger=True)\n"
        "    await check_schema(e)\n"
        "    await e.dispose()\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))\n"
    )
    made = subprocess.run(
        [
            sys.executable,
            "-c",
            "import asyncio, sys\nfrom store import create_engine, upgrade\n"
            "e = create_engine(sys.argv[1])\nasyncio.run(upgrade(e))\nasyncio.run(e.dispose())",
            str(db),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    done = subprocess.run(
        [sys.executable, "-c", probe, str(db)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


async def test_alembic_cli_upgrades_an_empty_database_without_drift(db_url: str) -> None:
    revision, tables, _ = await schema_state(db_url)
    assert revision is None and not (tables & TABLES)
    alembic(db_url, "upgrade", "head")
    revision, tables, diff = await schema_state(db_url)
    assert revision == head_revision()
    assert TABLES <= tables
    assert diff == [], f"store.tables.metadata and migrations/ disagree: {diff}"
    # the CLI and the library agree: opening the migrated database is a no-op upgrade
    from sessions import Ledger

    async with Ledger.open(db_url) as ledger:
        handle = await ledger.create_session(
            "m-1", uid="u", session_index=0, group_size=1, partition="val"
        )
        await handle.cancel()


async def test_library_upgrade_matches_the_metadata(db_url: str) -> None:
    engine = create_engine(db_url)
    try:
        assert await current_revision(engine) is None
        await upgrade(engine)
        await upgrade(engine)  # idempotent
        assert await current_revision(engine) == head_revision()
        async with engine.connect() as conn:
            assert await conn.run_sync(_diff) == []
            assert TABLES <= await conn.run_sync(_tables)
    finally:
        await engine.dispose()


async def test_metadata_compare_detects_drift(sqlite_url: str) -> None:
    """The drift check is not vacuous: a column the revisions lack shows up in the diff."""
    from sqlalchemy import Column, Integer, MetaData

    engine = create_engine(sqlite_url)
    try:
        await upgrade(engine)
        extended = MetaData()
        for table in metadata.tables.values():
            table.to_metadata(extended)
        extended.tables["events"].append_column(Column("extra_column", Integer, nullable=True))

        def diff(sync_conn):  # type: ignore[no-untyped-def]
            return _compare(MigrationContext.configure(sync_conn), extended)

        async with engine.connect() as conn:
            found = await conn.run_sync(diff)
        assert any(d[0] == "add_column" and d[3].name == "extra_column" for d in found), found
    finally:
        await engine.dispose()


async def _set_revision(url: str, revision: str) -> None:
    engine = create_engine(url)
    try:
        await upgrade(engine)
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    finally:
        await engine.dispose()


async def test_open_refuses_an_unknown_revision(db_url: str) -> None:
    from sessions import Ledger

    await _set_revision(db_url, "9999_from_the_future")
    for migrate in (True, False):
        with pytest.raises(SchemaError) as info:
            async with Ledger.open(db_url, migrate=migrate):
                pytest.fail("opened a database of unknown revision")
        message = str(info.value)
        assert "9999_from_the_future" in message
        assert head_revision() in message and "upgrade" in message
        # and refusing changed nothing
        engine = create_engine(db_url)
        try:
            assert await current_revision(engine) == "9999_from_the_future"
        finally:
            await engine.dispose()


async def test_open_without_migrate_refuses_an_unmigrated_database(db_url: str) -> None:
    from sessions import Ledger

    with pytest.raises(SchemaError, match="migrate"):
        async with Ledger.open(db_url, migrate=False):
            pytest.fail("opened an unmigrated database")
    async with Ledger.open(db_url) as ledger:  # migrate=True (the default) brings it to head
        assert await current_revision(ledger.engine) == head_revision()
    async with Ledger.open(db_url, migrate=False) as ledger:
        assert await ledger.store.last_position() == 0


async def test_concurrent_opens_migrate_once(db_url: str) -> None:
    import asyncio

    from sessions import Ledger

    async def open_and_append(i: int) -> None:
        async with Ledger.open(db_url) as ledger:
            handle = await ledger.create_session(
                f"c-{i}", uid=f"u{i}", session_index=0, group_size=1, partition="val"
            )
            await handle.cancel()

    await asyncio.gather(*(open_and_append(i) for i in range(3)))
    revision, _, diff = await schema_state(db_url)
    assert revision == head_revision() and diff == []


# ------------------------------------------------------------------ metric_counts natural key
METRIC_COLUMNS = ("run", "partition", "global_step", "data_source", "metric", "value")
INSERT_METRIC = text(
    "INSERT INTO metric_counts (run, partition, global_step, data_source, metric, value) "
    "VALUES (:run, :partition, :global_step, :data_source, :metric, :value)"
)
#: One scope per combination of NULL and a value in the two NULLable key columns.
SCOPES = [(None, None), (0, None), (None, "gsm8k"), (0, "gsm8k")]


async def _index_sql(
    conn: Any, name: str = "uq_metric_counts_scope", table: str = "metric_counts"
) -> str | None:
    """The stored definition of an index, from the backend's own catalog (SQLite's reflection skips
    expression indexes)."""
    if conn.dialect.name == "postgresql":
        query = "SELECT indexdef FROM pg_indexes WHERE tablename = :table AND indexname = :name"
    else:
        query = "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = :table AND name = :name"
    return (await conn.execute(text(query), {"table": table, "name": name})).scalar_one_or_none()


async def test_every_expression_index_is_created(db_url: str) -> None:
    """What the drift check cannot see on SQLite: each expression index of the metadata exists after
    migrating, on its table, unique where declared so."""
    expected = _expression_indexes()
    assert "uq_metric_counts_scope" in expected
    engine = create_engine(db_url)
    try:
        await upgrade(engine)
        async with engine.connect() as conn:
            for name, (table, unique) in expected.items():
                definition = await _index_sql(conn, name, table)
                assert definition is not None, f"index {name} on {table} is missing"
                assert ("UNIQUE" in definition.upper()) == bool(unique), definition
    finally:
        await engine.dispose()


async def test_metric_counts_natural_key_refuses_a_second_row_even_with_nulls(db_url: str) -> None:
    engine = create_engine(db_url)
    try:
        await upgrade(engine)
        async with engine.connect() as conn:
            definition = await _index_sql(conn)
            columns = {
                c["name"]
                for c in await conn.run_sync(
                    lambda sync: inspect(sync).get_columns("metric_counts")
                )
            }
        assert definition is not None, "uq_metric_counts_scope is missing"
        assert "UNIQUE" in definition.upper() and definition.lower().count("coalesce") == 2, (
            definition
        )
        assert columns == set(METRIC_COLUMNS), (
            "metric_counts is keyed by its natural key, without a surrogate id"
        )

        rows = [
            {
                "run": "r",
                "partition": "val",
                "global_step": step,
                "data_source": source,
                "metric": "sessions/total",
                "value": float(i),
            }
            for i, (step, source) in enumerate(SCOPES)
        ]
        async with engine.begin() as conn:  # differing only in NULL vs a value: all of them coexist
            for row in rows:
                await conn.execute(INSERT_METRIC, row)
        for row in rows:  # the same key again, NULLs included, is refused
            with pytest.raises(IntegrityError):
                async with engine.begin() as conn:
                    await conn.execute(INSERT_METRIC, {**row, "value": 99.0})
        async with engine.begin() as conn:  # other runs, partitions and metrics are other keys
            for other in ({"run": "r2"}, {"partition": "train"}, {"metric": "sessions/failed"}):
                await conn.execute(INSERT_METRIC, {**rows[0], **other})
        async with engine.connect() as conn:
            stored = sorted(
                tuple(r)
                for r in (await conn.execute(text("SELECT value FROM metric_counts"))).all()
            )
        assert stored == [(0.0,), (0.0,), (0.0,), (0.0,), (1.0,), (2.0,), (3.0,)]
    finally:
        await engine.dispose()


async def _views(conn: Any) -> set[str]:
    return set(await conn.run_sync(lambda sync: inspect(sync).get_view_names()))


async def test_upgrade_from_0002_keeps_every_metric_row(db_url: str) -> None:
    """Rows written at revision 0002 (surrogate ids, any insertion order) survive 0003 value for value.

    0002 had no unique key; a duplicated key (which no release wrote) keeps its newest row, as the
    revision documents.
    """
    rows = [
        {
            "id": 7,
            "run": "r",
            "partition": "val",
            "global_step": None,
            "data_source": None,
            "metric": "reward/mean",
            "value": 0.125,
        },
        {
            "id": 3,
            "run": "r",
            "partition": "val",
            "global_step": 0,
            "data_source": None,
            "metric": "reward/mean",
            "value": -0.5,
        },
        {
            "id": 11,
            "run": "r",
            "partition": "val",
            "global_step": None,
            "data_source": "swe",
            "metric": "reward/mean",
            "value": 1e-300,
        },
        {
            "id": 1,
            "run": "r",
            "partition": "val",
            "global_step": 0,
            "data_source": "swe",
            "metric": "reward/mean",
            "value": 1.0 / 3,
        },
        {
            "id": 2,
            "run": "r",
            "partition": "train",
            "global_step": 2**40,
            "data_source": "gsm8k",
            "metric": "sessions/total",
            "value": 12.0,
        },
        {
            "id": 5,
            "run": "other",
            "partition": "train",
            "global_step": 0,
            "data_source": None,
            "metric": "sessions/failed",
            "value": 0.0,
        },
    ]
    duplicate = [
        {
            "id": 20,
            "run": "d",
            "partition": "val",
            "global_step": None,
            "data_source": None,
            "metric": "sessions/total",
            "value": 1.0,
        },
        {
            "id": 21,
            "run": "d",
            "partition": "val",
            "global_step": None,
            "data_source": None,
            "metric": "sessions/total",
            "value": 2.0,
        },
    ]
    engine = create_engine(db_url)
    try:
        await upgrade(engine, "0002")
        assert await current_revision(engine) == "0002"
        async with engine.begin() as conn:
            views = await _views(conn)
            await conn.execute(
                text(
                    "INSERT INTO metric_counts (id, run, partition, global_step, data_source, metric, value) "
                    "VALUES (:id, :run, :partition, :global_step, :data_source, :metric, :value)"
                ),
                rows + duplicate,
            )
        await upgrade(engine)
        assert await current_revision(engine) == head_revision()
        async with engine.connect() as conn:
            stored = [
                dict(r)
                for r in (
                    await conn.execute(
                        text(f"SELECT {', '.join(METRIC_COLUMNS)} FROM metric_counts")
                    )
                ).mappings()
            ]
            assert views and set(views) <= set(await _views(conn)), (
                "the views 0002 created are there again"
            )
            assert await _index_sql(conn) is not None
        # revision 0005 adds `reward/mean_default_rule` beside each `reward/mean` (equal: nothing was excluded before it)
        copies = {
            (r["run"], r["partition"], r["global_step"], r["data_source"]): r["value"]
            for r in stored
            if r["metric"] == "reward/mean_default_rule"
        }
        assert copies == {
            (r["run"], r["partition"], r["global_step"], r["data_source"]): r["value"]
            for r in stored
            if r["metric"] == "reward/mean"
        }
        stored = [r for r in stored if r["metric"] != "reward/mean_default_rule"]
        key = lambda r: tuple((r[c] is None, r[c] or 0) for c in METRIC_COLUMNS)  # noqa: E731
        want = [{c: r[c] for c in METRIC_COLUMNS} for r in [*rows, duplicate[1]]]
        assert sorted(stored, key=key) == sorted(want, key=key)
    finally:
        await engine.dispose()
