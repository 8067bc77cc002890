"""A runner driven through a session's attempts, for `Ledger.run_session`: each attempt under its
timeout; a failure the retry policy retries recorded (`AttemptFailed`) and the next attempt
started after its backoff; the last attempt's failure, success or cancellation recorded as the
session's end. Kept apart from the ledger, which only creates the session and bounds the wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from sessions.failure_policy import MetricPolicy, RetryPolicy
from sessions.recorder import SessionHandle, SessionOutcome, failure_origin, failure_reason

__all__ = ["Runner", "abort", "outcome", "run_attempts", "settle_or_note"]

Runner = Callable[[SessionHandle], Awaitable[Any]]


async def run_attempts(
    handle: SessionHandle,
    runner: Runner,
    *,
    retry: RetryPolicy,
    metric_policy: MetricPolicy,
    timeout: float | None,
) -> SessionOutcome:
    """Run `runner(handle)` until an attempt ends the session; the outcome. A runner's failure or
    timeout is recorded and reported, never raised; cancellation is recorded and re-raised."""
    while True:
        try:
            if timeout is None:
                await runner(handle)
            else:
                await asyncio.wait_for(runner(handle), timeout)
        except Exception as error:
            if handle.terminal:
                return outcome(handle, error)
            reason = failure_reason(error)
            origin = failure_origin(error)
            if await _retried(handle, retry, metric_policy, reason, origin, error, timeout):
                continue
            await settle_or_note(handle.fail_with(error), error)
            return outcome(handle, error)
        except BaseException as error:
            await abort(handle, error)
            raise
        if not handle.terminal and not handle.view.trajectories and handle.view.state == "running":
            # complete() would fail it as empty_output: retried like a raised failure, if asked
            empty = RuntimeError("the runner returned without recording a trajectory")
            if await _retried(handle, retry, metric_policy, "empty_output", None, empty, timeout):
                continue
        if not handle.terminal:
            await handle.complete()
        return outcome(handle, None)


async def _retried(
    handle: SessionHandle,
    retry: RetryPolicy,
    metric_policy: MetricPolicy,
    reason: str,
    origin: str | None,
    error: BaseException,
    timeout: float | None,
) -> bool:
    """Record the failed attempt and start the next, if the policy retries it; a cancellation
    during the backoff cancels the session (a pure abort) and propagates."""
    origin = metric_policy.origin(reason, origin)  # type: ignore[arg-type]
    if handle.view.state != "running" or not retry.retries(reason, origin, handle.attempt):
        return False
    wait = retry.backoff(handle.attempt)
    message = str(error) or repr(error)
    try:
        await handle.retry(
            reason,
            message=message,
            error_type=type(error).__qualname__,
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
            asyncio.shield(handle.cancel(f"{type(error).__name__}: {error}")), error
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
