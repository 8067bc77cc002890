"""Futures whose waiters' cancellation waits for the outcome.

A task cancelled while it awaits a future is normally cancelled at once, and the future with it.
For an append that may still commit, the caller must first learn whether it did, so its view of
the session stays true to the log. `asyncio.shield` plus a second await gives that, but allocates
an outer future, two closures and copied contexts for every await, and on the recorder's path
they all live until the commit: long enough for the cyclic collector to promote them (issue 18).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["DeferredCancelFuture", "deferred_cancel"]


class DeferredCancelFuture(asyncio.Future):  # type: ignore[type-arg]
    """A future that refuses `cancel()`.

    asyncio defers the cancellation of a task whose awaited future refuses it: the task receives
    `CancelledError` once the future is settled, and the outcome can then be read from it.
    """

    def cancel(self, msg: Any = None) -> bool:
        return False


def deferred_cancel(task: asyncio.Future[Any]) -> DeferredCancelFuture:
    """A `DeferredCancelFuture` settled as `task` is, for many waiters that must not cancel it."""
    mirror = DeferredCancelFuture(loop=task.get_loop())

    def settle(done: asyncio.Future[Any]) -> None:
        if done.cancelled():
            asyncio.Future.cancel(mirror)
        elif done.exception() is not None:
            mirror.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            mirror.set_result(done.result())

    task.add_done_callback(settle)
    return mirror
