"""SQLite appends on a thread of their own, beside the event loop rather than through it.

Through aiosqlite, every statement of a group commit (BEGIN IMMEDIATE, the group-slot query, the
insert, COMMIT) is a round trip from the caller's loop to aiosqlite's thread by way of
SQLAlchemy's greenlet adapter: futures, callbacks, contexts and greenlet switches on the loop, and
tracked objects that live until the commit and feed the cyclic collector. Here one thread owns a
plain synchronous connection to the same file, opened with the same settings
(`store.dialects.sqlite_engine.writer_twin`), and runs a whole batch's transaction; the loop pays one
hand-off per batch. The transaction's logic is written once (`store.log.append_sql`) and runs here
through `run_now`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import sqlalchemy
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from store.dialects import WRITE_LOCK
from store.errors import StoreInvariantError

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["SqliteWriter", "ImmediateConnection", "run_now"]


class SqliteWriter:
    """A thread holding one write connection, from one batch to the next (like the async path's)."""

    def __init__(self, engine: sqlalchemy.Engine) -> None:
        self._engine = engine
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rollout-ledger-sqlite-append"
        )
        self._conn: Connection | None = None

    @property
    def engine(self) -> sqlalchemy.Engine:
        return self._engine

    async def run(self, transaction: Callable[[Connection], T]) -> T:
        """Run `transaction(connection)` on the writer thread; a failure other than a unique
        constraint's drops the connection (it may be broken), so the retry opens a fresh one."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._call, transaction
        )

    def _call(self, transaction: Callable[[Connection], T]) -> T:
        if self._conn is None:
            self._conn = self._engine.connect().execution_options(**{WRITE_LOCK: True})
        try:
            return transaction(self._conn)
        except BaseException as error:
            if not isinstance(error, IntegrityError):
                self._drop()
            raise

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.invalidate()
            conn.close()
        except Exception as error:  # noqa: BLE001 - already failing; the original error matters
            log.debug("closing the SQLite append connection failed: %s", error)

    async def close(self) -> None:
        """Close the connection on its own thread, then stop the thread and the engine."""
        loop = asyncio.get_running_loop()
        try:
            if self._conn is not None:  # (no thread was started for a store that never appended)
                await loop.run_in_executor(self._executor, self._close)
        finally:
            self._executor.shutdown(wait=True)
            self._engine.dispose()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class ImmediateConnection:
    """The part of `AsyncConnection` the append SQL uses, over a synchronous connection: each
    coroutine finishes without suspending, so `run_now` can drive it on the writer thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.dialect = conn.dialect

    async def execute(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
        return self._conn.execute(statement, *args, **kwargs)

    async def exec_driver_sql(self, statement: str, *args: Any, **kwargs: Any) -> Any:
        return self._conn.exec_driver_sql(statement, *args, **kwargs)


def run_now(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends (one awaiting only `ImmediateConnection`)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise StoreInvariantError(
        "run_now: the coroutine suspended; only coroutines over ImmediateConnection may run here"
    )
