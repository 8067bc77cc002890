"""What the dialects answer for the rest of `store`: what a driver's error means, the append's insert.

An error names no backend, so `store` asks each registered dialect: is it this driver's own error,
is it transient (a dropped connection, a lock not had in time), is the disk full, what does the
CLI tell a user about it, what to install when the driver is missing. Each dialect answers for
its own driver only; together they answer as one.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from store import (
    DriverError,
    describe_driver_error,
    driver_install_hint,
    is_transient,
    raised_by_driver,
)
from store.dialects import POSTGRES, SQLITE, registered
from store.faults import driver_error, is_driver_error
from store.retry import connection_lost

LOCKED = "database is locked"
DROPPED = "terminating connection due to administrator command"
PG_LOCK = "canceling statement due to lock timeout"


def wrapped(message: str, kind: type[Exception] = OperationalError, **kw: Any) -> Exception:
    """SQLAlchemy's wrapper of a driver error saying `message`."""
    return kind("SELECT 1", {}, Exception(message), **kw)


class _AsyncpgLike(Exception):
    """An error of asyncpg's (judged by its module's name: asyncpg need not be installed)."""

    sqlstate = "57P01"


_AsyncpgLike.__module__ = "asyncpg.exceptions"


@pytest.mark.parametrize(
    ("message", "transient", "lost"),
    [
        (LOCKED, True, False),
        (PG_LOCK, True, False),
        (DROPPED, True, True),
        ("syntax", False, False),
    ],
)
def test_transient_and_lost_are_the_union_of_the_dialects_answers(
    message: str, transient: bool, lost: bool
) -> None:
    error = wrapped(message)
    assert is_transient(error) is transient
    assert connection_lost(error) is lost
    assert is_transient(DriverError("append failed")) is False
    wrapper = DriverError("append failed")
    wrapper.__cause__ = error
    assert is_transient(wrapper) is transient and connection_lost(wrapper) is lost


def test_each_dialect_knows_its_own_drivers_texts() -> None:
    assert SQLITE.is_transient(wrapped(LOCKED)) and not POSTGRES.is_transient(wrapped(LOCKED))
    assert POSTGRES.connection_lost(wrapped(DROPPED)) and not SQLITE.connection_lost(
        wrapped(DROPPED)
    )
    assert SQLITE.disk_full("database or disk is full") and not POSTGRES.disk_full("disk is full")
    assert POSTGRES.disk_full("could not extend file: No space left on device")


def test_an_integrity_error_is_never_transient_and_an_invalidated_connection_is_lost() -> None:
    assert not is_transient(wrapped(LOCKED, IntegrityError))
    invalidated = wrapped("server gone", connection_invalidated=True)
    assert connection_lost(invalidated) and is_transient(invalidated)
    assert not connection_lost(wrapped("server gone", IntegrityError, connection_invalidated=True))


def test_a_drivers_own_error_is_known_by_its_dialect() -> None:
    assert SQLITE.owns(sqlite3.OperationalError("x")) and not POSTGRES.owns(sqlite3.Error("x"))
    assert POSTGRES.owns(_AsyncpgLike()) and not SQLITE.owns(_AsyncpgLike())
    assert raised_by_driver(sqlite3.Error()) and raised_by_driver(_AsyncpgLike())
    assert not raised_by_driver(ValueError("x")) and not raised_by_driver(None)
    assert not raised_by_driver(wrapped(LOCKED))  # SQLAlchemy's wrapper is not the driver's
    assert is_driver_error(wrapped(LOCKED)) and is_driver_error(_AsyncpgLike())
    assert not is_driver_error(OSError("x"))


def test_a_fault_says_what_to_do_for_either_drivers_full_disk() -> None:
    for message in ("database or disk is full", "could not extend file: No space left on device"):
        assert "the disk the database is on is full" in str(
            driver_error("append", wrapped(message))
        )
    assert "the connection dropped" in str(driver_error("append", wrapped(DROPPED)))
    assert "the database refused it" in str(driver_error("append", wrapped("syntax")))


def test_the_cli_line_asks_each_dialect_in_turn(tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    where = "SQLite file ledger.db"
    line = describe_driver_error(sqlite3.OperationalError(LOCKED), LOCKED, where, [db])
    assert line.startswith(f"{where} is locked by another process ({LOCKED})"), line
    # a PostgreSQL error: SQLite has no hint for its text, PostgreSQL one for its SQLSTATE class
    line = describe_driver_error(_AsyncpgLike(), DROPPED, "PostgreSQL database x", [])
    assert line == (
        f"PostgreSQL database x: {DROPPED}; the server is shutting down or restarting: "
        "run the command again once it is up"
    )
    assert describe_driver_error(ValueError("odd"), "odd", "the database") == "the database: odd"


def test_the_dialect_whose_driver_raised_an_error_is_asked_first() -> None:
    """A PostgreSQL error whose text SQLite's table also matches ("malformed") is described in
    PostgreSQL's words, never as a damaged SQLite file."""

    class Malformed(_AsyncpgLike):
        sqlstate = "22P02"

    Malformed.__module__ = "asyncpg.exceptions"
    message = 'malformed array literal: "{x"'
    line = describe_driver_error(Malformed(), message, "PostgreSQL database x", [])
    assert "sqlite3" not in line and "damaged" not in line, line
    assert line.startswith(f"PostgreSQL database x: {message}"), line


def test_a_sqlite_file_problem_is_asked_of_the_file_system_first(tmp_path: Path) -> None:
    folder = tmp_path / "a-folder"
    folder.mkdir()
    message = "unable to open database file"
    line = describe_driver_error(
        sqlite3.OperationalError(message),
        message,
        "SQLite file a-folder",
        ["postgresql://u@h/db", f"sqlite+aiosqlite:///{folder}"],  # the server URL is skipped
    )
    assert line.startswith(f"{folder} is a directory, not a SQLite file"), line


def test_every_sqlstate_hint_is_declared_by_a_dialect() -> None:
    assert POSTGRES.sqlstate_hints["28P01"] == "check the user and password in the URL"
    assert not SQLITE.sqlstate_hints


def test_a_missing_driver_is_named_by_its_dialect() -> None:
    assert driver_install_hint("asyncpg") == ("the PostgreSQL driver asyncpg", "postgres")
    assert driver_install_hint("aiosqlite") is None  # always installed: no extra to name
    assert driver_install_hint("numpy") is None


def test_the_append_insert_is_the_dialects() -> None:
    columns = ("event_id", "data")
    assert POSTGRES.append_insert(columns) == (
        "INSERT INTO events (event_id, data) SELECT r.event_id, r.data::jsonb "
        "FROM unnest($1::varchar[], $2::text[]) WITH ORDINALITY AS r(event_id, data, n) "
        "ORDER BY r.n"
    )
    rows = [("a", "{}"), ("b", "[]")]
    assert POSTGRES.append_params(rows) == (["a", "b"], ["{}", "[]"])
    assert SQLITE.append_insert(columns) is None and SQLITE.append_params(rows) == rows


def test_the_registry_asks_sqlite_first() -> None:
    """The order of `registered` is the order an error is asked about: today's CLI lines
    (SQLite's texts before PostgreSQL's SQLSTATEs) depend on it."""
    assert registered() == (SQLITE, POSTGRES)
