"""A server the runner could not reach is an infrastructure failure, retried by default
(docs/failures.md, "What a runner raises").

Python's `ConnectionError`, the transport errors of the HTTP clients runners call their LLM
server with (and their timeouts), an HTTP 5xx / 408 / 429 answer, and an error raised `from` one
of them are recorded as `connection_error`, origin `infra`: `RetryPolicy(max_attempts=2)` alone
(its default `on=("infra",)`) retries them. A plain `TimeoutError` stays the session's `timeout`,
and a 4xx answer the runner's own `runner_error`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessions import Ledger, MetricPolicy, RetryPolicy, ServerConnectionError
from sessions.recorder import recorded_failure
from sessions.runner_failure import is_connection_error

KW: dict[str, Any] = {"session_index": 0, "group_size": 1, "partition": "train", "global_step": 0}

BUILTIN_CONNECTION_ERRORS = [
    ConnectionError,
    ConnectionRefusedError,
    ConnectionResetError,
    ConnectionAbortedError,
    BrokenPipeError,
]


def reason_and_origin(error: BaseException) -> tuple[str, str]:
    failure = recorded_failure(error)
    return failure.reason, MetricPolicy().origin(failure.reason, failure.origin)


@given(
    kind=st.sampled_from(BUILTIN_CONNECTION_ERRORS),
    text=st.text(max_size=40),
    wrappers=st.lists(st.sampled_from([RuntimeError, ValueError, OSError]), max_size=3),
)
def test_a_connection_error_raised_directly_or_from_another_is_infra(
    kind: type[BaseException], text: str, wrappers: list[type[Exception]]
) -> None:
    error: BaseException = kind(text)
    for wrapper in wrappers:  # `raise RuntimeError("generation failed") from error`
        outer = wrapper(f"wrapped: {text}")
        outer.__cause__ = error
        error = outer
    assert is_connection_error(error)
    assert reason_and_origin(error) == ("connection_error", "infra")


@pytest.mark.parametrize(
    "error, reason",
    [
        (TimeoutError("the session's own limit"), "timeout"),
        (RuntimeError("malformed tool call"), "runner_error"),
        (FileNotFoundError("no such file"), "runner_error"),  # an OSError, not a connection's
        (ServerConnectionError("the LLM server is gone"), "connection_error"),
    ],
)
def test_other_errors_keep_their_reasons(error: BaseException, reason: str) -> None:
    assert recorded_failure(error).reason == reason


def test_an_implicit_context_is_not_followed() -> None:
    """Only `raise ... from` says the cause; a bug while handling a dropped connection is a bug."""
    try:
        try:
            raise ConnectionResetError("dropped")
        except ConnectionResetError:
            raise KeyError("bug in the handler")  # noqa: B904 - the implicit context is the point
    except KeyError as error:
        assert error.__context__ is not None
        assert recorded_failure(error).reason == "runner_error"


def test_the_http_clients_transport_errors_and_server_side_statuses() -> None:
    import httpx
    import requests

    request = httpx.Request("POST", "http://llm-server/v1/completions")

    def status(code: int) -> httpx.HTTPStatusError:
        return httpx.HTTPStatusError(
            "answer", request=request, response=httpx.Response(code, request=request)
        )

    def requests_status(code: int) -> requests.HTTPError:
        response = requests.Response()
        response.status_code = code
        return requests.HTTPError("answer", response=response)

    infra = [
        httpx.ConnectError("refused", request=request),
        httpx.ReadTimeout("read timed out", request=request),
        httpx.RemoteProtocolError("server disconnected", request=request),
        status(503),
        status(500),
        status(429),
        requests.ConnectionError("refused"),
        requests.ReadTimeout("read timed out"),
        requests_status(502),
    ]
    for error in infra:
        assert reason_and_origin(error) == ("connection_error", "infra"), repr(error)
    for error in (status(400), status(404), requests_status(422)):
        assert recorded_failure(error).reason == "runner_error", repr(error)


def test_aiohttp_and_ray_errors() -> None:
    import aiohttp
    import ray.exceptions

    for error in (
        aiohttp.ServerDisconnectedError(),
        aiohttp.ServerTimeoutError("read timeout"),  # also an asyncio.TimeoutError
        ray.exceptions.RayActorError(),
    ):
        assert reason_and_origin(error) == ("connection_error", "infra"), repr(error)
    info: Any = aiohttp.RequestInfo(
        url=aiohttp.client.URL("http://llm-server/generate"),
        method="POST",
        headers={},  # type: ignore[arg-type]
        real_url=aiohttp.client.URL("http://llm-server/generate"),
    )
    assert (
        recorded_failure(aiohttp.ClientResponseError(info, (), status=503)).reason
        == "connection_error"
    )
    assert (
        recorded_failure(aiohttp.ClientResponseError(info, (), status=401)).reason == "runner_error"
    )


async def test_the_default_retry_policy_retries_a_dropped_connection(db_url: str) -> None:
    """`RetryPolicy(max_attempts=2)` alone (what `+ledger.max_attempts=2` builds) retries it."""
    attempts: list[int] = []

    async def runner(handle: Any) -> None:
        attempts.append(handle.attempt)
        if handle.attempt == 1:
            raise ConnectionResetError("the LLM server dropped the request")
        await handle.record_trajectory(prompt_ids=[1], response_ids=[2], response_mask=[1])
        await handle.post_reward(1.0)

    async def never_reachable(handle: Any) -> None:
        raise ConnectionRefusedError("nothing listens on the LLM server's port")

    async with Ledger.open(db_url, retry_policy=RetryPolicy(max_attempts=2)) as ledger:
        outcome = await ledger.run_session(runner, "s-retried", uid="u-retried", **KW)
        failed = await ledger.run_session(never_reachable, "s-failed", uid="u-failed", **KW)
        await ledger.project()
        rows = {
            r.metric: r.value for r in await ledger.metrics("train", 0) if r.data_source is None
        }
    assert outcome.succeeded and outcome.attempts == 2 and attempts == [1, 2]
    assert (failed.state, failed.failure_reason, failed.attempts) == (
        "failed",
        "connection_error",
        2,
    )
    assert rows["retries/connection_error"] == 2
    assert rows["failed/connection_error"] == 1
    assert rows["failed_origin/infra"] == 1


async def test_a_session_timeout_during_a_call_is_still_timeout(sqlite_url: str) -> None:
    async def hangs(handle: Any) -> None:
        await asyncio.Event().wait()  # a call that never answers: the attempt's timeout ends it

    async with Ledger.open(sqlite_url, retry_policy=RetryPolicy(max_attempts=2)) as ledger:
        outcome = await ledger.run_session(hangs, "s-hangs", uid="u-hangs", timeout=0.05, **KW)
    assert (outcome.failure_reason, outcome.attempts) == ("timeout", 1)
