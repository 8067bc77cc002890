"""A read-only look at a SQLite file before any connection: is it a rollout-ledger database at head?

Connecting to a SQLite file creates it if it is missing and switches it to WAL, which a reader must
not do to a mistyped path or another application's file. `create_engine(url, require_ledger=True)`
runs `require_ledger_file` first for the file its dialect names (`Dialect.local_file`), and a
refusal says what was found there and what to run.
"""

from __future__ import annotations

import os
import shlex
import sqlite3
from pathlib import Path
from urllib.parse import quote

import sqlalchemy
import sqlalchemy.exc
from sqlalchemy.pool import NullPool

from store.errors import SchemaError
from store.faults import driver_error
from store.schema.state import SchemaState, read_state, schema_problem

__all__ = ["holds_ledger", "read_file_state", "require_ledger_file"]

#: The first 16 bytes of every SQLite database file.
_SQLITE_HEADER = b"SQLite format 3\x00"


def require_ledger_file(database: str) -> None:
    """Raise SchemaError unless `database` is an existing rollout-ledger SQLite file at head.

    Reads only: the file is opened read-only (`mode=ro`, or `immutable=1` when nothing has it open),
    so a missing path is not created, and another application's file is neither migrated nor
    switched to WAL.
    """
    path = Path(database).expanduser()
    where, target = f"SQLite file {database}", shlex.quote(database)
    create = f"`rollout-ledger demo --db {target}` or `rollout-ledger migrate --db {target}`"
    if path.is_dir():
        raise SchemaError(
            f"{database} is a directory, not a SQLite file: pass a file path such as "
            f"{os.path.join(database, 'rollouts.db')}"
        )
    if not path.exists():
        raise SchemaError(
            f"no SQLite file {database}: check --db (is the path mistyped?); this command "
            f"never creates a database — {create} creates a ledger there"
        )
    if not os.access(path, os.R_OK):
        raise SchemaError(
            f"permission denied: this process may not read the SQLite file {database}; "
            "check its owner and mode"
        )
    with open(path, "rb") as file:
        header = file.read(len(_SQLITE_HEADER))
    wal = Path(f"{path}-wal")
    if not header and not (wal.exists() and wal.stat().st_size):
        raise SchemaError(
            f"{where} is empty (0 bytes), not a rollout-ledger database: check --db, or run {create} "
            "to make it one"
        )
    if header and header != _SQLITE_HEADER:
        raise SchemaError(
            f"{database} is not a database (not a SQLite file: it starts with bytes {header[:8].hex()}, "
            "not 'SQLite format 3'): point --db at a rollout-ledger database, or restore it from a backup"
        )
    problem = schema_problem(read_file_state(database), where, target)
    if problem:
        raise SchemaError(problem)


def read_file_state(database: str) -> SchemaState:
    """The schema state of the existing SQLite file `database`, read without writing a byte.

    Without a -wal or -journal beside it no connection has the file open and it holds every
    commit, so it is read as immutable: not even the -shm and -wal files a WAL reader creates
    appear; otherwise read-only (`mode=ro`), which changes neither its bytes nor its journal mode.
    """
    path = Path(database).expanduser()
    busy = any(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-journal"))
    uri = f"file:{quote(str(path.resolve()))}?{'mode=ro' if busy else 'immutable=1'}"
    sync = sqlalchemy.create_engine(
        "sqlite://", creator=lambda: sqlite3.connect(uri, uri=True), poolclass=NullPool
    )
    try:
        with sync.connect() as conn:
            return read_state(conn)
    except sqlalchemy.exc.DBAPIError as error:
        # sqlite3's own error ("file is not a database", "malformed", …) is the cause
        raise driver_error(f"reading SQLite file {database}", error) from error
    finally:
        sync.dispose()


def holds_ledger(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a SQLite file with a ledger's `events` table: a read-only look that
    creates nothing (an output path must never be one, docs/design.md §11). A SQLite file that
    cannot be read counts as one: writing over it is not a gamble to take."""
    try:
        with open(path, "rb") as file:
            if file.read(len(_SQLITE_HEADER)) != _SQLITE_HEADER:
                return False
    except OSError:
        return False
    try:
        conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error:
        return True
    try:
        found = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'events'"
        ).fetchone()
        return found is not None
    except sqlite3.Error:
        return True
    finally:
        conn.close()
