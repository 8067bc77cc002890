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
from collections.abc import Awaitable, Callable
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

__all__ = ["Runner", "abort", "aborts", "outcome", "run_attempts", "settle_or_note"]

Runner = Callable[[SessionHandle], Awaitable[Any]]

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
) -> SessionOutcome:
    """Run `runner(handle)` until an attempt ends the session; the outcome. A runner's failure or
    timeout — whatever it raised but an abort — is recorded and reported, never raised; an abort
    (`_ABORTS`) is recorded as a cancellation and re-raised. Only the ledger's own errors (the
    database's) propagate otherwise."""
    while True:
        try:
            await _attempt(runner, handle, timeout)
        except BaseException as error:  # noqa: BLE001 - every one is recorded, aborts re-raised
            if aborts(error):
                await abort(handle, error)
                raise
            if handle.terminal:
                return outcome(handle, error)
            failure = recorded_failure(error)
            if await _retried(handle, retry, metric_policy, failure, timeout):
                continue
            await _record_failure(handle, failure, error)
            return outcome(handle, error)
        if not handle.terminal and not handle.view.trajectories and handle.view.state == "running":
            # complete() would fail it as empty_output: retried like a raised failure, if asked
            empty = RecordedFailure(
                EMPTY_OUTPUT,
                None,
                "the runner returned without recording a trajectory",
                "RuntimeError",
            )
            if await _retried(handle, retry, metric_policy, empty, timeout):
                continue
        if not handle.terminal:
            await handle.complete()
        return outcome(handle, None)


async def _attempt(runner: Runner, handle: SessionHandle, timeout: float | None) -> None:
    """One attempt, in this task: a timeout cancels the runner and raises `TimeoutError`, and
    whatever the runner raises (Ctrl-C, `sys.exit()` too) reaches `run_attempts` before the loop
    sees it (3.11's `wait_for` ran the runner in a task of its own, where those two escape into
    the event loop before the session's end can be recorded)."""
    if timeout is None:
        await runner(handle)
    elif _TIMEOUT is not None:
        async with _TIMEOUT(timeout):
            await runner(handle)
    else:  # Python 3.10
        await asyncio.wait_for(runner(handle), timeout)


async def _record_failure(
    handle: SessionHandle, failure: RecordedFailure, error: BaseException
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
) -> bool:
    """Record the failed attempt and start the next, if the policy retries it; a cancellation
    during the backoff cancels the session (a pure abort) and propagates."""
    reason = failure.reason
    origin = metric_policy.origin(reason, failure.origin)  # type: ignore[arg-type]
    if handle.view.state != "running" or not retry.retries(reason, origin, handle.attempt):
        return False
    wait = retry.backoff(handle.attempt)
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
