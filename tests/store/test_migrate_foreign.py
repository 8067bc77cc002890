"""`migrate` on a database that is not a ledger yet (docs/design.md §11).

The schema is made in one transaction on both backends: all revisions or none. A database that
holds another application's tables is refused, untouched, unless the caller says to share it
(`--share-database` / `share_database=True`); then the other application's tables and rows stay
as they were. Inputs are generated: the foreign table names, and (for all-or-nothing) which of
the head schema's index names a foreign table takes, so the migration fails at whichever
revision creates that index, after earlier revisions have created tables.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from sessions import Ledger
from sessions.cli.main import main
from store import SchemaError, StoreError, create_engine, current_revision, upgrade
from store.schema.migrate import LEDGER_NAMES, head_revision, read_state
from store.schema.tables import metadata
from tests.conftest import BACKENDS, fresh_database

#: Every index of the head schema: a table of that name makes the revision creating it fail.
INDEX_NAMES = sorted(
    {index.name for table in metadata.tables.values() for index in table.indexes if index.name}
)

foreign_names = st.lists(
    st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True).filter(
        lambda name: name not in LEDGER_NAMES and name not in INDEX_NAMES
    ),
    min_size=1,
    max_size=4,
    unique=True,
)

SETTINGS = settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module", params=BACKENDS)
def backend_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with fresh_database(request.param, tmp_path_factory.mktemp("foreign")) as url:
        yield url


async def _reset(url: str) -> None:
    """Drop everything: each example starts from an empty database."""
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                await conn.execute(text("DROP SCHEMA public CASCADE"))
                await conn.execute(text("CREATE SCHEMA public"))
            else:
                rows = await conn.execute(
                    text("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
                )
                for kind, name in list(rows):
                    if kind in ("table", "view"):
                        await conn.execute(text(f'DROP {kind.upper()} IF EXISTS "{name}"'))
    finally:
        await engine.dispose()


async def _make_foreign(url: str, names: list[str]) -> None:
    await _reset(url)
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            for name in names:
                await conn.execute(
                    text(f'CREATE TABLE "{name}" (id INTEGER PRIMARY KEY, note TEXT)')
                )
                await conn.execute(text(f"INSERT INTO \"{name}\" (id, note) VALUES (7, 'theirs')"))
    finally:
        await engine.dispose()


async def _state(url: str) -> tuple[tuple[str, ...], str | None, dict[str, list]]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            state = await conn.run_sync(read_state)
            rows = {}
            for name in state.tables:
                if name not in LEDGER_NAMES:
                    rows[name] = [
                        tuple(r) for r in await conn.execute(text(f'SELECT * FROM "{name}"'))
                    ]
        return state.tables, state.revision, rows
    finally:
        await engine.dispose()


async def _upgrade(url: str, *, share: bool) -> None:
    engine = create_engine(url)
    try:
        await upgrade(engine, share=share)
    finally:
        await engine.dispose()


@SETTINGS
@given(names=foreign_names)
def test_another_applications_database_is_refused_untouched(
    backend_url: str, names: list[str]
) -> None:
    async def check() -> None:
        await _make_foreign(backend_url, names)
        before = await _state(backend_url)
        with pytest.raises(SchemaError, match="not a rollout-ledger database") as refused:
            await _upgrade(backend_url, share=False)
        assert all(name in str(refused.value) for name in names[:6])
        assert "--share-database" in str(refused.value)
        assert await _state(backend_url) == before

    asyncio.run(check())


@SETTINGS
@given(names=foreign_names)
def test_shared_the_ledger_is_made_beside_their_tables(backend_url: str, names: list[str]) -> None:
    async def check() -> None:
        await _make_foreign(backend_url, names)
        _, _, theirs = await _state(backend_url)
        await _upgrade(backend_url, share=True)
        tables, revision, rows = await _state(backend_url)
        assert revision == head_revision()
        assert set(metadata.tables) <= set(tables)
        assert rows == theirs  # their tables and rows as they were
        await _upgrade(backend_url, share=False)  # a ledger now: no second refusal

    asyncio.run(check())


@SETTINGS
@given(names=foreign_names, taken=st.sampled_from(INDEX_NAMES))
def test_a_migration_failing_midway_leaves_nothing(
    backend_url: str, names: list[str], taken: str
) -> None:
    """Shared, but one foreign table has the name of a ledger index: the revision creating that
    index fails after earlier statements (and revisions) created tables; all of it rolls back."""

    async def check() -> None:
        await _make_foreign(backend_url, [*names, taken])
        before = await _state(backend_url)
        with pytest.raises(StoreError, match=taken):  # the database's refusal, wrapped
            await _upgrade(backend_url, share=True)
        assert await _state(backend_url) == before

    asyncio.run(check())


@pytest.mark.parametrize("clash", sorted(metadata.tables))
def test_a_table_with_a_ledger_tables_name_is_refused_before_anything_runs(
    backend_url: str, clash: str
) -> None:
    async def check() -> None:
        await _make_foreign(backend_url, [clash])
        before = await _state(backend_url)
        with pytest.raises(SchemaError, match=f"named {clash}"):
            await _upgrade(backend_url, share=True)
        assert await _state(backend_url) == before

    asyncio.run(check())


def test_open_refuses_it_and_opens_it_when_told_to_share(tmp_path: Path) -> None:
    path = tmp_path / "customers.db"
    url = f"sqlite+aiosqlite:///{path}"

    async def check() -> None:
        await _make_foreign(url, ["customers"])
        with pytest.raises(SchemaError, match="customers"):
            async with Ledger.open(str(path)):
                pass
        async with Ledger.open(str(path), share_database=True) as ledger:
            assert await ledger.project() == 0  # an empty log
        engine = create_engine(url)
        try:
            assert await current_revision(engine) == head_revision()
        finally:
            await engine.dispose()

    asyncio.run(check())


def test_the_migrate_verb_refuses_then_shares(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "customers.db"
    asyncio.run(_make_foreign(f"sqlite+aiosqlite:///{path}", ["customers"]))
    assert main(["migrate", "--db", str(path)]) != 0
    assert "--share-database" in capsys.readouterr().err
    assert main(["migrate", "--db", str(path), "--share-database"]) == 0
    assert f"schema at {head_revision()} (was no ledger schema)" in capsys.readouterr().out
