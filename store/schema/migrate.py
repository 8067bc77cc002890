"""Schema revisions applied from the library: upgrade on open, refuse what we do not know.

`check_schema` (and `read_state` / `schema_problem` behind it) is how a reader that must not
migrate tells an empty database, another application's, an older one and a newer one apart, so
that its refusal can say what it found and what to run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from store.dialects import WRITE_LOCK, dialect_of
from store.errors import SchemaError, StoreInvariantError
from store.faults import wraps_faults
from store.schema.tables import metadata
from store.schema.views import VIEWS

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config pointing at the packaged revisions (no alembic.ini needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise StoreInvariantError(
            f"no Alembic revisions found in {MIGRATIONS_DIR}: the installed package is incomplete; "
            "reinstall rollout-ledger"
        )
    return head


def _current(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def _check_known(conn: Connection, script: ScriptDirectory) -> str | None:
    revision = _current(conn)
    if revision is None:
        return None
    try:
        known = script.get_revision(revision)
    except CommandError:
        known = None
    if known is None:
        raise SchemaError(
            f"the database is at schema revision {revision!r}, which this version of rollout-ledger "
            f"does not know (its newest is {script.get_current_head()!r}); it was written by a newer "
            "rollout-ledger — upgrade the package, or point --db at another database"
        )
    return revision


#: Every table and view a ledger's schema has at head, and Alembic's own: anything else found in
#: a database that is not a ledger yet belongs to another application.
LEDGER_NAMES = frozenset({*metadata.tables, *VIEWS, "alembic_version"})


def foreign_tables(state: SchemaState) -> tuple[str, ...]:
    """The tables and views of `state` that are not the ledger's."""
    return tuple(name for name in state.tables if name not in LEDGER_NAMES)


def _refuse_foreign(conn: Connection, share: bool) -> None:
    """A database that is not a ledger yet gets the ledger's tables only if it holds nothing else,
    or the caller said to share it: `migrate` on another application's file (a typo in --db) must
    not add eleven tables beside its own, nor half of them before a name clash stops it."""
    state = read_state(conn)
    where, target = describe(conn.engine.url)
    if state.revision is not None:
        if not _known(ScriptDirectory.from_config(alembic_config()), state.revision):
            raise SchemaError(schema_problem(state, where, target))
        return  # already a ledger: its own extra tables (a user's SQL) were its owner's choice
    foreign = foreign_tables(state)
    if foreign and not share:
        raise SchemaError(
            f"{where} is not a rollout-ledger database: it holds another application's "
            f"{_listing(foreign)}, so nothing was created; point --db at a new or empty database, "
            "or pass --share-database (share_database=True) to keep the ledger's tables beside them"
        )
    clash = [name for name in state.tables if name in LEDGER_NAMES and name != "alembic_version"]
    if clash:
        raise SchemaError(
            f"{where} already has table(s) named {', '.join(clash)} that are not a rollout-ledger "
            "schema (no alembic_version), so nothing was created; the ledger cannot share a "
            "database with them — point --db at another database"
        )


def _upgrade(conn: Connection, target: str, share: bool) -> None:
    cfg = alembic_config()
    script = ScriptDirectory.from_config(cfg)
    _refuse_foreign(conn, share)
    _check_known(conn, script)
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, target)


@wraps_faults("upgrading the schema")
async def upgrade(engine: AsyncEngine, target: str = "head", *, share: bool = False) -> None:
    """Upgrade the schema in one transaction (all revisions or none, on SQLite and PostgreSQL).

    A database of unknown revision raises SchemaError, and so does one that is not a ledger yet
    and holds another application's tables, unless `share` says to keep both in one database.
    """
    if target == "head":
        async with engine.connect() as conn:  # at head already (every open but the first): one read
            if await conn.run_sync(_current) == head_revision():
                return
    async with engine.connect() as conn:
        conn = await conn.execution_options(**{WRITE_LOCK: True})
        async with conn.begin():
            lock = dialect_of(conn).migration_lock_sql  # concurrent migrators take turns
            if lock is not None:
                await conn.execute(text(lock))
            await conn.run_sync(_upgrade, target, share)


@wraps_faults("checking the schema")
async def check_schema(engine: AsyncEngine) -> None:
    """Raise SchemaError unless the database is exactly at head (used when migrate=False).

    Only reads: nothing is created or altered, whatever the database turns out to be.
    """
    async with engine.connect() as conn:
        state = await conn.run_sync(read_state)
    problem = schema_problem(state, *describe(engine.url))
    if problem:
        raise SchemaError(problem)


@dataclass(frozen=True)
class SchemaState:
    """What a database holds, as far as telling a ledger from anything else goes."""

    tables: tuple[str, ...]  # every table (and view) of the default schema, sorted
    revision: str | None  # the row of alembic_version, if the table exists and has one

    @property
    def versioned(self) -> bool:
        return "alembic_version" in self.tables


def read_state(conn: Connection) -> SchemaState:
    """The tables and the schema revision of the database behind `conn`, by reading only."""
    inspector = inspect(conn)
    tables = tuple(sorted({*inspector.get_table_names(), *inspector.get_view_names()}))
    revision = _current(conn) if "alembic_version" in tables else None
    return SchemaState(tables, revision)


def describe(url: object) -> tuple[str, str]:
    """How to name the database at `url` in a message, and the `--db` value that reaches it."""
    parsed = make_url(str(url)) if not hasattr(url, "get_backend_name") else url
    return dialect_of(parsed).describe(parsed)  # type: ignore[arg-type]


def schema_problem(state: SchemaState, where: str, target: str) -> str | None:
    """Why a reader must not use this database, naming what was found and what to run; None if at head."""
    head = head_revision()
    if state.revision == head:
        return None
    migrate = f"run `rollout-ledger migrate --db {target}` (or open with migrate=True)"
    if not state.tables:
        return f"{where} is empty (no tables), not a rollout-ledger database yet: check --db, or {migrate} to make it one"
    found = _listing(state.tables)
    script = ScriptDirectory.from_config(alembic_config())
    if not state.versioned:
        return (
            f"{where} is not a rollout-ledger database: no alembic_version table (found {found}); point --db "
            "at a rollout-ledger database (reading never changes this one)"
        )
    if state.revision is None:
        return f"{where} has an empty alembic_version table (no schema revision; found {found}): {migrate}"
    if not _known(script, state.revision):
        if "events" not in state.tables:
            return (
                f"{where} is not a rollout-ledger database: its alembic_version holds {state.revision!r}, which "
                f"no rollout-ledger revision names, and it has no events table (found {found}); point --db at a "
                "rollout-ledger database"
            )
        return (
            f"{where} is at schema revision {state.revision!r}, which this version of rollout-ledger does not "
            f"know (its newest is {head!r}); it was written by a newer rollout-ledger — upgrade the package, "
            "or point --db at another database"
        )
    return f"{where} is at schema revision {state.revision!r}, older than the {head!r} this rollout-ledger needs: {migrate}"


def _known(script: ScriptDirectory, revision: str) -> bool:
    try:
        return script.get_revision(revision) is not None
    except CommandError:
        return False


def _listing(tables: tuple[str, ...], most: int = 6) -> str:
    shown = ", ".join(tables[:most]) + (
        f" and {len(tables) - most} more" if len(tables) > most else ""
    )
    return f"{len(tables)} table(s): {shown}"


@wraps_faults("reading the schema revision")
async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(_current)
