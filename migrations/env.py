"""Alembic environment, async-aware.

Used two ways: by the `alembic` command (it makes its own async engine), and by the library,
which hands in an open connection through `config.attributes["connection"]` so that migrating
on open happens inside the caller's transaction and lock.
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection

from store.dialects import dialect_of
from store.engine import ENV_VAR, create_engine, normalize_url
from store.schema.tables import metadata

config = context.config
target_metadata = metadata


def _url() -> str:
    x_args = context.get_x_argument(as_dictionary=True)
    return normalize_url(
        x_args.get("db") or os.environ.get(ENV_VAR) or config.get_main_option("sqlalchemy.url")
    )


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=dialect_of(connection).alembic_batch,
    )


def _run_with(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = create_engine(_url())
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_run_with)
    finally:
        await engine.dispose()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_with(connection)
    else:
        asyncio.run(_run_async())


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
