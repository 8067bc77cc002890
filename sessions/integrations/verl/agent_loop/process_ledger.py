"""One ``Ledger`` per worker process, opened on first use and shared by every agent-loop object.

verl builds a new agent-loop object for every sample of every step (docs/design.md §13), so a
ledger opened per object would pay a connection pool and a schema check per sample. Each
``AgentLoopWorker`` is a process of its own (a Ray actor) running one event loop, and a
``Ledger`` serves the loop it was opened on: so there is one ledger per (event loop, settings),
opened by the first agent loop that needs it (the others wait for that one open) and kept
until ``close_process_ledgers()`` or the end of the process. Every command a session sends is
committed before it returns, so a worker that is killed loses no recorded event.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from dataclasses import dataclass, field

from sessions.integrations.ledger_check import open_checked
from sessions.integrations.verl.agent_loop.settings import URL_SETTING, LedgerSettings
from sessions.ledger import Ledger

__all__ = ["close_process_ledgers", "process_ledger"]


@dataclass
class _Opened:
    ready: asyncio.Future[Ledger]
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)


#: event loop -> settings -> its ledger (a loop that is collected takes its entries with it)
_LEDGERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[LedgerSettings, _Opened]] = (
    weakref.WeakKeyDictionary()
)


async def process_ledger(settings: LedgerSettings) -> Ledger:
    """The ledger for ``settings`` on the running event loop, opened (and migrated) once."""
    opened = _LEDGERS.setdefault(asyncio.get_running_loop(), {})
    entry = opened.get(settings)
    if entry is None:
        entry = opened[settings] = _Opened(asyncio.get_running_loop().create_future())
        try:
            ledger = await entry.stack.enter_async_context(
                open_checked(settings.url, setting=URL_SETTING, **settings.ledger_options())
            )
        except BaseException as error:
            del opened[settings]  # the next agent loop tries again
            if isinstance(error, Exception):
                entry.ready.set_exception(error)
                entry.ready.exception()  # retrieved: the waiters (if any) re-raise it themselves
            else:
                entry.ready.cancel()
            raise
        entry.ready.set_result(ledger)
    return await asyncio.shield(entry.ready)


async def close_process_ledgers() -> int:
    """Close the ledgers opened on the running event loop; returns how many were closed."""
    opened = _LEDGERS.pop(asyncio.get_running_loop(), {})
    for entry in opened.values():
        if entry.ready.done() and not entry.ready.cancelled():
            await entry.stack.aclose()  # a failed open was removed; one still opening is left
    return len(opened)
