"""Where the runners run: one event loop thread for the wrapper's life, and a thread per call of a
synchronous runner.

TRL calls `rollout_func` synchronously. The sessions of one call run concurrently on a loop the
wrapper keeps (an async runner's clients stay bound to one loop across calls; the ledger's own
loop is `SyncLedger`'s, never this one). A synchronous runner cannot be interrupted, so each call
gets a daemon thread of its own: when its session times out the ledger stops waiting, records
the timeout, and a hung call holds only its own thread, never a worker the next session needs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["RunnerLoop", "in_thread"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class RunnerLoop:
    """An event loop on a daemon thread; `run(coro)` blocks the caller until the coroutine ends."""

    def __init__(self, name: str = "rollout-ledger-trl") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:  # KeyboardInterrupt here: cancel the sessions (recorded cancelled)
            future.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def in_thread(fn: Callable[[], T], name: str) -> T:
    """`fn()` on a new daemon thread, awaited; cancelling the await abandons the thread."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # the session was cancelled or timed out meanwhile
            log.warning(
                "rollout-ledger: a synchronous runner (%s) returned after its session ended", name
            )
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def work() -> None:
        try:
            value = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting session
            result = (False, error)
        else:
            result = (True, value)
        try:
            loop.call_soon_threadsafe(settle, *result)
        except RuntimeError:  # the loop closed: nobody waits for this call any more
            pass

    threading.Thread(target=work, name=f"rollout-ledger-runner {name}", daemon=True).start()
    return await future
