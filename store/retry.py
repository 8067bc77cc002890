"""Retrying database operations that failed transiently: a dropped connection, a busy SQLite
file, a PostgreSQL lock timeout. Appends, projector pages and opens all go through here."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sqlalchemy.exc import DBAPIError, IntegrityError

log = logging.getLogger(__name__)

__all__ = ["RETRY_ATTEMPTS", "RETRY_BASE_DELAY", "is_transient", "retry_transient"]

#: Attempts for an operation that failed transiently (lost connection, lock timeout, busy file).
RETRY_ATTEMPTS = 4
RETRY_BASE_DELAY = 0.05


def is_transient(error: BaseException) -> bool:
    """Errors worth retrying: the connection dropped, or a lock could not be had in time.

    Retrying an append is safe even when the failure hid a successful commit: the retry finds
    the event ids stored and becomes an idempotent no-op.
    """
    if not isinstance(error, DBAPIError) or isinstance(error, IntegrityError):
        return False
    if error.connection_invalidated:
        return True
    text_ = str(error.orig).lower()
    return any(
        marker in text_
        for marker in (
            "database is locked",
            "lock timeout",
            "lock_timeout",
            "connection was closed",
            "terminating connection",
            "connection is closed",
            "connection refused",
            "server closed the connection",
        )
    )


async def retry_transient(operation: Any, *, what: str, attempts: int = RETRY_ATTEMPTS) -> Any:
    """Run `operation()` (a coroutine factory), retrying transient database errors with backoff."""
    for attempt in range(attempts):
        try:
            return await operation()
        except DBAPIError as error:
            if attempt == attempts - 1 or not is_transient(error):
                raise
            delay = RETRY_BASE_DELAY * (2**attempt)
            log.warning(
                "%s failed transiently (%s); retry %d/%d in %.2fs",
                what,
                error.orig,
                attempt + 1,
                attempts - 1,
                delay,
            )
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
