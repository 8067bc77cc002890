"""Schema revisions applied from the library: upgrade on open, refuse what we do not know."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from store.engine import WRITE_LOCK
from store.errors import SchemaError

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

#: Serialises concurrent migrators on PostgreSQL (any constant unique to this project).
_PG_MIGRATION_LOCK = 0x524C4D49  # "RLMI"


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config pointing at the packaged revisions (no alembic.ini needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "no Alembic revisions found"
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


def _upgrade(conn: Connection, target: str) -> None:
    cfg = alembic_config()
    script = ScriptDirectory.from_config(cfg)
    _check_known(conn, script)
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, target)


async def upgrade(engine: AsyncEngine, target: str = "head") -> None:
    """Upgrade the schema in one transaction; a database of unknown revision raises SchemaError."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(**{WRITE_LOCK: True})
        async with conn.begin():
            if conn.dialect.name == "postgresql":
                await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
            await conn.run_sync(_upgrade, target)


async def check_schema(engine: AsyncEngine) -> None:
    """Raise SchemaError unless the database is exactly at head (used when migrate=False)."""
    async with engine.connect() as conn:
        revision = await conn.run_sync(_current)
    head = head_revision()
    if revision != head:
        script = ScriptDirectory.from_config(alembic_config())
        async with engine.connect() as conn:
            await conn.run_sync(_check_known, script)
        raise SchemaError(
            f"the database is at schema revision {revision!r} but this rollout-ledger needs {head!r}: "
            "run `rollout-ledger migrate --db URL` (or open with migrate=True)"
        )


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(_current)
