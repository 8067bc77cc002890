"""`SyncLedger`: the ledger for synchronous code (verl's V0 `RayPPOTrainer.fit`) and for threads.

`Ledger` is async, and what it hands out belongs to the event loop it was opened on: its engine's
connections, its group-commit worker, its handles. A synchronous trainer would have to run a loop
by hand around every call, and could not keep the ledger across two `asyncio.run(...)` calls.

A `SyncLedger` owns one `Ledger` on an event loop of its own, in a thread of its own, for its
whole life. Every call hops onto that loop and the ledger's objects never leave it:

- blocking calls (`batch`, `metrics`, `project`, `with ledger.session(...)`, ...) from any thread
  that is not the ledger's own;
- awaitable calls (`arun_session`, `async with ledger.asession(...)`, `abatch`, ...) from any
  other event loop, whose runner code runs on the caller's loop, never on the ledger's.

Errors raised on the ledger's loop re-raise in the caller as the same object (type, message and
attributes intact). A call after `close()` raises `LedgerClosed` at once; a blocking call from the
ledger's own loop thread (it would wait on itself forever) raises `UsageError`; a caller that is
interrupted (Ctrl-C, cancellation, `call_timeout`) cancels its call on the ledger's loop and waits,
bounded, until the cancellation has been recorded, so the loop is never left stuck.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from types import EllipsisType
from typing import TYPE_CHECKING, Any, TypeVar

from sessions.config import ENGINE_OPTIONS, LedgerConfig, OpenOptions, resolve
from sessions.errors import (
    InvalidArgumentType,
    LedgerClosed,
    LedgerError,
    LedgerTimeout,
    UsageError,
)
from sessions.ledger import RECORDING_TIMEOUT, Ledger
from sessions.projection.metrics import MetricRow
from sessions.recorder import SessionHandle, SessionOutcome

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

__all__ = ["CANCEL_GRACE", "SessionProxy", "SyncLedger", "SyncSession"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds an interrupted caller waits for its cancelled call to finish on the ledger's loop (a
#: session's cancellation being recorded); longer than the ledger's own `RECORDING_TIMEOUT`.
CANCEL_GRACE = RECORDING_TIMEOUT + 5.0
#: Seconds `close()` waits for the loop thread to end once the ledger is closed.
JOIN_TIMEOUT = 30.0


# ---------------------------------------------------------------- a task on another loop
class _Remote:
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
class _Runtime:
    """The event loop thread, the ledger on it, and the calls under way there."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.lock = threading.Lock()
        self.closed = False
        self.ledger: Ledger | None = None
        self.stack = contextlib.AsyncExitStack()
        self.tasks: set[asyncio.Task[Any]] = set()  # touched on the loop only
        self._stopping = False
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

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

    def submit(self, coro: Coroutine[Any, Any, T], what: str) -> _Remote:
        """Start `coro` on the loop, or refuse (closing it) when the ledger is closed."""
        with self.lock:
            if self.closed:
                coro.close()
                raise LedgerClosed(
                    f"SyncLedger.{what}: this SyncLedger is closed; open another with SyncLedger.open(...)"
                )
            return _Remote(self.loop, coro, self.tasks)

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


def _shutdown(runtime: _Runtime) -> None:
    """Close the ledger on its loop, stop the loop, join its thread. Runs once (weakref.finalize:
    on `close()`, when the SyncLedger is collected, or at interpreter exit)."""
    with runtime.lock:
        runtime.closed = True
    if runtime.on_loop_thread():  # collected on its own loop: close without blocking it
        runtime.loop.create_task(runtime.aclose()).add_done_callback(lambda _: runtime.stop())
        return
    try:
        asyncio.run_coroutine_threadsafe(runtime.aclose(), runtime.loop).result(
            CANCEL_GRACE + JOIN_TIMEOUT
        )
    finally:
        runtime.stop()
        runtime.thread.join(JOIN_TIMEOUT)
        if runtime.thread.is_alive():
            log.warning(
                "rollout-ledger: the SyncLedger's loop thread did not end within %ss", JOIN_TIMEOUT
            )


def _closed_meanwhile(what: str) -> LedgerClosed:
    return LedgerClosed(
        f"SyncLedger.{what}: the SyncLedger was closed while this call was under way; it was cancelled"
    )


# ----------------------------------------------------------------------- the ledger
class SyncLedger:
    """A `Ledger` on an event loop thread of its own, for synchronous code and other loops.

    Use `SyncLedger.open(...)` (also a context manager); `close()` when done. Thread-safe: any
    number of threads and event loops may call it at once.
    """

    def __init__(self, runtime: _Runtime, call_timeout: float | None) -> None:
        self._runtime = runtime
        self._call_timeout = call_timeout
        self._finalizer = weakref.finalize(self, _shutdown, runtime)

    @classmethod
    def open(
        cls,
        url: str | None = None,
        *,
        migrate: bool = True,
        settings: LedgerConfig | None = None,
        call_timeout: float | None = None,
        open_timeout: float | None = 300.0,
        **options: Unpack[OpenOptions],
    ) -> SyncLedger:
        """Open the database at `url` as `Ledger.open(url, migrate=..., settings=..., **options)`
        would, on a new loop thread; the options are checked first, in the calling thread.

        `call_timeout`: seconds any blocking call may wait before it is cancelled and raises
        `LedgerTimeout` (None: no limit beyond each call's own, e.g. `batch(timeout=...)`);
        `open_timeout`: seconds the database may take to open.
        """
        engine = {key: options.pop(key) for key in ENGINE_OPTIONS & options.keys()}
        settings = resolve(settings, options)
        runtime = _Runtime(name="rollout-ledger-loop")

        async def enter() -> None:
            runtime.ledger = await runtime.stack.enter_async_context(
                Ledger.open(url, migrate=migrate, settings=settings, **engine)
            )

        opening = _Remote(runtime.loop, enter())
        try:
            concurrent.futures.wait([opening.future], timeout=open_timeout)
            if not opening.future.done():
                opening.cancel()
                concurrent.futures.wait([opening.future], timeout=CANCEL_GRACE)
                raise LedgerTimeout(
                    f"SyncLedger.open: the database did not open within open_timeout={open_timeout}s"
                )
            opening.future.result()
        except BaseException:
            opening.cancel()
            _shutdown(runtime)
            raise
        return cls(runtime, call_timeout)

    def __enter__(self) -> SyncLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel calls still under way, close the ledger, stop and join its thread. Idempotent."""
        if self._runtime.on_loop_thread():
            raise UsageError(
                "SyncLedger.close: called on the ledger's own loop thread, which would wait on itself; close it "
                "from another thread"
            )
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._runtime.closed

    @property
    def ledger(self) -> Ledger:
        """The async `Ledger` inside; await its methods only on `loop` (e.g. in a sink)."""
        assert self._runtime.ledger is not None
        return self._runtime.ledger

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._runtime.loop

    @property
    def run(self) -> str:
        return self.ledger.run

    # ------------------------------------------------------------------ plumbing
    def _call(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """Run `coro` on the ledger's loop and block until it ends; its error re-raises here."""
        if self._runtime.on_loop_thread():
            coro.close()
            raise UsageError(
                f"SyncLedger.{what} blocks until the ledger's event loop answers, and was called on that loop's "
                "own thread, so it would wait forever; code running on the ledger's loop (a sink, a callback) "
                "must await the async Ledger (SyncLedger.ledger) instead"
            )
        remote = self._runtime.submit(coro, what)
        try:
            concurrent.futures.wait([remote.future], timeout=self._call_timeout)
        except (
            BaseException
        ):  # KeyboardInterrupt (or SystemExit) in this thread: stop the call, then go on
            remote.cancel()
            concurrent.futures.wait([remote.future], timeout=CANCEL_GRACE)
            raise
        if not remote.future.done():
            remote.cancel()
            concurrent.futures.wait([remote.future], timeout=CANCEL_GRACE)
            raise LedgerTimeout(
                f"SyncLedger.{what}: no answer within call_timeout={self._call_timeout}s; the call was cancelled"
            )
        if remote.future.cancelled():
            raise (
                _closed_meanwhile(what)
                if self.closed
                else LedgerError(f"SyncLedger.{what}: the call was cancelled on the ledger's loop")
            )
        return remote.future.result()

    async def _hop(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """Await `coro` on the ledger's loop from the caller's own loop."""
        remote = self._runtime.submit(coro, what)
        try:
            return await remote.wait()
        except asyncio.CancelledError:
            if remote.future.cancelled() and self.closed:
                raise _closed_meanwhile(what) from None
            raise

    # ------------------------------------------------------------- reading (blocking)
    def project(self) -> int:
        """Project the log to its current end; the number of events projected."""
        return self._call(self.ledger.project(), "project")

    def batch(self, partition: str, global_step: int | None, **options: Any) -> Any:
        """The step's batch (a TensorDict); options as `Ledger.batch` (timeout, jagged, ...)."""
        return self._call(self.ledger.batch(partition, global_step, **options), "batch")

    def metrics(
        self,
        partition: str | None = None,
        global_step: int | None | EllipsisType = ...,
        *,
        run: str | None = None,
        project: bool = True,
    ) -> list[MetricRow]:
        """Metric counts, as `Ledger.metrics`."""
        return self._call(
            self.ledger.metrics(partition, global_step, run=run, project=project), "metrics"
        )

    def metrics_dict(
        self, partition: str, global_step: int | None, **options: Any
    ) -> dict[str, float]:
        """One step's metrics by name, verl's and the ledger's own (for verl's `Tracking.log`);
        options as `Ledger.metrics_dict` (run, timeout, ...)."""
        return self._call(
            self.ledger.metrics_dict(partition, global_step, **options), "metrics_dict"
        )

    # ------------------------------------------------------------ reading (other loops)
    async def aproject(self) -> int:
        return await self._hop(self.ledger.project(), "aproject")

    async def abatch(self, partition: str, global_step: int | None, **options: Any) -> Any:
        return await self._hop(self.ledger.batch(partition, global_step, **options), "abatch")

    async def ametrics(
        self,
        partition: str | None = None,
        global_step: int | None | EllipsisType = ...,
        *,
        run: str | None = None,
        project: bool = True,
    ) -> list[MetricRow]:
        return await self._hop(
            self.ledger.metrics(partition, global_step, run=run, project=project), "ametrics"
        )

    async def ametrics_dict(
        self, partition: str, global_step: int | None, **options: Any
    ) -> dict[str, float]:
        return await self._hop(
            self.ledger.metrics_dict(partition, global_step, **options), "ametrics_dict"
        )

    # --------------------------------------------------------- recording (blocking)
    def create_session(self, session_id: str, **identity: Any) -> SyncSession:
        """Create (and start) a session, as `Ledger.create_session`; end it yourself."""
        return SyncSession(
            self, self._call(self.ledger.create_session(session_id, **identity), "create_session")
        )

    def load_session(self, session_id: str) -> SyncSession:
        """A blocking handle on an existing session, as `Ledger.load_session`."""
        return SyncSession(self, self._call(self.ledger.load_session(session_id), "load_session"))

    @contextlib.contextmanager
    def session(self, session_id: str, **identity: Any) -> Iterator[SyncSession]:
        """`Ledger.session` for synchronous code, exiting exactly as it does (it runs on the loop):
        normal exit completes the session; an Exception fails it (TimeoutError: reason timeout) and
        re-raises; KeyboardInterrupt / SystemExit cancel it and re-raise."""
        context = self.ledger.session(session_id, **identity)
        handle = self._call(context.__aenter__(), "session")
        try:
            yield SyncSession(self, handle)
        except BaseException as error:
            if not self._call(
                context.__aexit__(type(error), error, error.__traceback__), "session (exit)"
            ):
                raise
        else:
            self._call(context.__aexit__(None, None, None), "session (exit)")

    def run_session(
        self, runner: Callable[[SessionProxy], Awaitable[Any]], session_id: str, /, **options: Any
    ) -> SessionOutcome:
        """`Ledger.run_session` for synchronous code: the async `runner(session)` runs on a loop of
        its own in this thread (never on the ledger's); options as `Ledger.run_session`."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun_session(runner, session_id, **options))
        raise UsageError(
            "SyncLedger.run_session blocks, and this thread runs an event loop; await "
            "SyncLedger.arun_session(...) there instead"
        )

    # ------------------------------------------------------- recording (other loops)
    @contextlib.asynccontextmanager
    async def asession(self, session_id: str, **identity: Any) -> AsyncIterator[SessionProxy]:
        """`Ledger.session` for another event loop; exits exactly as it does (cancellation cancels)."""
        context = self.ledger.session(session_id, **identity)
        handle = await self._hop(context.__aenter__(), "asession")
        try:
            yield SessionProxy(self, handle)
        except BaseException as error:
            if not await self._hop(
                context.__aexit__(type(error), error, error.__traceback__), "asession (exit)"
            ):
                raise
        else:
            await self._hop(context.__aexit__(None, None, None), "asession (exit)")

    async def arun_session(
        self, runner: Callable[[SessionProxy], Awaitable[Any]], session_id: str, /, **options: Any
    ) -> SessionOutcome:
        """`Ledger.run_session` from another event loop: `runner(session)` runs on the caller's loop,
        its commands on the ledger's; timeouts, failures and cancellation end the session as there."""
        caller = asyncio.get_running_loop()

        async def on_ledger_loop(handle: SessionHandle) -> Any:
            return await _Remote(caller, _invoke(runner, SessionProxy(self, handle))).wait(
                grace=None
            )

        return await self._hop(
            self.ledger.run_session(on_ledger_loop, session_id, **options), "arun_session"
        )


async def _invoke(runner: Callable[[SessionProxy], Awaitable[Any]], session: SessionProxy) -> Any:
    """Call the runner on the caller's loop (so even its synchronous part runs there) and await it."""
    result = runner(session)
    if not isinstance(result, Awaitable):
        raise InvalidArgumentType(
            f"the runner returned {type(result).__name__}, not an awaitable: run_session takes an async runner "
            "(async def runner(session): ...); synchronous code records with `with ledger.session(...) as s:`"
        )
    return await result


# ------------------------------------------------------------------------- handles
class _Session:
    """What both session faces share: the handle (on the ledger's loop) and its read-only state."""

    def __init__(self, owner: SyncLedger, handle: SessionHandle) -> None:
        self._owner = owner
        self._handle = handle

    @property
    def session_id(self) -> str:
        return self._handle.session_id

    @property
    def state(self) -> str:
        return self._handle.state

    @property
    def version(self) -> int:
        return self._handle.version

    @property
    def terminal(self) -> bool:
        return self._handle.terminal

    @property
    def view(self) -> Any:
        """The folded state (read-only by convention)."""
        return self._handle.view

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.session_id!r}, state={self.state!r})"


class SyncSession(_Session):
    """A session's commands as blocking calls (see `SessionHandle` for each command)."""

    def start(self, **options: Any) -> None:
        self._owner._call(self._handle.start(**options), "start")

    def record_trajectory(self, **trajectory: Any) -> int:
        return self._owner._call(self._handle.record_trajectory(**trajectory), "record_trajectory")

    def post_reward(self, reward: float | None, **info: Any) -> None:
        self._owner._call(self._handle.post_reward(reward, **info), "post_reward")

    def complete(self, **options: Any) -> str:
        return self._owner._call(self._handle.complete(**options), "complete")

    def fail(self, reason: str = "runner_error", **details: Any) -> None:
        self._owner._call(self._handle.fail(reason, **details), "fail")

    def fail_with(self, error: BaseException) -> None:
        self._owner._call(self._handle.fail_with(error), "fail_with")

    def cancel(self, message: str | None = None) -> None:
        self._owner._call(self._handle.cancel(message), "cancel")


class SessionProxy(_Session):
    """A session's commands, awaitable from any event loop (each runs on the ledger's loop)."""

    async def start(self, **options: Any) -> None:
        await self._owner._hop(self._handle.start(**options), "start")

    async def record_trajectory(self, **trajectory: Any) -> int:
        return await self._owner._hop(
            self._handle.record_trajectory(**trajectory), "record_trajectory"
        )

    async def post_reward(self, reward: float | None, **info: Any) -> None:
        await self._owner._hop(self._handle.post_reward(reward, **info), "post_reward")

    async def complete(self, **options: Any) -> str:
        return await self._owner._hop(self._handle.complete(**options), "complete")

    async def fail(self, reason: str = "runner_error", **details: Any) -> None:
        await self._owner._hop(self._handle.fail(reason, **details), "fail")

    async def fail_with(self, error: BaseException) -> None:
        await self._owner._hop(self._handle.fail_with(error), "fail_with")

    async def cancel(self, message: str | None = None) -> None:
        await self._owner._hop(self._handle.cancel(message), "cancel")
