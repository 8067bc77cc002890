"""A stand-in inference server for tests, examples and benchmarks (vLLM and SGLang need a GPU):
OpenAI-compatible, answering in vLLM's format from a tiny deterministic torch model.

Its "tokenizer" is bytes (id = byte + 10) inside a chat template of special ids, so a
conversation's next prompt extends the previous prompt and answer exactly, as a real chat
template does. The answers come from `TinyModel`, seeded weights decoded greedily over the
printable ASCII bytes and EOS, and each answer token's log-prob is the model's own float32
`log_softmax` at it, so a recorded log-prob compares equal to what the server sent.

The model name picks a behaviour: `fail` answers 500, `no-ids` answers as a server that gives
no token ids (SGLang's OpenAI endpoint), `drop` breaks a stream before `[DONE]`, `stall` streams
two chunks and then waits for `release`, `slow` answers after 8 ms (so calls are in flight when a
test kills the gateway), `slow-stream` streams its chunks `chunk_delay_s` apart (a server under
load), `tool` asks for the request's first tool (not streamed) until the conversation holds a
tool result; anything else answers normally. Each answer's weights version is sent in
`x-weights-version`. torch is imported when a `StandIn` is made, never by importing this module.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import functools
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

if TYPE_CHECKING:
    import torch

OFFSET = 10
BOS, EOS = 1, 2
ROLES = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
WEIGHTS_VERSION = 7
#: ids 0-9 special (BOS, EOS, the roles), then one id per byte
VOCAB = OFFSET + 256
#: the ids the model may answer with besides EOS: printable ASCII, so every answer decodes
PRINTABLE = range(OFFSET + 0x20, OFFSET + 0x7F)
SEED = 0
WIDTH = 32
#: greedy answers end with EOS within this many tokens (EOS's logit rises with the position)
MAX_NEW_TOKENS = 12
#: the model's shape: how much the context weighs against the last token, the logits' scale,
#: how fast EOS becomes likelier per answer token, how many position weights before they repeat
CONTEXT_GAIN, OUT_GAIN, EOS_RAMP, POSITIONS = 2.0, 2.0, 0.6, 4096
#: the pause between the chunks of a `slow-stream` answer
CHUNK_DELAY_S = 0.02


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


def token_bytes(token: int) -> bytes:
    return b"" if token < OFFSET else bytes([token - OFFSET])


def token_text(token: int) -> str:
    return token_bytes(token).decode(errors="replace")


@dataclass(frozen=True, slots=True)
class Answer:
    """One answer of the model: its ids (EOS last when it stopped), each one's log-prob (float32
    values as Python floats), and why it ended (`stop`, or `length` at the request's cap)."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str

    @property
    def text(self) -> str:
        return "".join(token_text(t) for t in self.response_ids)


class TinyModel:
    """A deterministic language model small enough to answer in about a millisecond.

    The next token's logits are `tanh(sum_k r_k A[x_k] / sqrt(L) + B[last]) @ out`: the
    context's tokens weighted by a fixed random weight per position (so a change anywhere in the
    conversation can change the answer, as in a real model) and the last token, through one
    hidden layer, every weight drawn from a seeded generator. Ids other than printable ASCII and
    EOS are masked out (-inf). EOS's logit is set below every other logit at the answer's first
    token and above all of them at `max_new_tokens`, and between them is its own logit plus a
    ramp over the position: greedy answers are never empty, always end, and vary in length.
    """

    def __init__(
        self, seed: int = SEED, width: int = WIDTH, max_new_tokens: int = MAX_NEW_TOKENS
    ) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        embed = torch.randn(VOCAB, width, generator=generator)
        hidden = torch.randn(2 * width, width, generator=generator) / math.sqrt(2 * width)
        self.context_in = embed @ hidden[:width] * CONTEXT_GAIN
        self.last_in = embed @ hidden[width:]
        self.out = torch.randn(width, VOCAB, generator=generator) * (OUT_GAIN / math.sqrt(width))
        self.position = torch.randn(POSITIONS, generator=generator).tolist()
        self.mask = torch.full((VOCAB,), float("-inf"))
        self.mask[PRINTABLE.start : PRINTABLE.stop] = 0.0
        self.mask[EOS] = 0.0
        # |tanh| <= 1, so no printable token's logit is beyond the L1 norm of its column
        bound = float(self.out[:, PRINTABLE.start : PRINTABLE.stop].abs().sum(0).max()) + 1
        self.max_new_tokens = max_new_tokens
        # the same products in as few torch calls as a step can take (each costs microseconds):
        # transposed weights for `mv`/`addmv`, and each step's mask with EOS's logit in it
        self.context_t = self.context_in.T.contiguous()
        self.rows = self.out.T.contiguous()
        self.rows_without_eos = self.rows.clone()
        self.rows_without_eos[EOS] = 0.0
        self.step_bias: list[torch.Tensor] = []
        for step in range(max_new_tokens):
            bias = self.mask.clone()
            if step == 0:
                bias[EOS] = -bound  # below every printable logit: never an empty answer
            elif step == max_new_tokens - 1:
                bias[EOS] = bound  # above all of them: the answer ends here at the latest
            else:
                bias[EOS] = EOS_RAMP * (step - max_new_tokens / 2)  # added to EOS's own logit
            self.step_bias.append(bias)

    def logprobs(self, prompt: Sequence[int], answered: Sequence[int] = ()) -> torch.Tensor:
        """The float32 log-softmax over the vocabulary of the token after `prompt` + `answered`
        (`answered`: the answer's tokens so far, whose count sets EOS's logit)."""
        mixed = self._mixed(prompt)
        for n, token in enumerate(answered):
            mixed = self._with(mixed, token, len(prompt) + n)
        last = answered[-1] if answered else prompt[-1]
        return self._next(mixed, len(prompt) + len(answered), len(answered), last)

    def answer(
        self, prompt: Sequence[int], max_tokens: int | None = None, forced: Sequence[int] = ()
    ) -> Answer:
        """The greedy answer to `prompt` (at most `max_tokens` tokens), or the model's log-probs
        of `forced` when given (a tool call the template writes). The same sums as `logprobs`
        in the same order, kept from token to token: the same float32 values, bit for bit."""
        response: list[int] = []
        logprobs: list[float] = []
        limit = len(forced) if forced else max_tokens
        mixed, last = self._mixed(prompt), prompt[-1]
        while limit is None or len(response) < limit:
            step = len(response)
            scores = self._next(mixed, len(prompt) + step, step, last)
            token = forced[step] if forced else int(scores.argmax())
            response.append(token)
            logprobs.append(float(scores[token]))
            if token == EOS:
                return Answer(response, logprobs, "stop")
            mixed, last = self._with(mixed, token, len(prompt) + step), token
        return Answer(response, logprobs, "stop" if forced else "length")

    def _mixed(self, prompt: Sequence[int]) -> torch.Tensor:
        """The prompt's context embeddings, each weighted by its position's weight, summed: the
        weights summed per vocabulary id in Python, then one dense product. (Gathering the
        embedding rows goes through torch's thread pool, which on a loaded machine costs
        milliseconds a call; a list becomes a tensor through a float32 buffer, not element by
        element.)"""
        import torch

        weights = [0.0] * VOCAB
        for n, token in enumerate(prompt):
            weights[token] += self.position[n % POSITIONS]
        with torch.inference_mode():
            dense = torch.frombuffer(bytearray(array.array("f", weights)), dtype=torch.float32)
            return torch.mv(self.context_t, dense)

    def _with(self, mixed: torch.Tensor, token: int, position: int) -> torch.Tensor:
        """The sum with one more token of the context."""
        import torch

        with torch.inference_mode():
            weight = self.position[position % POSITIONS]
            return torch.add(mixed, self.context_in[token], alpha=weight)

    def _next(self, mixed: torch.Tensor, length: int, step: int, last: int) -> torch.Tensor:
        """The log-softmax after a context of `length` tokens, the answer's `step`-th token."""
        import torch

        with torch.inference_mode():
            state = torch.add(self.last_in[last], mixed, alpha=1 / math.sqrt(length))
            bounded = step == 0 or step >= self.max_new_tokens - 1
            rows = self.rows_without_eos if bounded else self.rows
            bias = self.step_bias[min(step, self.max_new_tokens - 1)]
            return torch.log_softmax(torch.addmv(bias, rows, torch.tanh(state)), 0)


@functools.cache
def model() -> TinyModel:
    """The process's model (its weights are the seed's: every process answers alike)."""
    return TinyModel()


def answer(prompt: Sequence[int], max_tokens: int | None = None) -> Answer:
    """What the stand-in answers to `prompt` (a test's expectation)."""
    return model().answer(prompt, max_tokens)


class StandIn:
    """The server's state: what it answered, for the tests to compare with the log.

    `chunk_delay_s`: the pause between a `slow-stream` answer's chunks; `pace`, when given, is
    awaited there instead with the number of the chunk about to be sent (a test's handshake)."""

    def __init__(
        self,
        *,
        chunk_delay_s: float = CHUNK_DELAY_S,
        pace: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.model = model()  # torch is imported here, at the first stand-in of the process
        self.answered: list[
            dict[str, Any]
        ] = []  # {"prompt_ids", "response_ids", "logprobs", "text"}
        self.requests: list[dict[str, Any]] = []
        self.release = asyncio.Event()  # what a `stall` stream waits for
        self.chunk_delay_s = chunk_delay_s
        self.pace = pace
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
        tool_call = None
        messages = body.get("messages") or [{}]
        if model == "tool" and body.get("tools") and messages[-1].get("role") != "tool":
            # the model asks for the first tool, as a tool-using agent's model would
            name = body["tools"][0]["function"]["name"]
            tool_call = {"name": name, "arguments": json.dumps({"a": 2, "b": 2})}
            said = encode(call_text(tool_call["name"], tool_call["arguments"])) + [EOS]
            reply = self.model.answer(prompt, forced=said)
        else:
            cap = body.get("max_completion_tokens") or body.get("max_tokens")
            reply = self.model.answer(prompt, cap if isinstance(cap, int) and cap > 0 else None)
        self.answered.append(
            {
                "prompt_ids": prompt,
                "response_ids": reply.response_ids,
                "logprobs": reply.logprobs,
                "text": reply.text,
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
                self._stream(endpoint, model, prompt, reply, options),
                media_type="text/event-stream",
                headers=headers,
            )
        return JSONResponse(
            _whole(endpoint, model, prompt, reply, options, tool_call), headers=headers
        )

    async def _between_chunks(self, n: int) -> None:
        if self.pace is not None:
            await self.pace(n)
        else:
            await asyncio.sleep(self.chunk_delay_s)

    async def _stream(
        self,
        endpoint: str,
        model: str,
        prompt: list[int],
        reply: Answer,
        options: dict[str, bool],
    ) -> AsyncIterator[bytes]:
        base = {"id": "cmpl-standin", "created": int(time.time()), "model": model}
        kind = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        slow = model == "slow-stream"
        if endpoint == "chat":
            first: dict[str, Any] = {
                **base,
                "object": kind,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            }
            if options["token_ids"]:
                first["prompt_token_ids"] = prompt
            yield _event(first)
        for n, (token, value) in enumerate(zip(reply.response_ids, reply.logprobs)):
            if model == "drop" and n == 2:
                return  # the connection ends before [DONE]
            if model == "stall" and n == 2:
                await self.release.wait()
            if slow:
                await self._between_chunks(n)
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
                choice["logprobs"] = _logprobs(endpoint, [token], [value], options["as_ids"])
            yield _event({**base, "object": kind, "choices": [choice]})
            await asyncio.sleep(0)
        if slow:
            await self._between_chunks(len(reply.response_ids))
        last: dict[str, Any] = {
            "index": 0,
            "finish_reason": reply.finish_reason,
            "stop_reason": None,
        }
        last["delta" if endpoint == "chat" else "text"] = {} if endpoint == "chat" else ""
        yield _event({**base, "object": kind, "choices": [last]})
        yield b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _logprobs(
    endpoint: str, tokens: list[int], values: list[float], as_ids: bool
) -> dict[str, Any]:
    names = [f"token_id:{t}" if as_ids else token_text(t) for t in tokens]
    if endpoint == "chat":
        return {
            "content": [
                {
                    "token": name,
                    "logprob": value,
                    "bytes": list(token_bytes(t)),
                    "top_logprobs": [],
                }
                for name, t, value in zip(names, tokens, values)
            ]
        }
    return {
        "tokens": names,
        "token_logprobs": list(values),
        "text_offset": list(range(len(tokens))),
        "top_logprobs": None,
    }


def _whole(
    endpoint: str,
    model: str,
    prompt: list[int],
    reply: Answer,
    options: dict[str, bool],
    tool_call: dict[str, str] | None = None,
) -> dict[str, Any]:
    response = reply.response_ids
    choice: dict[str, Any] = {"index": 0, "finish_reason": reply.finish_reason, "stop_reason": None}
    if endpoint == "chat" and tool_call is not None:
        choice["message"] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": tool_call}],
        }
        choice["finish_reason"] = "tool_calls"
    elif endpoint == "chat":
        choice["message"] = {"role": "assistant", "content": reply.text}
    else:
        choice["text"] = reply.text
        if options["token_ids"]:
            choice["prompt_token_ids"] = prompt
    choice["logprobs"] = (
        _logprobs(endpoint, response, reply.logprobs, options["as_ids"])
        if options["logprobs"]
        else None
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
