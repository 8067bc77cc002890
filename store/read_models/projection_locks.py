"""The locks that let several projectors share one database.

A projector page is one transaction that holds the projection lock: on SQLite the file's write
lock (`BEGIN IMMEDIATE`, taken up front so the page never meets a busy upgrade midway), on
PostgreSQL a transaction-level advisory lock. Followers of the log on PostgreSQL also elect one
leader with a session-level advisory lock, which dies with the leader's connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store.dialects import WRITE_LOCK, dialect_of
from store.faults import wrapped
from store.retry import is_transient

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def projection_page(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A connection inside a transaction that holds the projection lock; commits on a clean exit."""
    with wrapped("a projector page"):
        async with engine.connect() as conn:
            conn = await conn.execution_options(**{WRITE_LOCK: True})
            async with conn.begin():
                lock = dialect_of(conn).page_lock_sql
                if lock is not None:
                    await conn.execute(text(lock))
                yield conn


@contextlib.asynccontextmanager
async def follower_leadership(
    engine: AsyncEngine, stop: asyncio.Event, poll_interval: float
) -> AsyncIterator[bool]:
    """Yields True once this follower leads (at once where the backend elects none), or False
    if `stop` was set first. The lead is released on exit."""
    dialect = dialect_of(engine)
    if dialect.try_leader_sql is None or dialect.release_leader_sql is None:
        yield True  # a backend without an election: the page lock alone serialises followers
        return
    with wrapped("the followers' leader election"):
        async with engine.connect() as conn:
            while not stop.is_set():
                try:
                    got = (await conn.execute(text(dialect.try_leader_sql))).scalar_one()
                    await conn.commit()
                except DBAPIError as error:
                    if not is_transient(error):
                        raise
                    # A dropped connection must not end a waiting follower: poll again on a new one.
                    log.warning("leader election: %s; trying again", error.orig)
                    await conn.rollback()
                    got = False
                if got:
                    try:
                        yield True
                    finally:
                        try:
                            await conn.execute(text(dialect.release_leader_sql))
                            await conn.commit()
                        except DBAPIError as error:  # the lock went with the lost connection
                            if not is_transient(error):
                                raise
                            await conn.rollback()
                    return
                try:
                    await asyncio.wait_for(stop.wait(), poll_interval)
                except asyncio.TimeoutError:
                    pass
            yield False
