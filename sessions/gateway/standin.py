"""A stand-in inference server for tests, examples and benchmarks (vLLM and SGLang need a GPU):
OpenAI-compatible, answering in vLLM's format, deterministic.

Its "tokenizer" is bytes (id = byte + 10) inside a chat template of special ids, so a
conversation's next prompt extends the previous prompt and answer exactly, as a real chat
template does. The model name picks a behaviour: `fail` answers 500, `no-ids` answers as a server
that gives no token ids (SGLang's OpenAI endpoint), `drop` breaks a stream before `[DONE]`,
`stall` streams two chunks and then waits for `release`, `slow` answers after 8 ms (so calls are in
flight when a test kills the gateway), `tool` asks for the request's first tool (not streamed)
until the conversation holds a tool result; anything else answers normally. Each answer's weights version is sent in `x-weights-version`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

OFFSET = 10
BOS, EOS = 1, 2
ROLES = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
WEIGHTS_VERSION = 7


def encode(text: str) -> list[int]:
    return [byte + OFFSET for byte in text.encode()]


def call_text(name: str, arguments: str) -> str:
    """How the template writes a tool call (and how the model "says" one)."""
    return f"<call {name} {arguments}>"


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = message.get("tool_calls") or []
    return content + "".join(
        call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls
    )


def chat_prompt(messages: list[dict[str, Any]]) -> list[int]:
    ids: list[int] = []
    for message in messages:
        ids += [BOS, ROLES.get(message.get("role", "user"), 4)]
        ids += encode(message_text(message)) + [EOS]
    return ids + [BOS, ROLES["assistant"]]


def answer_for(prompt: list[int]) -> str:
    return f"ok {sum(prompt) % 997}"


def logprob(token: int) -> float:
    """Exact in float32, so a recorded log-prob compares equal."""
    return -((token % 8) + 1) / 8


def token_text(token: int) -> str:
    return "" if token == EOS else bytes([token - OFFSET]).decode()


class StandIn:
    """The server's state: what it answered, for the tests to compare with the log."""

    def __init__(self) -> None:
        self.answered: list[dict[str, Any]] = []  # {"prompt_ids", "response_ids", "logprobs"}
        self.requests: list[dict[str, Any]] = []
        self.release = asyncio.Event()  # what a `stall` stream waits for
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completion, methods=["POST"]),
            ]
        )

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, "chat")

    async def completion(self, request: Request) -> Response:
        return await self._answer(request, "completion")

    async def _answer(self, request: Request, endpoint: str) -> Response:
        body = await request.json()
        self.requests.append(body)
        model = body.get("model", "")
        if model == "fail":
            return JSONResponse(
                {"error": {"message": "stand-in failure", "type": "InternalError", "code": 500}},
                status_code=500,
            )
        ids_given = model != "no-ids"
        if model == "slow":
            await asyncio.sleep(0.008)  # a server's latency, not a wait for the test
        if endpoint == "chat":
            prompt = chat_prompt(body["messages"])
        else:
            prompt = [BOS, *encode(body["prompt"])]
        text = answer_for(prompt)
        tool_call = None
        messages = body.get("messages") or [{}]
        if model == "tool" and body.get("tools") and messages[-1].get("role") != "tool":
            # the model asks for the first tool, as a tool-using agent's model would
            name = body["tools"][0]["function"]["name"]
            tool_call = {"name": name, "arguments": json.dumps({"a": 2, "b": 2})}
            text = call_text(tool_call["name"], tool_call["arguments"])
        response = [*encode(text), EOS]
        self.answered.append(
            {
                "prompt_ids": prompt,
                "response_ids": response,
                "logprobs": [logprob(t) for t in response],
            }
        )
        options = {
            "token_ids": ids_given and bool(body.get("return_token_ids")),
            "as_ids": ids_given and bool(body.get("return_tokens_as_token_ids")),
            "logprobs": body.get("logprobs") is not None and body.get("logprobs") is not False,
        }
        headers = {"x-weights-version": str(WEIGHTS_VERSION)}
        if body.get("stream"):
            return StreamingResponse(
                self._stream(endpoint, model, prompt, response, options),
                media_type="text/event-stream",
                headers=headers,
            )
        return JSONResponse(
            _whole(endpoint, model, prompt, response, options, tool_call), headers=headers
        )

    async def _stream(
        self,
        endpoint: str,
        model: str,
        prompt: list[int],
        response: list[int],
        options: dict[str, bool],
    ) -> AsyncIterator[bytes]:
        base = {"id": "cmpl-standin", "created": int(time.time()), "model": model}
        kind = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        if endpoint == "chat":
            first: dict[str, Any] = {
                **base,
                "object": kind,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            }
            if options["token_ids"]:
                first["prompt_token_ids"] = prompt
            yield _event(first)
        for n, token in enumerate(response):
            if model == "drop" and n == 2:
                return  # the connection ends before [DONE]
            if model == "stall" and n == 2:
                await self.release.wait()
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if endpoint == "chat":
                choice["delta"] = {"content": token_text(token)}
            else:
                choice["text"] = token_text(token)
                if n == 0 and options["token_ids"]:
                    choice["prompt_token_ids"] = prompt
            if options["token_ids"]:
                choice["token_ids"] = [token]
            if options["logprobs"]:
                choice["logprobs"] = _logprobs(endpoint, [token], options["as_ids"])
            yield _event({**base, "object": kind, "choices": [choice]})
            await asyncio.sleep(0)
        last: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        last["delta" if endpoint == "chat" else "text"] = {} if endpoint == "chat" else ""
        yield _event({**base, "object": kind, "choices": [last]})
        yield b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _logprobs(endpoint: str, tokens: list[int], as_ids: bool) -> dict[str, Any]:
    names = [f"token_id:{t}" if as_ids else token_text(t) for t in tokens]
    if endpoint == "chat":
        return {
            "content": [
                {"token": name, "logprob": logprob(t), "bytes": None, "top_logprobs": []}
                for name, t in zip(names, tokens)
            ]
        }
    return {
        "tokens": names,
        "token_logprobs": [logprob(t) for t in tokens],
        "text_offset": list(range(len(tokens))),
        "top_logprobs": None,
    }


def _whole(
    endpoint: str,
    model: str,
    prompt: list[int],
    response: list[int],
    options: dict[str, bool],
    tool_call: dict[str, str] | None = None,
) -> dict[str, Any]:
    text = "".join(token_text(t) for t in response)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
    if endpoint == "chat" and tool_call is not None:
        choice["message"] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": tool_call}],
        }
        choice["finish_reason"] = "tool_calls"
    elif endpoint == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
        if options["token_ids"]:
            choice["prompt_token_ids"] = prompt
    choice["logprobs"] = (
        _logprobs(endpoint, response, options["as_ids"]) if options["logprobs"] else None
    )
    if options["token_ids"]:
        choice["token_ids"] = response
    payload: dict[str, Any] = {
        "id": "cmpl-standin",
        "object": "chat.completion" if endpoint == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(response),
            "total_tokens": len(prompt) + len(response),
        },
    }
    if endpoint == "chat" and options["token_ids"]:
        payload["prompt_token_ids"] = prompt
    return payload


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """Serve `app` on a free local port in this event loop; its base URL."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    task = asyncio.ensure_future(server.serve())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not server.started:  # a condition with a deadline
        assert not task.done(), task.result()
        assert loop.time() < deadline, "the stand-in server did not listen within 30s"
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
