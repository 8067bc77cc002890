"""Shared fixtures: every backend-facing test runs once per backend (SQLite, PostgreSQL).

One mechanism provides databases: `fresh_database(backend, folder)`. Every fixture below and
every test that needs a database of its own goes through it. A SQLite database is a new file; a
PostgreSQL database is created for the block under a name unique to this run (run tag + uuid),
so concurrent runs cannot collide, and dropped after it. Where no PostgreSQL server answers, the
PostgreSQL tests skip on a developer machine and fail in CI (CI=true): CI must never pass by
skipping them.

Tests that reuse one database across many examples (hypothesis) take a module-scoped database
and `wipe` it per example: emptying tables is far cheaper than CREATE DATABASE on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

#: The PostgreSQL server the tests use (any database on it; tests create their own beside it).
PG_ADMIN_URL = os.environ.get("ROLLOUT_LEDGER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: Part of every PostgreSQL test database's name: which run made it.
RUN_TAG = uuid.uuid4().hex[:8]

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to completion, also from inside a running event loop (async tests)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


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


def _require_pg() -> None:
    """Skip (on a developer machine) or fail (in CI) unless the PostgreSQL server answers."""
    if "ok" not in _pg_state:
        try:
            _run(_pg_admin("SELECT 1"))
            _pg_state["ok"] = True
        except Exception as error:  # noqa: BLE001
            _pg_state["ok"] = False
            _pg_state["error"] = error
    if _pg_state["ok"]:
        return
    message = f"PostgreSQL not reachable at {_pg_dsn()}: {_pg_state.get('error')}"
    if IN_CI:
        pytest.fail(message + " — CI must run the PostgreSQL tests (.ci/run starts the server)")
    pytest.skip(message)


def default_sigint() -> None:
    """`preexec_fn` for a child a test interrupts with SIGINT: give it SIGINT's default action.

    A shell starts background jobs with SIGINT ignored (tests/run.sh runs the verl-pins job so,
    and CI may run the whole suite so), and Python installs its KeyboardInterrupt handler only
    when SIGINT is not ignored at start: without this the child would never see the Ctrl-C the
    test sends it.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_script(path: Path, *args: str, timeout: float = 120.0) -> tuple[Any, float]:
    """Run a script of the repo (an example) as a user would, with this Python and the checkout on
    `PYTHONPATH`; returns the finished process (output captured) and its wall time in seconds."""
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[1]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(path), *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    return done, time.monotonic() - started


#: Set by the verl-pins job (see tests/run.sh): there the verl tests must run, never skip.
VERL_REQUIRED = os.environ.get("ROLLOUT_LEDGER_REQUIRE_VERL", "").lower() in ("1", "true", "yes")


def require_verl() -> None:
    """Skip unless verl imports; in the verl-pins job (ROLLOUT_LEDGER_REQUIRE_VERL=1) fail instead.

    The default environment (newest releases) has no verl: verl 0.9.1 accepts only tensordict
    0.10.0. The second job installs verl and its pins and runs every `verl_env` test there.
    """
    try:
        import verl  # noqa: F401
    except ImportError as error:
        message = f"verl is not installed ({error}); the verl-pins job runs these tests"
        if VERL_REQUIRED:
            pytest.fail(message + " — ROLLOUT_LEDGER_REQUIRE_VERL is set, so they must run here")
        pytest.skip(message)


@pytest.fixture
def verl_installed() -> None:
    """Use in a test (or `pytestmark = pytest.mark.usefixtures("verl_installed")`) that runs verl."""
    require_verl()


@contextlib.contextmanager
def fresh_database(backend: str, folder: Path | None = None, name: str = "ledger") -> Iterator[str]:
    """The URL of a new, empty (unmigrated) database, for the block.

    `sqlite`: the file `folder/{name}.db` (which must not exist yet), or one in a temporary
    folder removed after the block when `folder` is None. `postgres`: a database of its own,
    `rl_test_{RUN_TAG}_{uuid}`, dropped after the block; skipped without a server, failed in CI.
    """
    if backend == "sqlite":
        if folder is None:
            with tempfile.TemporaryDirectory(prefix="rl-test-") as temporary:
                yield f"sqlite+aiosqlite:///{Path(temporary) / f'{name}.db'}"
            return
        path = folder / f"{name}.db"
        if path.exists():
            raise FileExistsError(
                f"{path} exists: fresh_database needs a name of its own per database"
            )
        yield f"sqlite+aiosqlite:///{path}"
        return
    if backend != "postgres":
        raise ValueError(f"unknown backend {backend!r} (sqlite or postgres)")
    _require_pg()
    from sqlalchemy.engine import make_url

    database = f"rl_test_{RUN_TAG}_{uuid.uuid4().hex[:8]}"
    _run(_pg_admin(f'CREATE DATABASE "{database}"'))
    try:
        yield (
            make_url(_pg_dsn(database))
            .set(drivername="postgresql+asyncpg")
            .render_as_string(hide_password=False)
        )
    finally:
        _run(_pg_admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))


def backend_of(url: str) -> str:
    return "sqlite" if url.startswith("sqlite") else "postgres"


async def wipe(url: str) -> None:
    """Migrate `url` to head and delete every row of every table; ids and positions restart at 1.

    For module-scoped databases reused by many examples: each starts from an empty database.
    """
    from sqlalchemy import text

    from store import create_engine, upgrade
    from store.schema.tables import metadata

    engine = create_engine(url)
    try:
        await upgrade(engine)
        async with engine.begin() as conn:
            tables = [table.name for table in metadata.sorted_tables]
            if conn.dialect.name == "postgresql":
                await conn.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY"))
            else:
                for name in reversed(tables):  # children before parents
                    await conn.execute(text(f"DELETE FROM {name}"))
                if (
                    await conn.execute(
                        text("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'")
                    )
                ).first():
                    await conn.execute(text("DELETE FROM sqlite_sequence"))
    finally:
        await engine.dispose()


# ------------------------------------------------------------------ fixtures
@pytest.fixture
def sqlite_url(tmp_path: Path) -> Iterator[str]:
    with fresh_database("sqlite", tmp_path) as url:
        yield url


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_database("postgres") as url:
        yield url


@pytest.fixture
def second_pg_url() -> Iterator[str]:
    """Another fresh database beside `pg_url`, e.g. to project the same log from scratch."""
    with fresh_database("postgres") as url:
        yield url


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database URL on each backend (or on the one an indirect parameter names)."""
    with fresh_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture(scope="module", params=BACKENDS)
def module_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One database per backend for a whole test module (`wipe` it where a test needs it empty)."""
    with fresh_database(request.param, tmp_path_factory.mktemp("db")) as url:
        yield url


@pytest.fixture(scope="module", params=BACKENDS)
def module_db_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """Two databases on one backend for a whole module, e.g. a source and a replay target."""
    folder = tmp_path_factory.mktemp("db")
    with (
        fresh_database(request.param, folder, "first") as first,
        fresh_database(request.param, folder, "second") as second,
    ):
        yield first, second


@pytest.fixture
async def ledger(db_url: str) -> AsyncIterator[object]:
    from sessions import Ledger

    async with Ledger.open(db_url) as opened:
        yield opened
