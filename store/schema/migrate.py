"""Schema revisions applied from the library: upgrade on open, refuse what we do not know.

Reading a database's state and refusing one a reader must not use is `store.schema.state`'s job
(no Alembic there); this module changes schemas, and imports Alembic only when it does: an open
of a ledger already at head is one query and no Alembic.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from store.dialects import WRITE_LOCK, dialect_of
from store.errors import SchemaError
from store.faults import wraps_faults
from store.schema.ledger_file import read_file_state
from store.schema.state import (
    MIGRATIONS_DIR,
    SchemaState,
    check_schema,
    current,
    describe,
    head_revision,
    known_revisions,
    listing,
    read_state,
    schema_problem,
)
from store.schema.tables import metadata
from store.schema.views import VIEWS

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = [
    "LEDGER_NAMES",
    "SchemaState",
    "alembic_config",
    "check_schema",
    "current_revision",
    "describe",
    "head_revision",
    "read_state",
    "schema_problem",
    "upgrade",
]


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config pointing at the packaged revisions (no alembic.ini needed)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def _check_known(conn: Connection) -> str | None:
    revision = _current_if_versioned(conn)
    if revision is None:
        return None
    revisions, head = known_revisions()
    if revision not in revisions:
        raise SchemaError(
            f"the database is at schema revision {revision!r}, which this version of rollout-ledger "
            f"does not know (its newest is {head!r}); it was written by a newer rollout-ledger — "
            "upgrade the package, or point --db at another database"
        )
    return revision


#: Every table and view a ledger's schema has at head, and Alembic's own: anything else found in
#: a database that is not a ledger yet belongs to another application.
LEDGER_NAMES = frozenset({*metadata.tables, *VIEWS, "alembic_version"})


def _foreign_tables(state: SchemaState) -> tuple[str, ...]:
    """The tables and views of `state` that are not the ledger's."""
    return tuple(name for name in state.tables if name not in LEDGER_NAMES)


def _refuse_foreign(conn: Connection, share: bool) -> None:
    """A database that is not a ledger yet gets the ledger's tables only if it holds nothing else,
    or the caller said to share it: `migrate` on another application's file (a typo in --db) must
    not add eleven tables beside its own, nor half of them before a name clash stops it."""
    _refuse_state(read_state(conn), *describe(conn.engine.url), share)


def _refuse_state(state: SchemaState, where: str, target: str, share: bool) -> None:
    """`_refuse_foreign`'s verdict on a state already read (`where`, `target`: how to name it)."""
    if state.revision is not None:
        if state.revision not in known_revisions()[0]:
            raise SchemaError(schema_problem(state, where, target))
        return  # already a ledger: its own extra tables (a user's SQL) were its owner's choice
    foreign = _foreign_tables(state)
    if foreign and not share:
        raise SchemaError(
            f"{where} is not a rollout-ledger database: it holds another application's "
            f"{listing(foreign)}, so nothing was created; point --db at a new or empty database, "
            "or pass --share-database (share_database=True) to keep the ledger's tables beside them"
        )
    clash = [name for name in state.tables if name in LEDGER_NAMES and name != "alembic_version"]
    if clash:
        raise SchemaError(
            f"{where} already has table(s) named {', '.join(clash)} that are not a rollout-ledger "
            "schema (no alembic_version), so nothing was created; the ledger cannot share a "
            "database with them — point --db at another database"
        )


def _refuse_file(engine: AsyncEngine, share: bool) -> None:
    """For an existing SQLite file, the refusals, read before any connection: connecting
    switches a file to WAL, and a refusal must leave the file byte for byte as it was
    (docs/design.md §11). A file that is not refused is then opened as every writer opens it."""
    database = dialect_of(engine).local_file(engine.url)
    if database is None or not os.path.isfile(database) or not os.path.getsize(database):
        return
    _refuse_state(read_file_state(database), *describe(engine.url), share)


def _upgrade(conn: Connection, target: str, share: bool) -> None:
    from alembic import command

    cfg = alembic_config()
    _refuse_foreign(conn, share)
    _check_known(conn)
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, target)


@wraps_faults("upgrading the schema")
async def upgrade(engine: AsyncEngine, target: str = "head", *, share: bool = False) -> None:
    """Upgrade the schema in one transaction (all revisions or none, on SQLite and PostgreSQL).

    A database of unknown revision raises SchemaError, and so does one that is not a ledger yet
    and holds another application's tables, unless `share` says to keep both in one database.
    """
    await asyncio.to_thread(_refuse_file, engine, share)  # refused without a connection
    if target == "head":
        async with engine.connect() as conn:  # at head already (every open but the first): one read
            if await conn.run_sync(_current_if_versioned) == head_revision():
                return
    async with engine.connect() as conn:
        conn = await conn.execution_options(**{WRITE_LOCK: True})
        async with conn.begin():
            lock = dialect_of(conn).migration_lock_sql  # concurrent migrators take turns
            if lock is not None:
                await conn.execute(text(lock))
            await conn.run_sync(_upgrade, target, share)


@wraps_faults("reading the schema revision")
async def current_revision(engine: AsyncEngine) -> str | None:
    """The database's revision (None: no ledger schema); an existing SQLite file is read without
    a connection, so asking changes nothing (no switch to WAL)."""
    database = dialect_of(engine).local_file(engine.url)
    if database is not None and os.path.isfile(database) and os.path.getsize(database):
        return (await asyncio.to_thread(read_file_state, database)).revision
    async with engine.connect() as conn:
        return await conn.run_sync(_current_if_versioned)


def _current_if_versioned(conn: Connection) -> str | None:
    """The database's revision, None when it has no alembic_version table (a new database)."""
    if "alembic_version" not in inspect(conn).get_table_names():
        return None
    return current(conn)
