"""Only `demo`, `migrate` and `replay --into` create or migrate a database (docs/design.md §11).

Every other verb opens an existing ledger at head, or refuses in one line that says what it found
and what to run — and refusing writes nothing: a mistyped `--db` is not created, an empty file
stays empty, and another application's SQLite file keeps its bytes and its journal mode (a
migrating open used to add the ledger's tables to it and switch it to WAL).
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from sessions import Ledger
from store import create_engine, current_revision, head_revision, upgrade
from tests.cli.test_errors import KW, cli, one_line
from tests.conftest import fresh_database

READ_VERBS = {
    "metrics": ["metrics"],
    "history": ["history", "s0"],
    "export": ["export", "--partition", "val", "--step", "0", "--out", "batch.pt"],
    "project": ["project"],
    "recover": ["recover", "--older-than", "1h"],
    "audit": ["audit"],
    "sql": ["sql", "SELECT 1"],
    "replay": ["replay", "--into", "replayed.db"],
}
#: The verbs every case is tried with; the ones the cases matter most for get every verb.
FEW_VERBS = ("project", "metrics", "sql")


def _sqlite(path: Path, *statements: str) -> None:
    with sqlite3.connect(path) as conn:
        for statement in statements:
            conn.execute(statement)
    conn.close()


def _ledger(path: Path, revision: str = "head", stored: str | None = None) -> None:
    """A ledger file at `revision` (and, with `stored`, claiming that revision in alembic_version)."""

    async def make() -> None:
        engine = create_engine(str(path))
        try:
            await upgrade(engine, revision)
            async with engine.begin() as conn:
                if stored is not None:
                    await conn.execute(
                        text("UPDATE alembic_version SET version_num = :r"), {"r": stored}
                    )
            async with engine.connect() as conn:
                await conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            await engine.dispose()

    asyncio.run(make())
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _missing(folder: Path) -> Path:
    return folder / "mistyped.db"


def _empty(folder: Path) -> Path:
    (folder / "empty.db").write_bytes(b"")
    return folder / "empty.db"


def _foreign(folder: Path) -> Path:
    _sqlite(
        folder / "shop.db",
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)",
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer INTEGER)",
        "INSERT INTO customers VALUES (1, 'ada')",
    )
    return folder / "shop.db"


def _foreign_alembic(folder: Path) -> Path:
    _sqlite(
        folder / "app.db",
        "CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)",
        "INSERT INTO alembic_version VALUES ('ae1027a6acf')",
        "CREATE TABLE users (id INTEGER PRIMARY KEY)",
    )
    return folder / "app.db"


def _no_tables(folder: Path) -> Path:
    _sqlite(
        folder / "blank.db", "PRAGMA user_version = 1"
    )  # a valid SQLite file with no table at all
    return folder / "blank.db"


def _older(folder: Path) -> Path:
    _ledger(folder / "old.db", "0003")
    return folder / "old.db"


def _newer(folder: Path) -> Path:
    _ledger(folder / "new.db", stored="9999_from_the_future")
    return folder / "new.db"


#: case -> (make the --db path in a folder, what the one line must name ({db}: the path))
CASES: dict[str, tuple[Callable[[Path], Path], tuple[str, ...]]] = {
    "missing": (_missing, ("no SQLite file {db}", "mistyped", "rollout-ledger migrate --db {db}")),
    "empty": (_empty, ("{db} is empty (0 bytes)", "rollout-ledger migrate --db {db}")),
    "no-tables": (_no_tables, ("{db} is empty (no tables)", "rollout-ledger migrate --db {db}")),
    "foreign": (
        _foreign,
        (
            "not a rollout-ledger database",
            "no alembic_version table",
            "2 table(s): customers, orders",
        ),
    ),
    "foreign-alembic": (
        _foreign_alembic,
        ("not a rollout-ledger database", "'ae1027a6acf'", "no events table", "users"),
    ),
    "older": (_older, ("schema revision '0003'", "rollout-ledger migrate --db {db}")),
    "newer": (_newer, ("'9999_from_the_future'", "newer rollout-ledger", "upgrade the package")),
}
FULL = ("missing", "foreign")


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file of the folder and a digest of its bytes."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def _journal_mode(path: Path) -> str:
    """The journal mode the file records, read from its header (a connection could add -shm and -wal)."""
    with open(path, "rb") as file:
        header = file.read(20)
    return "wal" if header[18:20] == b"\x02\x02" else "delete"


def _pairs() -> Iterator[tuple[str, str]]:
    for case in CASES:
        for verb in READ_VERBS if case in FULL else FEW_VERBS:
            yield case, verb


@pytest.mark.parametrize(("case", "verb"), list(_pairs()))
def test_a_read_verb_refuses_what_is_not_a_ledger_at_head_and_writes_nothing(
    case: str, verb: str, tmp_path: Path
) -> None:
    make, says = CASES[case]
    db = make(tmp_path)
    before = _snapshot(tmp_path)
    mode = _journal_mode(db) if db.exists() and db.stat().st_size else None
    line = one_line(cli(*READ_VERBS[verb], "--db", db.name, cwd=tmp_path))
    for fragment in says:
        assert fragment.format(db=db.name) in line, line
    assert _snapshot(tmp_path) == before, "refusing changed the folder"
    if mode is not None:
        assert _journal_mode(db) == mode


def test_the_foreign_file_keeps_its_journal_mode_and_bytes_through_every_read_verb(
    tmp_path: Path,
) -> None:
    """The issue's own report: another application's file, every read verb in turn, then compared."""
    db = _foreign(tmp_path)
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    for args in READ_VERBS.values():
        one_line(cli(*args, "--db", str(db), cwd=tmp_path))
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    assert _journal_mode(db) == "delete" and not Path(f"{db}-wal").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shop.db"]


def test_migrate_upgrades_what_the_read_verbs_refused(tmp_path: Path) -> None:
    db = _older(tmp_path)
    assert "schema revision '0003'" in one_line(cli("metrics", "--db", str(db), cwd=tmp_path))
    migrated = cli("migrate", "--db", str(db), cwd=tmp_path)
    assert (
        migrated.returncode == 0 and f"schema at {head_revision()} (was 0003)" in migrated.stdout
    ), migrated.stderr
    assert "no events yet" in one_line(
        cli("metrics", "--db", str(db), cwd=tmp_path)
    )  # opened: a ledger, just empty


def test_replay_creates_its_target_but_not_its_source(tmp_path: Path) -> None:
    source = tmp_path / "ledger.db"

    async def record() -> None:
        async with Ledger.open(str(source)) as ledger:
            handle = await ledger.create_session("s0", **KW)
            await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4])
            await handle.complete()

    asyncio.run(record())
    done = cli("replay", "--db", str(source), "--into", "fresh.db", cwd=tmp_path)
    assert done.returncode == 0 and "replayed" in done.stdout, done.stderr
    assert (tmp_path / "fresh.db").exists()
    assert "no SQLite file" in one_line(
        cli("replay", "--db", "nowhere.db", "--into", "other.db", cwd=tmp_path)
    )
    assert not (tmp_path / "nowhere.db").exists() and not (tmp_path / "other.db").exists()


@pytest.mark.parametrize("verb", ["demo", "migrate"])
def test_demo_and_migrate_create_a_missing_file(verb: str, tmp_path: Path) -> None:
    args = (
        ["demo", "--steps", "1", "--prompts", "1", "--group-size", "1"]
        if verb == "demo"
        else ["migrate"]
    )
    done = cli(*args, "--db", "new.db", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert _journal_mode(tmp_path / "new.db") == "wal"


# -- PostgreSQL: connecting changes nothing, so the same refusals come from reading the catalog ----


async def _tables(url: str) -> list[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")
            )
            return [row[0] for row in rows]
    finally:
        await engine.dispose()


async def _prepare(url: str, case: str) -> None:
    engine = create_engine(url)
    try:
        if case == "older":
            await upgrade(engine, "0003")
        elif case == "foreign":
            async with engine.begin() as conn:
                await conn.execute(text("CREATE TABLE customers (id INTEGER PRIMARY KEY)"))
    finally:
        await engine.dispose()


PG_CASES = {
    "empty": ("is empty (no tables)", "rollout-ledger migrate --db"),
    "foreign": ("not a rollout-ledger database", "no alembic_version table", "customers"),
    "older": ("schema revision '0003'", "rollout-ledger migrate --db"),
}


@pytest.mark.postgres
@pytest.mark.parametrize("case", PG_CASES)
@pytest.mark.parametrize("verb", ["project", "metrics", "replay"])
def test_postgres_read_verbs_refuse_without_migrating(case: str, verb: str, tmp_path: Path) -> None:
    with fresh_database("postgres") as url:
        asyncio.run(_prepare(url, case))
        before = asyncio.run(_tables(url))
        line = one_line(cli(*READ_VERBS[verb], "--db", url, cwd=tmp_path))
        for fragment in PG_CASES[case]:
            assert fragment in line, line
        assert asyncio.run(_tables(url)) == before
        if case == "older":
            engine = create_engine(url)
            try:
                assert asyncio.run(current_revision(engine)) == "0003"
            finally:
                asyncio.run(engine.dispose())


async def test_the_library_can_open_the_same_way(tmp_path: Path) -> None:
    """`Ledger.open(url, migrate=False, require_ledger=True)`: the CLI's read-only open, for a library user."""
    from store import SchemaError

    for make in (_missing, _foreign):
        db = make(tmp_path)
        before = _snapshot(tmp_path)
        with pytest.raises(SchemaError, match="no SQLite file|not a rollout-ledger database"):
            async with Ledger.open(str(db), migrate=False, require_ledger=True):
                pytest.fail("opened what is not a ledger")
        assert _snapshot(tmp_path) == before


# -- a refusal leaves the file byte for byte as it was; a read verb keeps the journal mode --------

#: The verbs that create or migrate `--db`, each refused on a file that is not (yet) theirs.
MIGRATING_VERBS = {
    "migrate": ["migrate"],
    "demo": ["demo", "--steps", "1", "--prompts", "1", "--group-size", "1"],
}
REFUSED = {
    "foreign": ("not a rollout-ledger database", "customers, orders"),
    "foreign-alembic": ("not a rollout-ledger database", "'ae1027a6acf'"),
    "newer": ("'9999_from_the_future'", "newer rollout-ledger"),
}


@pytest.mark.parametrize("case", REFUSED)
@pytest.mark.parametrize("verb", MIGRATING_VERBS)
def test_a_refused_migration_leaves_the_file_byte_for_byte(
    case: str, verb: str, tmp_path: Path
) -> None:
    """`migrate` (and `demo`) on another application's file, or a newer ledger's: refused, and
    neither the bytes nor the journal mode change, nor does a -wal or -shm file appear (the
    check is a read-only look before any connection)."""
    db = CASES[case][0](tmp_path)
    before, mode = _snapshot(tmp_path), _journal_mode(db)
    line = one_line(cli(*MIGRATING_VERBS[verb], "--db", db.name, cwd=tmp_path))
    for fragment in REFUSED[case]:
        assert fragment in line, line
    assert _snapshot(tmp_path) == before, "the refusal changed the folder"
    assert _journal_mode(db) == mode


async def test_a_refused_open_leaves_the_file_byte_for_byte(tmp_path: Path) -> None:
    """The library's migrating open refuses the same way, before it connects."""
    from store import SchemaError

    db = _foreign(tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(SchemaError, match="not a rollout-ledger database"):
        async with Ledger.open(str(db)):
            pytest.fail("migrated another application's file")
    assert _snapshot(tmp_path) == before and _journal_mode(db) == "delete"


def _backup_of_a_ledger(folder: Path) -> Path:
    """A projected ledger with one ended session, and its backup: a file in DELETE mode."""
    source = folder / "live.db"

    async def record() -> None:
        async with Ledger.open(str(source)) as ledger:
            handle = await ledger.create_session("s0", **KW)
            await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4])
            await handle.post_reward(1.0)
            await handle.complete()
            await ledger.project()

    asyncio.run(record())
    copy = folder / "copy.db"
    done = cli("backup", "--db", str(source), "--out", str(copy), cwd=folder)
    assert done.returncode == 0, done.stderr
    assert _journal_mode(copy) == "delete"
    return copy


#: Every verb that only reads its `--db` (docs/design.md §11), with what it needs after `--db`.
ONLY_READING = {
    "audit": ["audit"],
    "sql": ["sql", "SELECT count(*) FROM events"],
    "history": ["history", "s0"],
    "metrics": ["metrics"],  # the projector is at the log's end: read straight
    "export-dataset": ["export-dataset", "--format", "jsonl", "--out", "{out}/sessions.jsonl"],
    "report --no-project": ["report", "--no-project", "--out", "{out}/report"],
    "replay": ["replay", "--into", "{out}/replayed.db"],
    "backup": ["backup", "--out", "{out}/again.db"],
}


def test_a_read_verb_keeps_a_backups_bytes_and_journal_mode(tmp_path: Path) -> None:
    """Verifying a backup (`audit`), or reading it any other way, changes none of its bytes and
    leaves it in DELETE mode: it used to be switched to WAL by the first read."""
    folder = tmp_path / "backups"
    folder.mkdir()
    copy = _backup_of_a_ledger(tmp_path)
    copy = copy.rename(folder / copy.name)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    before = _snapshot(folder)
    for verb, args in ONLY_READING.items():
        filled = [arg.format(out=outputs) for arg in args]
        done = cli(filled[0], "--db", str(copy), *filled[1:], cwd=tmp_path)
        assert done.returncode == 0, f"{verb}: {done.stderr}"
        assert _snapshot(folder) == before, f"{verb} changed the backup's folder"
        assert _journal_mode(copy) == "delete", verb
