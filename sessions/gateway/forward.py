"""One model call through the gateway, recorded through the session's handle (design §15):
`start_call` before the request leaves, then `record_call` (or `fail_call`) appended before the
agent gets the answer — for a stream, before its closing `data: [DONE]`.

An answer the server gave without token ids is settled with `fail_call` (the ids are what a call
records; none is guessed) and the session is marked untrainable, so it ends failed, its calls
kept and a placeholder in the batch.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from sessions.errors import InvalidInput, LedgerError
from sessions.gateway import retries, wire
from sessions.gateway.refusals import Refusal, error_body
from sessions.gateway.upstream import NoServerAnswered

if TYPE_CHECKING:
    from sessions.gateway.gateway import Gateway, LiveSession

__all__ = ["model_call"]

_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
_FORWARDED_HEADERS = ("accept", "user-agent", "x-request-id")
MISSING_TOKENS = "MissingTokenIds"


def parse(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """The request body as a JSON object, or why not."""
    try:
        body = wire.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, f"the request body is not JSON: {error}"
    if not isinstance(body, dict):
        return None, f"the request body must be a JSON object, got {type(body).__name__}"
    n = body.get("n", 1)
    if n not in (None, 1):
        return None, f"n={n!r}: the gateway records one answer per call; send n=1 (or none)"
    return body, None


async def model_call(
    gateway: Gateway, live: LiveSession, endpoint: wire.Endpoint, raw: bytes, headers: Any
) -> Response:
    """Forward one call of `live`'s session and record it; the agent's response."""
    body, problem = parse(raw)
    handle = live.handle
    key = retries.request_key(raw, headers)
    again = await retries.retried_answer(handle, live.last_call, key, headers)
    if again is not None:
        return again  # the agent's retry of a call already answered: nothing new is recorded
    sampling = wire.sampling_of(body) if body is not None else {"endpoint": endpoint}
    sampling[retries.SAMPLING_KEY] = key
    answer: asyncio.Future[retries.Answer | None] = asyncio.get_running_loop().create_future()
    live.last_call = (key, answer)  # a retry from now on waits for this call
    try:
        call_id, number = await live.start_call(sampling)
    except BaseException as error:
        answer.set_result(None)
        if isinstance(error, InvalidInput):  # sampling knobs the log cannot hold (NaN, too large)
            raise Refusal(
                400, "invalid_request", f"the request's sampling fields: {error}"
            ) from None
        if isinstance(error, LedgerError):
            raise Refusal(
                409, "session_not_open", f"session {handle.session_id!r}: {error}"
            ) from None
        raise
    call = _Call(gateway, live, call_id, number, endpoint, wire.asked_for(body or {}), answer)
    try:
        return await _forward(gateway, call, endpoint, body, problem, headers)
    except BaseException:
        call.settle_if_left()  # a refusal settled it already; anything else must not block
        raise


async def _forward(
    gateway: Gateway,
    call: _Call,
    endpoint: wire.Endpoint,
    body: dict[str, Any] | None,
    problem: str | None,
    headers: Any,
) -> Response:
    handle = call.live.handle
    if body is None:
        await call.fail("InvalidRequest", problem or "")
        raise Refusal(400, "invalid_request", problem or "invalid request")
    sent = wire.dumps(wire.for_upstream(endpoint, body))
    forwarded = {k: headers[k] for k in _FORWARDED_HEADERS if k in headers}
    forwarded["content-type"] = "application/json"
    try:
        server, response = await gateway.upstreams.open(
            handle.session_id, _PATHS[endpoint], sent, forwarded
        )
    except NoServerAnswered as error:
        await call.fail("ConnectionError", f"no inference server answered: {error}")
        raise Refusal(
            502, "upstream_unreachable", f"no inference server answered: {error}"
        ) from None
    except httpx.TimeoutException as error:
        await call.fail(
            type(error).__name__, f"the inference server did not answer in time: {error}"
        )
        raise Refusal(
            504, "upstream_timeout", f"the inference server did not answer in time: {error}"
        ) from None
    except httpx.HTTPError as error:
        await call.fail(type(error).__name__, f"sending the call failed: {error}")
        raise Refusal(502, "upstream_error", f"sending the call failed: {error}") from None
    call.server = server
    call.capture.version = wire.weights_version(
        response.headers, None, gateway.settings.weights_version_header, None
    )
    if response.status_code >= 400:
        return await call.upstream_refused(response)
    if body.get("stream"):
        # the background task also runs when the stream never started (the agent left first)
        return StreamingResponse(
            call.relay(response),
            media_type="text/event-stream",
            background=BackgroundTask(call.after_stream, response),
        )
    return await call.whole(response)


class _Call:
    """One forwarded call: its id, what the agent asked, what the answer carried so far."""

    def __init__(
        self,
        gateway: Gateway,
        live: LiveSession,
        call_id: str,
        number: int,
        endpoint: wire.Endpoint,
        asked: wire.Asked,
        answer: asyncio.Future[retries.Answer | None],
    ) -> None:
        self.gateway = gateway
        self.live = live
        self.call_id = call_id
        self.number = number
        self.asked = asked
        self.capture = wire.Capture(endpoint)
        self.server = ""
        self.started = time.perf_counter()
        self.settled = False
        #: what the agent was sent once the call is recorded (None if it never is): an agent's
        #: retry of this call gets it again (`retries.py`)
        self.answer = answer
        self._frames_sent: list[bytes] = []

    def answered(self, answer: retries.Answer | None) -> None:
        if not self.answer.done():
            self.answer.set_result(answer)

    def latency(self) -> float:
        return time.perf_counter() - self.started

    async def fail(self, error_type: str, message: str) -> None:
        """Settle the call as failed (if the session still takes it)."""
        self.answered(None)
        if self.settled:
            return
        self.settled = True
        latency = self.latency()
        try:
            await self.live.turn(self.number)
            await self.live.handle.fail_call(
                self.call_id, message=message, error_type=error_type, latency_s=latency
            )
        except LedgerError:
            pass  # the session ended meanwhile: its end settled what was open
        finally:
            self.live.settled(self.number)

    async def record(self) -> None:
        """Append the call's record (or, without token ids, its failure and the session's mark):
        raises `Refusal` when the session no longer takes it, so no unrecorded answer goes out."""
        capture = self.capture
        missing = capture.missing()
        self.settled = True
        handle = self.live.handle
        latency = self.latency()
        try:
            await self.live.turn(self.number)
            if missing is not None:
                self.live.untrainable.append(f"{self.call_id}: {missing} ({self.server})")
                await handle.fail_call(
                    self.call_id,
                    message=f"{missing} ({self.server}); the answer reached the agent but cannot "
                    "train, so the session ends failed",
                    error_type=MISSING_TOKENS,
                    latency_s=latency,
                )
                return
            response_ids = capture.response_ids() or []
            version = capture.version
            await handle.record_call(
                self.call_id,
                prompt_ids=capture.prompt_ids,
                response_ids=response_ids,
                response_logprobs=capture.response_logprobs(len(response_ids)),
                finish_reason=capture.finish_reason,
                min_version=version,
                max_version=version,
                latency_s=latency,
                server=self.server,
                text="".join(capture.text),
            )
        except LedgerError as error:
            self.settled = False
            await self.fail(type(error).__name__, f"the answer could not be recorded: {error}")
            raise Refusal(
                409, "not_recorded", f"the answer could not be recorded, so it is withheld: {error}"
            ) from None
        finally:
            self.live.settled(self.number)

    def _version_from(self, payload: dict[str, Any]) -> None:
        if self.capture.version is None:
            self.capture.version = wire.weights_version(
                {}, payload, None, self.gateway.settings.weights_version_field
            )

    async def upstream_refused(self, response: httpx.Response) -> Response:
        """The server answered an error: recorded as the call's failure, passed on with its status."""
        try:
            text = (await response.aread()).decode(errors="replace")
        except httpx.HTTPError as error:
            text = f"(its body could not be read: {error})"
        finally:
            await response.aclose()
        message = text
        try:
            payload = json.loads(text)
            if isinstance(payload, dict):
                inner = payload.get("error", payload)
                message = str(inner.get("message", text) if isinstance(inner, dict) else inner)
        except json.JSONDecodeError:
            pass
        status = response.status_code
        await self.fail(f"HTTP{status}", f"{self.server} answered {status}: {message[:2000]}")
        return JSONResponse(
            error_body(f"the inference server answered {status}: {message}", "upstream_error"),
            status_code=status,
        )

    async def whole(self, response: httpx.Response) -> Response:
        try:
            raw = await response.aread()
        except httpx.HTTPError as error:
            await self.fail(type(error).__name__, f"reading the answer failed: {error}")
            raise Refusal(502, "upstream_error", f"reading the answer failed: {error}") from None
        finally:
            await response.aclose()
        try:
            payload: Any = wire.loads(raw)
            problem = None if isinstance(payload, dict) else f"a JSON {type(payload).__name__}"
        except ValueError as error:
            problem = str(error)
        if problem is not None:
            await self.fail("InvalidResponse", f"{self.server} answered no JSON object: {problem}")
            raise Refusal(
                502, "upstream_error", f"the server's answer is no JSON object: {problem}"
            )
        self.capture.take(payload)
        self._version_from(payload)
        await self.record()
        answer = retries.Answer(body=wire.dumps(wire.visible(payload, self.asked)))
        self.answered(answer)
        return answer.response()

    async def relay(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """Pass the stream on chunk by chunk; hold `[DONE]` until the record is appended."""
        try:
            async for frame in self._frames(response):
                yield frame
        finally:
            self.abandon(response)

    async def _frames(self, response: httpx.Response) -> AsyncIterator[bytes]:
        done = False
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    payload = json.loads(data)
                except json.JSONDecodeError:
                    continue
                if not isinstance(payload, dict):
                    continue
                if "error" in payload:
                    await self.fail(
                        "StreamError", f"{self.server} sent an error mid-stream: {data[:2000]}"
                    )
                    yield b"data: " + wire.dumps(payload) + b"\n\n"
                    return
                self.capture.take(payload)
                self._version_from(payload)
                frame = b"data: " + wire.dumps(wire.visible(payload, self.asked)) + b"\n\n"
                self._frames_sent.append(frame)
                yield frame
        except httpx.HTTPError as error:
            await self.fail(type(error).__name__, f"the stream broke: {error}")
            yield _error_event(f"the inference server's stream broke: {error}")
            return
        if not done:
            await self.fail("StreamError", f"{self.server}'s stream ended before [DONE]")
            yield _error_event("the inference server's stream ended before [DONE]")
            return
        recording = self.gateway.spawn(self._record_for_stream())
        refusal = await asyncio.shield(recording)  # a client leaving now cannot cut the append
        if refusal is not None:
            yield _error_event(refusal.message)
            return
        yield _DONE

    async def _record_for_stream(self) -> Refusal | None:
        """Record the streamed call and keep its frames for a retry, in the shielded task: an
        agent that leaves at this moment must not leave a recorded call without its answer (a
        retry would then record it again)."""
        try:
            await self.record()
        except Refusal as refusal:
            return refusal
        self.answered(retries.Answer(frames=(*self._frames_sent, _DONE)))
        return None

    async def after_stream(self, response: httpx.Response) -> None:
        """Starlette's background task after a streamed response (a coroutine, so it runs in
        this loop, not a worker thread)."""
        self.abandon(response)

    def settle_if_left(self) -> None:
        """The request ended (an error, a cancellation) with the call unsettled: fail it in a
        task of its own, so the session's next call is not left waiting its turn."""
        if not self.settled:
            self.answered(None)  # a retry waiting on this call goes on as a new call now
            self.gateway.spawn(self.fail("GatewayError", "the gateway stopped serving the call"))

    def abandon(self, response: httpx.Response) -> None:
        """Close the upstream response and, if the agent left before the call was settled, settle
        it as failed: in a task of its own, as the stream's task may be cancelled."""

        async def settle() -> None:
            await response.aclose()
            await self.fail("ClientDisconnected", "the agent left before the answer was complete")

        self.gateway.spawn(settle())


_DONE = b"data: [DONE]\n\n"


def _error_event(message: str) -> bytes:
    return b"data: " + wire.dumps(error_body(message, "upstream_error")) + b"\n\n"
