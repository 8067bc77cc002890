"""The ledger an integration records into, checked when the job starts (docs/verl.md, docs/trl.md).

A verl or TRL job that names its ledger wrongly must stop at its first line with one error, not
at its first actor update or as a per-row failure: the URL parsed, its driver installed (a
``postgresql://`` URL without the PostgreSQL driver names the extra that installs it), the
database reached and migrated, and the run's configuration fingerprint checked when the
integration passes one. Each failure is a ``ConfigError`` naming the setting the user gave
(``+ledger.url`` in verl, ``SyncLedger.open``'s URL in TRL), what was wrong and what to do.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sessions.errors import ConfigError, LedgerError
from sessions.ledger import Ledger
from sessions.runs.fingerprint import RunConfigMismatch
from store import describe_database, driver_install_hint, normalize_url

__all__ = ["check_ledger", "check_ledger_sync", "open_checked"]


@asynccontextmanager
async def open_checked(url: str, *, setting: str, **options: Any) -> AsyncIterator[Ledger]:
    """``Ledger.open(url, **options)``, whose failures to open are a ``ConfigError`` naming
    ``setting`` (how the user gave the URL); errors of the block itself pass unchanged."""
    try:
        normalize_url(url)
        where = describe_database(url)
    except LedgerError as error:
        raise ConfigError(f"{setting} is not a database URL the ledger opens: {error}") from error
    opened = False
    try:
        async with Ledger.open(url, **options) as ledger:
            opened = True
            yield ledger
    except ModuleNotFoundError as error:
        hint = None if opened else driver_install_hint((error.name or "").split(".")[0])
        if hint is None:
            raise
        what, extra = hint
        raise ConfigError(
            f"{setting}: the {where} needs {what}, which is not installed: pip install -e "
            f"'.[{extra}]' (in the rollout-ledger clone), or name another database"
        ) from error
    except (ConfigError, RunConfigMismatch):
        raise  # the ledger's options, or the run's fingerprint: their messages say what to do
    except (LedgerError, OSError) as error:
        if opened:
            raise
        raise ConfigError(
            f"{setting}: cannot open the ledger, the {where}: {type(error).__name__}: {error}; "
            "check the URL, and that the database (its server, or the file's folder) is "
            "reachable from here"
        ) from error


async def check_ledger(url: str, *, setting: str, **options: Any) -> None:
    """Open the ledger at ``url`` with ``options`` (migrating it), then close it; any problem is
    a ``ConfigError`` that names ``setting``."""
    async with open_checked(url, setting=setting, **options):
        pass


def check_ledger_sync(url: str, *, setting: str, **options: Any) -> None:
    """``check_ledger`` from synchronous code, also where an event loop already runs (it runs on
    a thread of its own there)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(check_ledger(url, setting=setting, **options))
        return
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(check_ledger(url, setting=setting, **options))
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, name="rollout-ledger-check", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
