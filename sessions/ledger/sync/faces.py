"""`SyncLedger`, `SyncSession` and `SessionProxy`, derived from `Ledger` and `SessionHandle`.

`derive` gives a face every public `async def` of its original as a method that runs it on the
ledger's loop (blocking, or awaitable from another loop), with the original's signature and
docstring, and every property read through; a `SessionHandle` a method returns comes back as the
face's session. `OWN` names what `SyncLedger` writes itself instead, and why. Editors read the
faces' types from `faces.pyi`, written by `python -m sessions.ledger.stubgen`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from sessions.errors import InvalidArgumentType, LedgerError, UsageError
from sessions.ledger.config import (
    ENGINE_OPTIONS,
    LedgerConfig,
    OpenOptions,
    SessionOptions,
    resolve,
)
from sessions.ledger.ledger import Ledger
from sessions.ledger.sync.loop_thread import Remote, Runtime, closed_meanwhile, shutdown
from sessions.recorder import SessionHandle, SessionOutcome

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

__all__ = ["OWN", "SessionProxy", "SyncLedger", "SyncSession", "derive"]

T = TypeVar("T")
Face = TypeVar("Face", bound=type)

#: What `SyncLedger` writes itself instead of deriving it from `Ledger`, or adds, and why. Every
#: other public member of `Ledger` it derives; the session faces derive all of `SessionHandle`.
OWN: dict[str, str] = {
    "open": "opens its Ledger on a loop thread of its own; call_timeout, open_timeout bound the calls, the opening",
    "close": "stops and joins that thread too, so no awaitable twin: a loop awaiting it would block on the join",
    "session": "with asession: context managers whose block runs in the caller's thread or on its loop",
    "run_session": "with arun_session: the runner runs on the caller's loop with a SessionProxy, not on the ledger's",
    "closed": "added: whether close() has run (every later call raises LedgerClosed)",
    "ledger": "added: the async Ledger inside, for code that runs on its loop (a sink)",
    "loop": "added: the event loop the ledger runs on",
    "run": "added: the ledger's run",
}


def derive(
    original: type,
    *,
    blocking: bool = True,
    awaitable: str | None = None,
    own: Collection[str] = (),
) -> Callable[[Face], Face]:
    """A class decorator: the face gets each public `async def` of `original` not in `own` as a
    blocking method (`blocking`) and as an awaitable one named `awaitable + name` (`awaitable` not
    None), and each property read through. The face's `_target` is the original object, its
    `_owner` the `SyncLedger` whose loop runs the calls."""

    def give(face: Face) -> Face:
        members: dict[str, Any] = {}
        for klass in reversed(original.__mro__[:-1]):
            members.update((n, m) for n, m in vars(klass).items() if not n.startswith("_"))
        for name, member in members.items():
            if name in own:
                continue
            if isinstance(member, property):
                setattr(face, name, property(_carried(face, name, member.fget, _reader(name))))
            elif inspect.iscoroutinefunction(member):
                faces = [(name, False)] if blocking else []
                faces += [] if awaitable is None else [(awaitable + name, True)]
                for face_name, awaits in faces:
                    setattr(face, face_name, _method(face, face_name, member, awaits))
        face._original = original  # type: ignore[attr-defined]
        return face

    return give


def _reader(name: str) -> Callable[[Any], Any]:
    return lambda self: getattr(self._target, name)


def _method(face: type, name: str, function: Callable[..., Any], awaits: bool) -> Any:
    """`function` as the face's method `name`: it runs on the ledger's loop, and a `SessionHandle`
    it returns comes back as the face's session."""
    signature = inspect.signature(function)
    session = None
    if signature.return_annotation in ("SessionHandle", SessionHandle):
        session = SessionProxy if awaits else SyncSession
        signature = signature.replace(return_annotation=session.__name__)
    command = function.__name__

    def answer(self: Any, result: Any) -> Any:
        return result if session is None else session(self._owner, result)

    async def awaitable(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        coro = getattr(self._target, command)(*args, **kwargs)
        return answer(self, await self._owner._hop(coro, name))

    def blocking(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        coro = getattr(self._target, command)(*args, **kwargs)
        return answer(self, self._owner._call(coro, name))

    return _carried(face, name, function, awaitable if awaits else blocking, signature)


def _carried(face: type, name: str, original: Any, method: Any, signature: Any = None) -> Any:
    """`method` named as the face's `name`, with `original`'s docstring and signature."""
    method.__name__, method.__qualname__ = name, f"{face.__qualname__}.{name}"
    method.__module__, method.__doc__ = face.__module__, original.__doc__
    method.__wrapped__, method.__signature__ = original, signature or inspect.signature(original)
    return method


def _runner_parameters(method: Callable[..., T]) -> Callable[..., T]:
    """Give a face's run_session `Ledger.run_session`'s parameters, its runner handed a `SessionProxy`."""
    signature = inspect.signature(Ledger.run_session)
    runner = signature.parameters["runner"].replace(
        annotation="Callable[[SessionProxy], Awaitable[Any]]"
    )
    parameters = [runner if p.name == "runner" else p for p in signature.parameters.values()]
    method.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    method.__wrapped__ = Ledger.run_session  # type: ignore[attr-defined]
    return method


# ---------------------------------------------------------------------------- sessions
class _SessionFace:
    """A `SessionHandle` (on the ledger's loop) and the `SyncLedger` whose loop runs its commands."""

    def __init__(self, owner: SyncLedger, handle: SessionHandle) -> None:
        self._owner = owner
        self._target = handle

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._target.session_id!r}, state={self._target.state!r})"


@derive(SessionHandle)
class SyncSession(_SessionFace):
    """A session's commands as blocking calls, each `SessionHandle`'s run on the ledger's loop."""


@derive(SessionHandle, blocking=False, awaitable="")
class SessionProxy(_SessionFace):
    """A session's commands, awaitable from any event loop; each runs on the ledger's loop."""


# ------------------------------------------------------------------------------ ledger
@derive(Ledger, awaitable="a", own=OWN)
class SyncLedger:
    """A `Ledger` on an event loop thread of its own, for synchronous code and other loops.

    Use `SyncLedger.open(...)` (also a context manager); `close()` when done. Thread-safe: any
    number of threads and event loops may call it at once. Each `Ledger` call is here blocking
    (`batch`) and awaitable from another loop (`abatch`), with its parameters.
    """

    _original: ClassVar[type[Ledger]] = Ledger

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
            opening = cls._original.open(url, migrate=migrate, settings=settings, **engine)
            runtime.ledger = await runtime.stack.enter_async_context(opening)

        try:
            opened = Remote(runtime.loop, enter())
            timed_out = (
                f"SyncLedger.open: the database did not open within open_timeout={open_timeout}s"
            )
            opened.block(open_timeout, timed_out)
            opened.future.result()
        except BaseException:
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
        """Whether `close()` has run: every call after it raises `LedgerClosed`."""
        return self._runtime.closed

    @property
    def ledger(self) -> Ledger:
        """The async `Ledger` inside; await its methods only on `loop` (e.g. in a sink)."""
        assert self._runtime.ledger is not None
        return self._runtime.ledger

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the ledger runs on, in the thread this face owns."""
        return self._runtime.loop

    @property
    def run(self) -> str:
        """The ledger's run (`LedgerConfig.run`)."""
        return self.ledger.run

    _target = ledger  # what the derived methods call

    @property
    def _owner(self) -> SyncLedger:  # whose loop runs the derived methods' calls
        return self

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
        timed_out = f"SyncLedger.{what}: no answer within call_timeout={self._call_timeout}s; the call was cancelled"
        remote.block(self._call_timeout, timed_out)
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
            leaving = context.__aexit__(type(error), error, error.__traceback__)
            if not self._call(leaving, "session (exit)"):
                raise
        else:
            self._call(context.__aexit__(None, None, None), "session (exit)")

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
            leaving = context.__aexit__(type(error), error, error.__traceback__)
            if not await self._hop(leaving, "asession (exit)"):
                raise
        else:
            await self._hop(context.__aexit__(None, None, None), "asession (exit)")

    @_runner_parameters
    def run_session(
        self, runner: Callable[[SessionProxy], Awaitable[Any]], session_id: str, /, **options: Any
    ) -> SessionOutcome:
        """`Ledger.run_session` for synchronous code: the async `runner(session)` runs on a loop of
        its own in this thread (never on the ledger's)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun_session(runner, session_id, **options))
        raise UsageError(
            "SyncLedger.run_session blocks, and this thread runs an event loop; await "
            "SyncLedger.arun_session(...) there instead"
        )

    @_runner_parameters
    async def arun_session(
        self, runner: Callable[[SessionProxy], Awaitable[Any]], session_id: str, /, **options: Any
    ) -> SessionOutcome:
        """`Ledger.run_session` from another event loop: `runner(session)` runs on the caller's loop,
        its commands on the ledger's; timeouts, failures and cancellation end the session as there."""
        caller = asyncio.get_running_loop()

        async def on_ledger_loop(handle: SessionHandle) -> Any:
            session = SessionProxy(self, handle)
            return await Remote(caller, _invoke(runner, session)).wait(grace=None)

        running = self.ledger.run_session(on_ledger_loop, session_id, **options)
        return await self._hop(running, "arun_session")


async def _invoke(runner: Callable[[SessionProxy], Awaitable[Any]], session: SessionProxy) -> Any:
    """Call the runner on the caller's loop (so even its synchronous part runs there) and await it."""
    result = runner(session)
    if not isinstance(result, Awaitable):
        raise InvalidArgumentType(
            f"the runner returned {type(result).__name__}, not an awaitable: run_session takes an async runner "
            "(async def runner(session): ...); synchronous code records with `with ledger.session(...) as s:`"
        )
    return await result
