"""Shared fixtures: every backend-facing test runs once per backend (SQLite, PostgreSQL).

PostgreSQL tests get a database of their own, created for the test and dropped after it, so
concurrent runs cannot collide. Where no server answers, they skip on a developer machine and
fail in CI (CI=true): CI must never pass by skipping them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

PG_ADMIN_URL = os.environ.get("ROLLOUT_LEDGER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
RUN_TAG = uuid.uuid4().hex[:8]


def _pg_dsn(database: str | None = None) -> str:
    from sqlalchemy.engine import make_url

    url = make_url(PG_ADMIN_URL).set(drivername="postgresql")
    if database:
        url = url.set(database=database)
    return url.render_as_string(hide_password=False)


async def _pg_admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(_pg_dsn(), timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


_pg_state: dict[str, object] = {}


def pg_available() -> bool:
    if "ok" not in _pg_state:
        try:
            asyncio.run(_pg_admin("SELECT 1"))
            _pg_state["ok"] = True
        except Exception as error:  # noqa: BLE001
            _pg_state["ok"] = False
            _pg_state["error"] = error
    return bool(_pg_state["ok"])


def require_pg() -> None:
    if pg_available():
        return
    message = f"PostgreSQL not reachable at {_pg_dsn()}: {_pg_state.get('error')}"
    if IN_CI:
        pytest.fail(message + " — CI must run the PostgreSQL tests (.ci/run starts the server)")
    pytest.skip(message)


def new_pg_database() -> tuple[str, str]:
    """Create a fresh database; returns (name, async URL)."""
    name = f"rl_test_{RUN_TAG}_{uuid.uuid4().hex[:8]}"
    asyncio.run(_pg_admin(f'CREATE DATABASE "{name}"'))
    from sqlalchemy.engine import make_url

    url = make_url(_pg_dsn(name)).set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)
    return name, url


def drop_pg_database(name: str) -> None:
    asyncio.run(_pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextlib.contextmanager
def fresh_pg_database() -> Iterator[str]:
    """A new PostgreSQL database for the block (skipped, or failed in CI, without a server); dropped after."""
    require_pg()
    name, url = new_pg_database()
    try:
        yield url
    finally:
        drop_pg_database(name)


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_pg_database() as url:
        yield url


@pytest.fixture
def second_pg_url() -> Iterator[str]:
    """Another fresh database beside `pg_url`, e.g. to project the same log from scratch."""
    with fresh_pg_database() as url:
        yield url


@contextlib.contextmanager
def empty_database(backend: str, folder: Path) -> Iterator[str]:
    """The URL of a new, empty database: a SQLite file in `folder`, or a fresh PostgreSQL database."""
    if backend == "sqlite":
        yield f"sqlite+aiosqlite:///{folder / 'ledger.db'}"
        return
    with fresh_pg_database() as url:
        yield url


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def db_url(request, tmp_path) -> Iterator[str]:
    """A fresh, empty database URL on each backend."""
    with empty_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture(scope="module", params=BACKENDS)
def module_db_url(request, tmp_path_factory) -> Iterator[str]:
    """One database per backend for a whole test module."""
    with empty_database(request.param, tmp_path_factory.mktemp("db")) as url:
        yield url


@pytest.fixture
async def ledger(db_url) -> AsyncIterator[object]:
    from sessions import Ledger

    async with Ledger.open(db_url) as opened:
        yield opened
