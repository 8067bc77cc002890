"""`SyncLedger`: a `Ledger` on an event loop thread of its own (`sessions.ledger.sync`).

Each method is the async `Ledger`'s of the same name, with its parameters (`tests/ledger/test_faces.py`
holds them equal): blocking from any other thread, or `a`-prefixed and awaitable from any other
event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from types import EllipsisType
from typing import TYPE_CHECKING, Any, TypeVar

from sessions.errors import InvalidArgumentType, LedgerError, LedgerTimeout, UsageError
from sessions.failure_policy import RetryPolicy
from sessions.ledger.config import (
    ENGINE_OPTIONS,
    LedgerConfig,
    OpenOptions,
    RunSessionOptions,
    SessionOptions,
    resolve,
)
from sessions.ledger.ledger import RECORDING_TIMEOUT, Ledger
from sessions.ledger.sync.handles import SessionProxy, SyncSession
from sessions.ledger.sync.loop_thread import (
    CANCEL_GRACE,
    Remote,
    Runtime,
    closed_meanwhile,
    shutdown,
)
from sessions.projection.metrics import MetricRow
from sessions.recorder import SessionHandle, SessionOutcome

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

__all__ = ["SyncLedger"]

T = TypeVar("T")
#: A runner for `SyncLedger.run_session`: given the session's awaitable face.
ProxyRunner = Callable[[SessionProxy], Awaitable[Any]]


def _forwarded(method: Callable[..., Any], given: dict[str, Any]) -> dict[str, Any]:
    """A face's arguments for the `Ledger` method it mirrors, taken from the face's own locals by
    that method's parameter names: the face declares its (typed) signature, and this forwards
    every parameter without a third copy of the list (a missing one is a KeyError at once)."""
    return {name: given[name] for name in _parameter_names(method)}


@functools.cache
def _parameter_names(method: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(name for name in inspect.signature(method).parameters if name != "self")


# ----------------------------------------------------------------------- the ledger
class SyncLedger:
    """A `Ledger` on an event loop thread of its own, for synchronous code and other loops.

    Use `SyncLedger.open(...)` (also a context manager); `close()` when done. Thread-safe: any
    number of threads and event loops may call it at once.
    """

    def __init__(self, runtime: Runtime, call_timeout: float | None) -> None:
        self._runtime = runtime
        self._call_timeout = call_timeout
        self._finalizer = weakref.finalize(self, shutdown, runtime)

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
        runtime = Runtime(name="rollout-ledger-loop")

        async def enter() -> None:
            runtime.ledger = await runtime.stack.enter_async_context(
                Ledger.open(url, migrate=migrate, settings=settings, **engine)
            )

        opening = Remote(runtime.loop, enter())
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
            shutdown(runtime)
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
                closed_meanwhile(what)
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
                raise closed_meanwhile(what) from None
            raise

    # ------------------------------------------------------------- reading (blocking)
    def project(self) -> int:
        """Project the log to its current end; the number of events projected."""
        return self._call(self.ledger.project(), "project")

    def batch(
        self,
        partition: str,
        global_step: int | None,
        *,
        run: str | None = None,
        timeout: float | None = 60.0,
        jagged: bool = False,
        pad_token_id: int = 0,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        prompt_width: int | None = None,
        response_width: int | None = None,
        truncate: bool = False,
        poll_interval: float = 0.5,
        reward_info: bool = False,
        logprobs: bool | None = None,
    ) -> Any:
        """The step's batch (a TensorDict), as `Ledger.batch`."""
        step = self.ledger.batch(**_forwarded(Ledger.batch, locals()))
        return self._call(step, "batch")

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
        self,
        partition: str,
        global_step: int | None,
        *,
        run: str | None = None,
        timeout: float | None = 60.0,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        poll_interval: float = 0.5,
    ) -> dict[str, float]:
        """One step's metrics by name, verl's and the ledger's own (for verl's `Tracking.log`), as
        `Ledger.metrics_dict`."""
        figures = self.ledger.metrics_dict(**_forwarded(Ledger.metrics_dict, locals()))
        return self._call(figures, "metrics_dict")

    # ------------------------------------------------------------ reading (other loops)
    async def aproject(self) -> int:
        return await self._hop(self.ledger.project(), "aproject")

    async def abatch(
        self,
        partition: str,
        global_step: int | None,
        *,
        run: str | None = None,
        timeout: float | None = 60.0,
        jagged: bool = False,
        pad_token_id: int = 0,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        prompt_width: int | None = None,
        response_width: int | None = None,
        truncate: bool = False,
        poll_interval: float = 0.5,
        reward_info: bool = False,
        logprobs: bool | None = None,
    ) -> Any:
        step = self.ledger.batch(**_forwarded(Ledger.batch, locals()))
        return await self._hop(step, "abatch")

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
        self,
        partition: str,
        global_step: int | None,
        *,
        run: str | None = None,
        timeout: float | None = 60.0,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        poll_interval: float = 0.5,
    ) -> dict[str, float]:
        figures = self.ledger.metrics_dict(**_forwarded(Ledger.metrics_dict, locals()))
        return await self._hop(figures, "ametrics_dict")

    # --------------------------------------------------------- recording (blocking)
    def create_session(
        self,
        session_id: str,
        *,
        uid: str,
        session_index: int,
        group_size: int,
        partition: str,
        global_step: int | None = None,
        run: str | None = None,
        data_source: str | None = None,
        runner: str | None = None,
        sample_index: int | None = None,
        metadata: dict[str, Any] | None = None,
        attempt: int | None = None,
        timeout_s: float | None = None,
        start: bool = True,
    ) -> SyncSession:
        """Create (and start) a session, as `Ledger.create_session`; end it yourself."""
        creating = self.ledger.create_session(
            session_id,
            uid=uid,
            session_index=session_index,
            group_size=group_size,
            partition=partition,
            global_step=global_step,
            run=run,
            data_source=data_source,
            runner=runner,
            sample_index=sample_index,
            metadata=metadata,
            attempt=attempt,
            timeout_s=timeout_s,
            start=start,
        )
        return SyncSession(self, self._call(creating, "create_session"))

    def load_session(self, session_id: str) -> SyncSession:
        """A blocking handle on an existing session, as `Ledger.load_session`."""
        return SyncSession(self, self._call(self.ledger.load_session(session_id), "load_session"))

    @contextlib.contextmanager
    def session(self, session_id: str, **identity: Unpack[SessionOptions]) -> Iterator[SyncSession]:
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
        self,
        runner: ProxyRunner,
        session_id: str,
        /,
        *,
        timeout: float | None = None,
        recording_timeout: float = RECORDING_TIMEOUT,
        retry: RetryPolicy | None = None,
        **identity: Unpack[RunSessionOptions],
    ) -> SessionOutcome:
        """`Ledger.run_session` for synchronous code: the async `runner(session)` runs on a loop of
        its own in this thread (never on the ledger's)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            running = self.arun_session(
                runner,
                session_id,
                timeout=timeout,
                recording_timeout=recording_timeout,
                retry=retry,
                **identity,
            )
            return asyncio.run(running)
        raise UsageError(
            "SyncLedger.run_session blocks, and this thread runs an event loop; await "
            "SyncLedger.arun_session(...) there instead"
        )

    # ------------------------------------------------------- recording (other loops)
    @contextlib.asynccontextmanager
    async def asession(
        self, session_id: str, **identity: Unpack[SessionOptions]
    ) -> AsyncIterator[SessionProxy]:
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
        self,
        runner: ProxyRunner,
        session_id: str,
        /,
        *,
        timeout: float | None = None,
        recording_timeout: float = RECORDING_TIMEOUT,
        retry: RetryPolicy | None = None,
        **identity: Unpack[RunSessionOptions],
    ) -> SessionOutcome:
        """`Ledger.run_session` from another event loop: `runner(session)` runs on the caller's loop,
        its commands on the ledger's; timeouts, failures and cancellation end the session as there."""
        caller = asyncio.get_running_loop()

        async def on_ledger_loop(handle: SessionHandle) -> Any:
            return await Remote(caller, _invoke(runner, SessionProxy(self, handle))).wait(
                grace=None
            )

        running = self.ledger.run_session(
            on_ledger_loop,
            session_id,
            timeout=timeout,
            recording_timeout=recording_timeout,
            retry=retry,
            **identity,
        )
        return await self._hop(running, "arun_session")


async def _invoke(runner: ProxyRunner, session: SessionProxy) -> Any:
    """Call the runner on the caller's loop (so even its synchronous part runs there) and await it."""
    result = runner(session)
    if not isinstance(result, Awaitable):
        raise InvalidArgumentType(
            f"the runner returned {type(result).__name__}, not an awaitable: run_session takes an async runner "
            "(async def runner(session): ...); synchronous code records with `with ledger.session(...) as s:`"
        )
    return await result
