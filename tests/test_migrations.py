"""Schema only through Alembic (DESIGN §8): the CLI migrates an empty database on both backends,
the revisions match `store.tables.metadata`, and an unknown revision is refused clearly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from store import SchemaError, create_engine, current_revision, head_revision, upgrade
from store.tables import metadata

ROOT = Path(__file__).resolve().parent.parent
TABLES = {"events", "sessions", "groups", "metric_counts", "queue_rows", "queue_claims", "checkpoints"}


def alembic(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("alembic")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "alembic"]
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    result = subprocess.run(
        [*command, "-c", str(ROOT / "alembic.ini"), "-x", f"db={url}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"alembic {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def _diff(sync_conn) -> list:  # type: ignore[no-untyped-def]
    context = MigrationContext.configure(sync_conn, opts={"compare_type": True, "compare_server_default": True})
    return compare_metadata(context, metadata)


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
        handle = await ledger.create_session("m-1", uid="u", session_index=0, group_size=1, partition="val")
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
            return compare_metadata(MigrationContext.configure(sync_conn), extended)

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
            handle = await ledger.create_session(f"c-{i}", uid="u", session_index=0, group_size=1, partition="val")
            await handle.cancel()

    await asyncio.gather(*(open_and_append(i) for i in range(3)))
    revision, _, diff = await schema_state(db_url)
    assert revision == head_revision() and diff == []
