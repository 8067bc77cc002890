"""The event loop thread a `SyncLedger` owns, and coroutines run as tasks on another thread's loop.

`Remote` runs a coroutine on a loop from any thread and settles its future only once the task
has ended, so an interrupted caller can cancel it and still wait for the cancellation to land.
`Runtime` is the loop, its thread, the ledger on it and the calls under way there; `shutdown`
closes them once, whoever asks first (`close()`, the collector, interpreter exit).

Interpreter exit closes every open `SyncLedger` before Python shuts down its thread pools: a
`weakref.finalize` alone runs at `atexit`, after `concurrent.futures` has stopped taking work,
so a ledger closed there met `RuntimeError: cannot schedule new futures after shutdown` on its
loop thread (an unclosed `SyncLedger`, as `docs/trl.md`'s setup leaves it, ended every run with
that traceback). `_close_all_at_exit` runs among `threading`'s exit hooks instead, registered
after `concurrent.futures.thread`'s, so it runs first (they run last-registered first). While
another non-daemon thread still runs (it may be recording), it leaves the close to `atexit`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.thread  # imported before our exit hook registers: see _close_all_at_exit
import contextlib
import logging
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from sessions.errors import LedgerClosed, LedgerTimeout
from sessions.ledger.ledger import RECORDING_TIMEOUT, Ledger

__all__ = ["CANCEL_GRACE", "Remote", "Runtime", "closed_meanwhile", "shutdown"]

log = logging.getLogger("sessions.ledger.sync")
T = TypeVar("T")

#: Seconds an interrupted caller waits for its cancelled call to finish on the ledger's loop (a
#: session's cancellation being recorded); longer than the ledger's own `RECORDING_TIMEOUT`.
CANCEL_GRACE = RECORDING_TIMEOUT + 5.0
#: Seconds `close()` waits for the loop thread to end once the ledger is closed.
_JOIN_TIMEOUT = 30.0


# ---------------------------------------------------------------- a task on another loop
class Remote:
    """A coroutine run as a task on `loop` (another thread's), started from any thread.

    `future` settles only once the task has ended, so a caller that asks it to stop (`cancel`)
    can still wait for the stop to land; a cancelled task leaves `future` cancelled.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, Any],
        tasks: set[asyncio.Task[Any]] | None = None,
    ) -> None:
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._loop = loop
        self._task: asyncio.Task[Any] | None = None
        self._stop = False
        self._tasks = tasks
        try:
            loop.call_soon_threadsafe(self._start, coro)
        except RuntimeError:  # the loop is closed: nothing will ever run the coroutine
            coro.close()
            raise

    def _start(self, coro: Coroutine[Any, Any, Any]) -> None:
        if self._stop:
            coro.close()
            self._cancelled()
            return
        self._task = self._loop.create_task(coro)
        if self._tasks is not None:
            self._tasks.add(self._task)
            self._task.add_done_callback(self._tasks.discard)
        self._task.add_done_callback(self._settle)

    def _settle(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            self._cancelled()
        elif (error := task.exception()) is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(task.result())

    def _cancelled(self) -> None:
        # `notify` too: `concurrent.futures.wait` counts a cancelled future as done only once notified.
        self.future.cancel()
        self.future.set_running_or_notify_cancel()

    def cancel(self) -> None:
        """Ask the task to stop (from any thread); `future` settles once it has."""

        def stop() -> None:
            self._stop = True
            if self._task is not None:
                self._task.cancel()

        with contextlib.suppress(RuntimeError):  # the loop is closed: the task is over already
            self._loop.call_soon_threadsafe(stop)

    def block(self, timeout: float | None, timed_out: str) -> None:
        """Block this thread until the task has ended. An interruption here (Ctrl-C) or `timeout`
        seconds cancel the task and wait, bounded, for the cancellation to land before raising
        (`LedgerTimeout(timed_out)` for the timeout)."""
        try:
            done, _ = concurrent.futures.wait([self.future], timeout=timeout)
        except BaseException:  # KeyboardInterrupt (or SystemExit) in this thread
            self.cancel()
            concurrent.futures.wait([self.future], timeout=CANCEL_GRACE)
            raise
        if not done:
            self.cancel()
            concurrent.futures.wait([self.future], timeout=CANCEL_GRACE)
            raise LedgerTimeout(timed_out)

    async def wait(self, grace: float | None = CANCEL_GRACE) -> Any:
        """Await the task from the caller's own loop; cancelling the caller cancels the task and
        waits up to `grace` seconds for it to end before the cancellation goes on."""
        waiter = asyncio.wrap_future(self.future)
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            if not waiter.done():  # the caller was cancelled, not the task
                self.cancel()
                await asyncio.wait({waiter}, timeout=grace)
            raise


# -------------------------------------------------------------------- the loop thread
class Runtime:
    """The event loop thread, the ledger on it, and the calls under way there."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.lock = threading.Lock()
        self.closed = False
        self.shut = False  # shutdown has begun: it runs once
        self.ledger: Ledger | None = None
        self.stack = contextlib.AsyncExitStack()
        self.tasks: set[asyncio.Task[Any]] = set()  # touched on the loop only
        self._stopping = False
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()
        _LIVE.add(self)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            while not self._stopping:
                try:
                    self.loop.run_forever()
                except BaseException:  # noqa: BLE001 - a KeyboardInterrupt/SystemExit raised by a task
                    # was handed to that task's caller already; the loop must go on serving the others.
                    log.debug(
                        "rollout-ledger loop: a task raised a BaseException; serving on",
                        exc_info=True,
                    )
            leftover = [task for task in asyncio.all_tasks(self.loop) if not task.done()]
            for task in leftover:
                task.cancel()
            if leftover:
                self.loop.run_until_complete(asyncio.wait(leftover, timeout=CANCEL_GRACE))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            self.loop.close()

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread.ident

    def submit(self, coro: Coroutine[Any, Any, T], what: str) -> Remote:
        """Start `coro` on the loop, or refuse (closing it) when the ledger is closed."""
        with self.lock:
            if self.closed:
                coro.close()
                raise LedgerClosed(
                    f"SyncLedger.{what}: this SyncLedger is closed; open another with SyncLedger.open(...)"
                )
            return Remote(self.loop, coro, self.tasks)

    async def aclose(self) -> None:
        """On the loop: cancel the calls still under way (their sessions record the cancellation),
        then close the ledger and its engine."""
        current = asyncio.current_task()
        under_way = [task for task in self.tasks if task is not current]
        for task in under_way:
            task.cancel()
        if under_way:
            await asyncio.wait(under_way, timeout=CANCEL_GRACE)
        await self.stack.aclose()

    def stop(self) -> None:
        def stop() -> None:
            self._stopping = True
            self.loop.stop()

        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(stop)


def shutdown(runtime: Runtime) -> None:
    """Close the ledger on its loop, stop the loop, join its thread. Runs once, whoever asks
    first: `close()` or the collector (through the SyncLedger's `weakref.finalize`), or
    interpreter exit (`_close_all_at_exit`); a later ask returns at once."""
    with runtime.lock:
        runtime.closed = True
        if runtime.shut:
            return
        runtime.shut = True
    _LIVE.discard(runtime)
    if runtime.on_loop_thread():  # collected on its own loop: close without blocking it
        runtime.loop.create_task(runtime.aclose()).add_done_callback(lambda _: runtime.stop())
        return
    try:
        asyncio.run_coroutine_threadsafe(runtime.aclose(), runtime.loop).result(
            CANCEL_GRACE + _JOIN_TIMEOUT
        )
    except RuntimeError as error:
        if not _pools_stopped():
            raise
        # Closed at `atexit`, after Python stopped its thread pools (a thread still running when
        # the main thread ended kept it open; `_close_all_at_exit`): what was recorded is
        # committed, only the close's own clean-up could not run. One line, no traceback.
        log.warning("rollout-ledger: a SyncLedger closed at interpreter exit: %s", error)
    finally:
        runtime.stop()
        runtime.thread.join(_JOIN_TIMEOUT)
        if runtime.thread.is_alive():
            log.warning(
                "rollout-ledger: the SyncLedger's loop thread did not end within %ss", _JOIN_TIMEOUT
            )


#: The runtimes not shut down yet, for the exit hook; weak, so a collected one is not kept alive.
_LIVE: weakref.WeakSet[Runtime] = weakref.WeakSet()


def _close_all_at_exit() -> None:
    """Shut every runtime still open down, as `close()` would: calls under way are cancelled
    (their sessions recorded cancelled), what was recorded stays committed, the threads end.

    Registered with `threading`'s exit hooks, which run when the main thread ends, before
    non-daemon threads are joined and in the reverse order of registration; this module imports
    `concurrent.futures.thread` first, so its hook (which stops every thread pool taking work)
    runs after ours and the ledger's loop can still use its executor while it closes.

    While another non-daemon thread is still running (one the interpreter will wait for, which
    may still be recording), nothing is closed here: the SyncLedger's `weakref.finalize` closes
    it at `atexit`, once that thread has ended, as before. A failure is logged, never raised:
    the interpreter is leaving either way.
    """
    if _others_still_running():
        return
    for runtime in list(_LIVE):
        try:
            shutdown(runtime)
        except Exception as error:  # noqa: BLE001 - at exit nothing can catch it; close the others
            log.warning("rollout-ledger: closing a SyncLedger at exit failed: %r", error)


def _others_still_running() -> bool:
    """Whether a non-daemon thread other than this one and the thread pools' idle workers (which
    end only after the exit hooks) is alive: the interpreter will wait for it to end."""
    workers = set(getattr(concurrent.futures.thread, "_threads_queues", {}))
    me = threading.current_thread()
    return any(
        thread.is_alive() and not thread.daemon and thread is not me and thread not in workers
        for thread in threading.enumerate()
    )


def _pools_stopped() -> bool:
    """Whether Python's thread pools refuse new work (interpreter exit has passed their hook)."""
    return bool(getattr(concurrent.futures.thread, "_shutdown", False))


def _register_exit_hook() -> None:
    """`_close_all_at_exit` among `threading`'s exit hooks (CPython's, since 3.9), else `atexit`."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # another implementation: atexit, late but still a close
        import atexit

        atexit.register(_close_all_at_exit)
        return
    with contextlib.suppress(RuntimeError):  # imported while the interpreter is already leaving
        register(_close_all_at_exit)


_register_exit_hook()


def closed_meanwhile(what: str) -> LedgerClosed:
    return LedgerClosed(
        f"SyncLedger.{what}: the SyncLedger was closed while this call was under way; it was cancelled"
    )
