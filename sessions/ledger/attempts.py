"""A runner driven through a session's attempts, for `Ledger.run_session`: each attempt under its
timeout; a failure the retry policy retries recorded (`AttemptFailed`) and the next attempt
started after its backoff; the last attempt's failure, success or cancellation recorded as the
session's end. Kept apart from the ledger, which only creates the session and bounds the wait.

Whatever a runner raises ends its session (docs/design.md §12, docs/failures.md): a cancellation
or the process going down (`_ABORTS`) cancels it and propagates; anything else — any `Exception`,
a `RolloutFailure` whose reason cannot be stored, an error whose `str()` raises, a
`BaseException` of the runner's own — fails it (`recorder.recorded_failure` makes the reason and
the text storable) and is reported in the outcome, never raised.
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any

from sessions.failure_policy import MetricPolicy, RetryPolicy
from sessions.recorder import (
    RecordedFailure,
    SessionHandle,
    SessionOutcome,
    error_text,
    recorded_failure,
    type_name,
)
from sessions.vocabulary import EMPTY_OUTPUT

__all__ = [
    "LOOP_BLOCK_S",
    "Deadline",
    "LoopBlocks",
    "Runner",
    "abort",
    "aborts",
    "outcome",
    "run_attempts",
    "settle_or_note",
]

Runner = Callable[[SessionHandle], Awaitable[Any]]
#: Asked before a retry the policy would make: the name of the retry budget it would pass
#: (`RetryPolicy.group_budget` / `step_budget`), or None while both have a retry left.
Budget = Callable[[SessionHandle], Awaitable["str | None"]]

#: What a runner may raise that cancels its session (a pure abort, docs/design.md §3) and then
#: propagates: a cancellation, Ctrl-C, `sys.exit()`, a coroutine being closed. The process (or the
#: caller) is stopping the work, so it is not the runner's failure, and it must not be swallowed.
_ABORTS: tuple[type[BaseException], ...] = (
    asyncio.CancelledError,
    KeyboardInterrupt,
    SystemExit,
    GeneratorExit,
)
_GROUP: Any = getattr(builtins, "BaseExceptionGroup", None)  # Python 3.11+
_TIMEOUT: Any = getattr(asyncio, "timeout", None)  # Python 3.11+


class Deadline:
    """When `run_session` stops waiting for a session, so that a timeout it reports is true: the
    runner will not run afterwards (docs/design.md §12).

    `at` (the event loop's clock) is when `run_session` returns — `timeout` per attempt, the
    retry policy's backoffs and `recording_timeout`, counted from the call. An attempt that would
    start at or after it does not start: the session is failed `timeout` instead, the runner
    never called (a creation the database held that long lands as created-and-failed). An attempt
    still running then is cut, as its own timeout would cut it. `given_up` is set when
    `run_session` has returned `recording`; after that no attempt starts whatever the clock says.
    """

    __slots__ = ("at", "given_up")

    def __init__(self, at: float) -> None:
        self.at = at
        self.given_up = False

    def may_start(self, after: float = 0.0) -> bool:
        """Whether an attempt may start `after` seconds from now."""
        now = asyncio.get_running_loop().time()
        return not self.given_up and now + after < self.at

    def attempt_timeout(self, timeout: float | None) -> float:
        """An attempt's timeout, cut so that it ends by the time `run_session` returns."""
        left = max(0.0, self.at - asyncio.get_running_loop().time())
        return left if timeout is None else min(timeout, left)


log = logging.getLogger(__name__)

#: A runner step (its code between two awaits) longer than this blocked the event loop: every
#: other session of the loop stood still meanwhile. Such blocks are logged and named in the
#: timeouts they caused (docs/design.md §12).
LOOP_BLOCK_S = 0.2


@dataclass(frozen=True, slots=True)
class _LoopBlock:
    """A runner step that held the event loop `seconds` long, ending at `ended` (loop clock)."""

    session_id: str
    runner: str
    seconds: float
    ended: float

    def overlaps(self, start: float, end: float) -> bool:
        return self.ended > start and self.ended - self.seconds < end


class LoopBlocks:
    """The recent blocks of one event loop by its runners (a bounded record), so that a session
    the block starved of its time is told what took it instead of timing out in silence."""

    def __init__(self, keep: int = 1024) -> None:
        self._blocks: deque[_LoopBlock] = deque(maxlen=keep)
        self._warned: set[str] = set()

    def add(self, block: _LoopBlock) -> None:
        self._blocks.append(block)
        level = logging.DEBUG if block.runner in self._warned else logging.WARNING
        self._warned.add(block.runner)
        log.log(
            level,
            "runner %s (session %s) blocked the event loop for %.2fs: a synchronous call inside an "
            "async runner stops every session of the loop (run it with asyncio.to_thread, or an "
            "async client)",
            block.runner,
            block.session_id,
            block.seconds,
        )

    def during(self, start: float, end: float) -> list[_LoopBlock]:
        """The blocks that overlap the interval from `start` to `end` (loop clock)."""
        return [block for block in self._blocks if block.overlaps(start, end)]


def _runner_name(runner: Any) -> str:
    """How a message names a runner: its module and qualified name, or its type's."""
    named = runner if hasattr(runner, "__qualname__") else type(runner)
    module = getattr(named, "__module__", None)
    qualname = getattr(named, "__qualname__", repr(runner))
    return f"{module}.{qualname}" if module else qualname


class _TimedSteps:
    """Drives a runner's coroutine as a task would, timing each step (the code between two
    awaits); a step of `LOOP_BLOCK_S` or longer is a block of the loop, recorded in `blocks`."""

    __slots__ = ("_blocks", "_coro", "_runner", "_session_id")

    def __init__(self, coro: Any, blocks: LoopBlocks, session_id: str, runner: str) -> None:
        self._coro, self._blocks = coro, blocks
        self._session_id, self._runner = session_id, runner

    def __await__(self) -> Generator[Any, Any, Any]:
        send, throw, clock = self._coro.send, self._coro.throw, time.perf_counter
        value: Any = None
        error: BaseException | None = None
        while True:
            began = clock()
            try:
                signal = send(value) if error is None else throw(error)
            except StopIteration as stop:
                self._measure(clock() - began)
                return stop.value
            except BaseException:
                self._measure(clock() - began)
                raise
            self._measure(clock() - began)
            try:
                value, error = (yield signal), None
            except BaseException as thrown:  # a cancellation: passed on into the runner
                value, error = None, thrown

    def _measure(self, seconds: float) -> None:
        if seconds >= LOOP_BLOCK_S:
            ended = asyncio.get_running_loop().time()
            self._blocks.add(_LoopBlock(self._session_id, self._runner, seconds, ended))


def _starved(
    error: BaseException, blocks: list[_LoopBlock], session_id: str, timeout: float
) -> TimeoutError:
    """The attempt's timeout, naming the blocks of the loop that took its time."""
    longest = max(blocks, key=lambda block: block.seconds)
    total = sum(block.seconds for block in blocks)
    who = (
        "this session's own runner"
        if longest.session_id == session_id
        else f"session {longest.session_id!r}"
    )
    return TimeoutError(
        f"the attempt timed out after {timeout:g}s while the event loop was blocked for "
        f"{total:.2f}s of it ({len(blocks)} block(s)); the longest, {longest.seconds:.2f}s, by "
        f"runner {longest.runner} of {who}: a synchronous call inside an async runner stops every "
        "session of the loop — run it with asyncio.to_thread, or use an async client"
    )


def aborts(error: BaseException) -> bool:
    """Whether `error` cancels the session rather than fails it: one of `_ABORTS`, or an exception
    group holding one."""
    if isinstance(error, _ABORTS):
        return True
    return _GROUP is not None and isinstance(error, _GROUP) and error.subgroup(_ABORTS) is not None


async def run_attempts(
    handle: SessionHandle,
    runner: Runner,
    *,
    retry: RetryPolicy,
    metric_policy: MetricPolicy,
    timeout: float | None,
    deadline: Deadline | None = None,
    blocks: LoopBlocks | None = None,
    budget: Budget | None = None,
) -> SessionOutcome:
    """Run `runner(handle)` until an attempt ends the session; the outcome. A runner's failure or
    timeout — whatever it raised but an abort — is recorded and reported, never raised; an abort
    (`_ABORTS`) is recorded as a cancellation and re-raised. Only the ledger's own errors (the
    database's) propagate otherwise. With a `deadline`, no attempt starts past it (`Deadline`);
    with `blocks`, a runner step that blocks the event loop is recorded there, and the timeouts it
    caused name it. With `budget`, a retry the policy would make is first asked of the group's and
    the step's retry budgets (`RetryPolicy.group_budget` / `step_budget`): one that is spent
    refuses it, and the failure records which."""
    while True:
        if deadline is not None and not deadline.may_start():
            return await _not_started(handle, deadline)
        attempt_timeout = timeout if deadline is None else deadline.attempt_timeout(timeout)
        try:
            await _attempt(runner, handle, attempt_timeout, blocks)
        except BaseException as error:  # noqa: BLE001 - every one is recorded, aborts re-raised
            if aborts(error):
                await abort(handle, error)
                raise
            if handle.terminal:
                return outcome(handle, error)
            failure = recorded_failure(error)
            retried = await _retried(
                handle, retry, metric_policy, failure, timeout, deadline, budget
            )
            if retried is True:
                continue
            await _record_failure(handle, failure, error, retry_refused=retried or None)
            return outcome(handle, error)
        if not handle.terminal and not handle.view.trajectories and handle.view.state == "running":
            # complete() would fail it as empty_output: retried like a raised failure, if asked
            empty = RecordedFailure(
                EMPTY_OUTPUT,
                None,
                "the runner returned without recording a trajectory",
                "RuntimeError",
            )
            if (
                await _retried(handle, retry, metric_policy, empty, timeout, deadline, budget)
                is True
            ):
                continue
        if not handle.terminal:
            await handle.complete()
        return outcome(handle, None)


async def _attempt(
    runner: Runner, handle: SessionHandle, timeout: float | None, blocks: LoopBlocks | None
) -> None:
    """One attempt, in this task: a timeout cancels the runner and raises `TimeoutError`, and
    whatever the runner raises (Ctrl-C, `sys.exit()` too) reaches `run_attempts` before the loop
    sees it (3.11's `wait_for` ran the runner in a task of its own, where those two escape into
    the event loop before the session's end can be recorded). With `blocks`, the runner's steps
    are timed, and a timeout names the blocks of the loop that took the attempt's time."""
    work: Any = runner(handle)
    if blocks is not None and inspect.iscoroutine(work):
        work = _TimedSteps(work, blocks, handle.session_id, _runner_name(runner))
    if timeout is None:
        await work
        return
    began = asyncio.get_running_loop().time()
    try:
        if _TIMEOUT is not None:
            async with _TIMEOUT(timeout):
                await work
        else:  # Python 3.10
            await asyncio.wait_for(_awaited(work), timeout)
    except (TimeoutError, asyncio.TimeoutError) as error:
        starved = [] if blocks is None else blocks.during(began, asyncio.get_running_loop().time())
        if not starved:
            raise
        raise _starved(error, starved, handle.session_id, timeout) from error


async def _awaited(work: Awaitable[Any]) -> Any:
    """`work` as a coroutine (3.10's `wait_for` wants one)."""
    return await work


async def _not_started(handle: SessionHandle, deadline: Deadline) -> SessionOutcome:
    """Fail the session as `timeout` without calling its runner: the time runners were given ran
    out while the database held the session's creation (or the next attempt's start)."""
    note = (
        "run_session had already returned `timeout`"
        if deadline.given_up
        else "run_session's time had run out"
    )
    error = TimeoutError(
        f"session {handle.session_id!r}: attempt {max(handle.attempt, 1)} was not started: {note} "
        "while the database held the session's appends (a lock held elsewhere), so the runner "
        "was not called"
    )
    failure = recorded_failure(error)
    await _record_failure(handle, failure, error)
    return outcome(handle, error)


async def _record_failure(
    handle: SessionHandle,
    failure: RecordedFailure,
    error: BaseException,
    *,
    retry_refused: str | None = None,
) -> None:
    """Fail the session as `failure` says; if the database refuses even that, the ledger's error
    propagates (the runner's stays its context, and a note names it): `recover` ends the session
    later."""
    try:
        await handle.fail(
            failure.reason,
            message=failure.message,
            error_type=failure.error_type,
            origin=failure.origin,
            retry_refused=retry_refused,
        )
    except Exception as ledger_error:
        if hasattr(ledger_error, "add_note"):
            ledger_error.add_note(
                f"rollout-ledger could not record session {handle.session_id!r} as failed "
                f"({failure.reason}) after its runner raised {failure.error_type}"
            )
        raise


async def _retried(
    handle: SessionHandle,
    retry: RetryPolicy,
    metric_policy: MetricPolicy,
    failure: RecordedFailure,
    timeout: float | None,
    deadline: Deadline | None,
    budget: Budget | None = None,
) -> bool | str:
    """Record the failed attempt and start the next, if the policy retries it, its budgets have
    a retry left and the next could start before the deadline (True); the spent budget's name
    when one refused it; False otherwise. A cancellation during the backoff cancels the session
    (a pure abort) and propagates."""
    reason = failure.reason
    origin = metric_policy.origin(reason, failure.origin)  # type: ignore[arg-type]
    if handle.view.state != "running" or not retry.retries(reason, origin, handle.attempt):
        return False
    if budget is not None:
        spent = await budget(handle)
        if spent is not None:
            return spent
    wait = retry.backoff(handle.attempt)
    if deadline is not None and not deadline.may_start(after=wait):
        return False  # this attempt's failure is the session's: no attempt would start in time
    try:
        await handle.retry(
            reason,
            message=failure.message,
            error_type=failure.error_type,
            origin=origin,
            retry_in_s=wait,
        )
        if wait > 0:
            await asyncio.sleep(wait)
        await handle.start(timeout_s=timeout)
    except Exception:
        raise  # the ledger's own error (the database): not the session's to record
    except BaseException as interrupted:  # cancelled or shut down during the backoff: an abort
        await abort(handle, interrupted)
        raise
    return True


async def abort(handle: SessionHandle, error: BaseException) -> None:
    """Record a cancellation (or shutdown) of the session, then let the error propagate."""
    if not handle.terminal:
        await settle_or_note(
            asyncio.shield(handle.cancel(f"{type_name(error)}: {error_text(error)}")), error
        )


def outcome(handle: SessionHandle, error: BaseException | None) -> SessionOutcome:
    """What `run_session` reports of a session that ended (or was left) as `handle` says."""
    return SessionOutcome(
        handle.session_id,
        handle.state,
        handle.view.failure_reason,
        error,
        max(handle.attempt, 1),
    )


async def settle_or_note(settle: Awaitable[Any], original: BaseException) -> None:
    """Record the session's end; if even that fails, keep the original error as the one raised."""
    try:
        await settle
    except Exception as error:  # noqa: BLE001
        if hasattr(original, "add_note"):
            original.add_note(f"rollout-ledger could not record the session's end: {error}")
        raise original from error
