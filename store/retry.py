"""Retrying database operations that failed transiently: a dropped connection, a busy SQLite
file, a PostgreSQL lock timeout. Appends, projector pages and opens all go through here; what
a transient error looks like is each driver's, answered by its dialect (`store.dialects`)."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from store.dialects import dialect_of, registered
from store.errors import DatabaseUnreachableError, DriverError, LedgerError

log = logging.getLogger(__name__)

__all__ = [
    "RETRY_ATTEMPTS",
    "OPEN_ATTEMPTS",
    "RETRY_BASE_DELAY",
    "connection_lost",
    "is_transient",
    "retry_transient",
]

#: Attempts for an operation that failed transiently (lost connection, lock timeout, busy file).
RETRY_ATTEMPTS = 4
RETRY_BASE_DELAY = 0.05
#: Attempts for opening a database (migrate or schema check): an open happens once per process,
#: so it waits out a longer outage (≈1.5 s of backoff in all) than a command does.
OPEN_ATTEMPTS = 6


def is_transient(error: BaseException) -> bool:
    """Errors worth retrying: the connection dropped, or a lock could not be had in time.

    A `DriverError` is judged by the driver's error it wraps (its `__cause__`). An error names no
    backend, so every registered dialect is asked whether it looks transient for its driver.
    Retrying an append is safe even when the failure hid a successful commit: the retry finds the
    event ids stored and becomes an idempotent no-op.
    """
    cause = _driver_cause(error)
    return any(dialect.is_transient(cause) for dialect in registered())


def connection_lost(error: BaseException) -> bool:
    """The connection broke under the operation: unlike a refused lock, a commit in flight may
    have landed, so an append's outcome is unknown until the database is asked."""
    cause = _driver_cause(error)
    return any(dialect.connection_lost(cause) for dialect in registered())


def _driver_cause(error: BaseException) -> BaseException:
    """The driver's error behind a `DriverError`, or `error` itself."""
    if isinstance(error, DriverError) and error.__cause__ is not None:
        return error.__cause__
    return error


async def retry_transient(
    operation: Any, *, what: str, attempts: int = RETRY_ATTEMPTS, connecting: URL | None = None
) -> Any:
    """Run `operation()` (a coroutine factory), retrying transient database errors with backoff;
    the last attempt's error (or any error that is not transient) is raised as it is.

    `connecting` (the database's URL, for an open): a connection the server refused or reset
    (nothing listens yet, a restart) is retried too, and when the attempts run out — or the host
    is unknown — `DatabaseUnreachableError` names the server and what to check."""
    server = connecting is not None and dialect_of(connecting).local_file(connecting) is None
    try:
        return await _retrying(operation, what, attempts, server)
    except OSError as error:
        if connecting is None or not server or isinstance(error, LedgerError):
            raise
        if not (_refused(error) or isinstance(error, (socket.gaierror, TimeoutError))):
            raise  # a connection dropped once made: the driver's error says so
        dialect = dialect_of(connecting)
        where, _ = dialect.describe(connecting)
        tried = f" after {attempts} attempts" if _refused(error) else ""
        raise DatabaseUnreachableError(
            f"cannot connect to {where}{tried}: {type(error).__name__}: {error}; "
            f"{dialect.unreachable_hint(connecting)}",
            what=what,
        ) from error


def _refused(error: OSError) -> bool:
    """A connection the server refused (nothing listens yet, a restart: worth another try), as
    opposed to a host that does not resolve, a connect that timed out or a connection dropped
    after it was made (the driver's own error, described as such). asyncio reports a refusal on
    every address of a host (`localhost`: ::1 and 127.0.0.1) as one plain OSError."""
    if isinstance(error, ConnectionRefusedError):
        return True
    return type(error) is OSError and error.errno is None and "Connect call failed" in str(error)


async def _retrying(operation: Any, what: str, attempts: int, connecting: bool) -> Any:
    for attempt in range(attempts - 1):
        try:
            return await operation()
        except (DBAPIError, DriverError, OSError) as error:
            if not isinstance(error, (DBAPIError, DriverError)):
                if not (connecting and _refused(error)):
                    raise
            elif not is_transient(error):
                raise
            cause = _driver_cause(error)
            delay = RETRY_BASE_DELAY * (2**attempt)
            # a refused connection is named, with its attempts, by the error if they all fail
            refused = isinstance(error, OSError) and not isinstance(error, LedgerError)
            log.log(
                logging.INFO if refused else logging.WARNING,
                "%s failed transiently (%s); retry %d/%d in %.2fs",
                what,
                getattr(cause, "orig", cause),
                attempt + 1,
                attempts - 1,
                delay,
            )
            await asyncio.sleep(delay)
    return await operation()
