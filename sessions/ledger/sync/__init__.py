"""`SyncLedger`: the ledger for synchronous code (verl's V0 `RayPPOTrainer.fit`) and for threads.

`Ledger` is async, and what it hands out belongs to the event loop it was opened on: its engine's
connections, its group-commit worker, its handles. A synchronous trainer would have to run a loop
by hand around every call, and could not keep the ledger across two `asyncio.run(...)` calls.

A `SyncLedger` owns one `Ledger` on an event loop of its own, in a thread of its own, for its
whole life (`loop_thread`). Every call hops onto that loop and the ledger's objects never leave it:

- blocking calls (`batch`, `metrics`, `project`, `with ledger.session(...)`, ...) from any thread
  that is not the ledger's own;
- awaitable calls (`arun_session`, `async with ledger.asession(...)`, `abatch`, ...) from any
  other event loop, whose runner code runs on the caller's loop, never on the ledger's.

The faces are derived from the async originals, not written out (`faces`): each `async def` of
`Ledger` is a blocking method and an `a`-prefixed awaitable one of `SyncLedger`, each command of
`SessionHandle` a blocking one of `SyncSession` and an awaitable one of `SessionProxy`, with the
original's signature and docstring; `faces.OWN` lists what `SyncLedger` writes itself, and why.
Editors see them typed in `faces.pyi` (`python -m sessions.ledger.stubgen` writes it).

Errors raised on the ledger's loop re-raise in the caller as the same object (type, message and
attributes intact). A call after `close()` raises `LedgerClosed` at once; a blocking call from the
ledger's own loop thread (it would wait on itself forever) raises `UsageError`; a caller that is
interrupted (Ctrl-C, cancellation, `call_timeout`) cancels its call on the ledger's loop and waits,
bounded, until the cancellation has been recorded, so the loop is never left stuck.

A `SyncLedger` nobody closes is closed at interpreter exit, as `close()` would, before Python's
thread pools stop taking work (`loop_thread`), so a script that never calls `close()` ends
without a traceback and with everything it recorded committed.
"""

from sessions.ledger.sync.faces import SessionProxy, SyncLedger, SyncSession
from sessions.ledger.sync.loop_thread import CANCEL_GRACE

__all__ = ["CANCEL_GRACE", "SessionProxy", "SyncLedger", "SyncSession"]
