"""What a database holds and whether a reader may use it, told by reading only, without Alembic.

`check_schema` (and `read_state` / `schema_problem` behind it) is how a reader that must not
migrate tells an empty database, another application's, an older one and a newer one apart, so
that its refusal can say what it found and what to run. Every read verb and every
`Ledger.open(migrate=False)` asks it first, so it stays cheap: the revision is one query of
`alembic_version`, and the revisions this package knows are read from the revision files' own
`revision = ...` / `down_revision = ...` lines (the one declaration of the history;
`tests/store/test_migrations.py` holds the head equal to Alembic's). Importing Alembic costs a third of
a CLI command's start-up; only `store.schema.migrate`, which changes a schema, loads it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from store.dialects import dialect_of
from store.errors import SchemaError, StoreInvariantError
from store.faults import wraps_faults

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
_REVISION = re.compile(r"^revision\s*=\s*['\"]([^'\"]+)['\"]", re.MULTILINE)
_DOWN_REVISION = re.compile(r"^down_revision\s*=\s*(None|['\"]([^'\"]+)['\"])", re.MULTILINE)


@functools.cache
def known_revisions() -> tuple[tuple[str, ...], str]:
    """Every revision the packaged history holds, and its head (the one nothing follows)."""
    revisions: list[str] = []
    parents: set[str] = set()
    for path in sorted((MIGRATIONS_DIR / "versions").glob("*.py")):
        source = path.read_text(encoding="utf-8")
        revision, down = _REVISION.search(source), _DOWN_REVISION.search(source)
        if revision is None or down is None:
            continue  # __init__.py and anything else that is not a revision
        revisions.append(revision.group(1))
        if down.group(2):
            parents.add(down.group(2))
    heads = [r for r in revisions if r not in parents]
    if len(heads) != 1:
        raise StoreInvariantError(
            f"the Alembic revisions in {MIGRATIONS_DIR} have {len(heads)} heads ({heads}), not one: "
            "the installed package is incomplete or damaged; reinstall rollout-ledger"
        )
    return tuple(revisions), heads[0]


def head_revision() -> str:
    """The schema revision this version of rollout-ledger writes and reads."""
    return known_revisions()[1]


def current(conn: Connection) -> str | None:
    """The revision in `alembic_version` (None: no row); the table must exist."""
    rows = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    if len(rows) > 1:
        raise SchemaError(
            f"the database's alembic_version holds {len(rows)} revisions ({', '.join(rows)}), "
            "a branched schema no rollout-ledger writes: point --db at another database"
        )
    return rows[0] if rows else None


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
    revision = current(conn) if "alembic_version" in tables else None
    return SchemaState(tables, revision)


def describe(url: object) -> tuple[str, str]:
    """How to name the database at `url` in a message, and the `--db` value that reaches it."""
    parsed = make_url(str(url)) if not hasattr(url, "get_backend_name") else url
    return dialect_of(parsed).describe(parsed)  # type: ignore[arg-type]


def schema_problem(state: SchemaState, where: str, target: str) -> str | None:
    """Why a reader must not use this database, naming what was found and what to run; None if at head."""
    revisions, head = known_revisions()
    if state.revision == head:
        return None
    migrate = f"run `rollout-ledger migrate --db {target}` (or open with migrate=True)"
    if not state.tables:
        return f"{where} is empty (no tables), not a rollout-ledger database yet: check --db, or {migrate} to make it one"
    found = listing(state.tables)
    if not state.versioned:
        return (
            f"{where} is not a rollout-ledger database: no alembic_version table (found {found}); point --db "
            "at a rollout-ledger database (reading never changes this one)"
        )
    if state.revision is None:
        return f"{where} has an empty alembic_version table (no schema revision; found {found}): {migrate}"
    if state.revision not in revisions:
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


def listing(tables: tuple[str, ...], most: int = 6) -> str:
    shown = ", ".join(tables[:most]) + (
        f" and {len(tables) - most} more" if len(tables) > most else ""
    )
    return f"{len(tables)} table(s): {shown}"


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
