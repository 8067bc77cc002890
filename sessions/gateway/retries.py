"""An agent's retry of a call whose answer it never got: answered from that call, never recorded
twice.

A client retries when an answer did not reach it: it gave up waiting, the connection dropped, the
gateway was restarted. The `openai` SDK marks each retry with `x-stainless-retry-count` >= 1; other
clients send an `Idempotency-Key` that stays the same over a request's retries. A request so marked
whose key (or, without one, whose body) equals the session's last call's is that call again:

- still in flight (the client gave up waiting): the retry waits for it and gets its answer;
- answered by this process (the answer was lost on the way): the retry gets the same answer again;
- failed or refused: the retry is a new call;
- recorded by a gateway process that died before the answer left: the log holds an answer the
  agent never saw, so the conversation it goes on with is not the logged one; the session fails
  closed (`incomplete_capture`) and the retry is refused.

A request without a retry mark is a new call even when its body repeats the last one: an agent may
ask the same thing twice to sample a new answer.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.responses import Response, StreamingResponse

from sessions.gateway.refusals import Refusal
from sessions.vocabulary import INCOMPLETE_CAPTURE, INFRA

if TYPE_CHECKING:
    from sessions.recorder import SessionHandle

__all__ = ["SAMPLING_KEY", "Answer", "request_key", "retried_answer"]

#: the intent's sampling field that holds the request's key, so a restarted gateway knows a retry
SAMPLING_KEY = "gateway_request"
_RETRY_COUNT = "x-stainless-retry-count"
_IDEMPOTENCY_KEY = "idempotency-key"


@dataclass(frozen=True, slots=True)
class Answer:
    """What the agent was sent for a recorded call: a JSON body, or a stream's frames."""

    body: bytes = b""
    frames: tuple[bytes, ...] | None = None

    def response(self) -> Response:
        if self.frames is None:
            return Response(self.body, media_type="application/json")
        return StreamingResponse(_replay(self.frames), media_type="text/event-stream")


async def _replay(frames: tuple[bytes, ...]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


def request_key(raw: bytes, headers: Mapping[str, str]) -> str:
    """The request's identity over its retries: its idempotency key, else its body's digest."""
    key = headers.get(_IDEMPOTENCY_KEY)
    if key:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]
    return "body:" + hashlib.sha256(raw).hexdigest()[:32]


def is_retry(headers: Mapping[str, str]) -> bool:
    """Whether the client marked the request as a retry (or as idempotent, which allows one)."""
    if headers.get(_IDEMPOTENCY_KEY):
        return True
    try:
        return int(headers.get(_RETRY_COUNT, "0")) > 0
    except ValueError:
        return False


async def retried_answer(
    handle: SessionHandle,
    last: tuple[str, asyncio.Future[Answer | None]] | None,
    key: str,
    headers: Mapping[str, str],
) -> Response | None:
    """The answer to send when this request retries the session's last call (`last`: its key and
    answer, when this process started it); None when it is a new call. Raises `Refusal` (having
    failed the session closed) when the retried call's answer was recorded by a process that is
    gone."""
    if not is_retry(headers):
        return None
    if last is not None:  # this process served the session's last call
        if last[0] != key:
            return None
        answer = await asyncio.shield(last[1])
        return None if answer is None else answer.response()
    logged = next(reversed(handle.view.calls.values()), None)
    if logged is None or logged.sampling.get(SAMPLING_KEY) != key or logged.recorded is None:
        return None
    await handle.fail(
        INCOMPLETE_CAPTURE,
        message=f"the agent retried call {logged.call_id}, whose answer was recorded by a gateway "
        "process that stopped before sending it: the agent never saw the logged answer",
        error_type="AnswerLost",
        origin=INFRA,
    )
    raise Refusal(
        409,
        "answer_lost",
        f"call {logged.call_id}'s answer was recorded but never reached you (the gateway "
        f"restarted); session {handle.session_id!r} is failed closed ({INCOMPLETE_CAPTURE}) and takes no more "
        "calls",
    )
