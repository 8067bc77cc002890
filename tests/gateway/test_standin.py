"""The stand-in server itself, where a fault in it would pass silently through the gateway's
tests: its answers are the tiny model's greedy answers and its log-probs the model's own
log_softmax at each chosen token, as sent on the wire; a slow stream really arrives chunk by
chunk, through the gateway too; and importing it loads no torch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessions.gateway.standin import (
    EOS,
    MAX_NEW_TOKENS,
    OFFSET,
    PRINTABLE,
    StandIn,
    answer,
    chat_prompt,
    encode,
    model,
    serving,
)
from tests import REPO
from tests.conftest import fresh_database
from tests.gateway.conftest import identity

TOKEN_OPTIONS = {"return_token_ids": True, "logprobs": True, "return_tokens_as_token_ids": True}

_texts = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _texts}
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(messages=_messages, cap=st.one_of(st.none(), st.integers(1, MAX_NEW_TOKENS + 2)))
def test_an_answer_is_the_greedy_choice_and_its_logprobs_the_models_log_softmax(
    messages: list[dict[str, Any]], cap: int | None
) -> None:
    prompt = chat_prompt(messages)
    reply = answer(prompt, cap)
    tokens = reply.response_ids
    assert 1 <= len(tokens) <= min(cap or MAX_NEW_TOKENS, MAX_NEW_TOKENS)
    for n, (token, value) in enumerate(zip(tokens, reply.logprobs)):
        scores = model().logprobs(prompt, tokens[:n])
        assert scores.dtype.is_floating_point and scores.dtype.itemsize == 4  # float32
        assert token == int(scores.argmax())  # greedy
        assert value == float(scores[token]) == float(np.float32(value))  # exact in float32
        assert token in PRINTABLE or (token == EOS and n == len(tokens) - 1)
    if tokens[-1] == EOS:
        assert reply.finish_reason == "stop"
    else:  # cut at the request's cap before the model said EOS
        assert reply.finish_reason == "length" and len(tokens) == cap
    # the text decodes, and the template reads it back as the same ids
    assert encode(reply.text) == [t for t in tokens if t != EOS]


def test_eos_never_comes_first_and_always_comes_by_the_last_position() -> None:
    scores = [model().logprobs([1, 4, OFFSET + 65], [OFFSET + 66] * n) for n in range(12)]
    assert int(scores[0].argmax()) != EOS and int(scores[-1].argmax()) == EOS
    printable = slice(PRINTABLE.start, PRINTABLE.stop)
    for row in scores:  # every other id is masked out: the text always decodes
        assert np.isneginf(np.delete(row.numpy(), [*PRINTABLE, EOS])).all()
        assert np.isfinite(row.numpy()[printable]).all()


async def post(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The answer's JSON payloads: one for a whole answer, every chunk's for a stream."""
    if not body.get("stream"):
        reply = await http.post(url, json=body)
        reply.raise_for_status()
        return [reply.json()]
    chunks = []
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    assert chunks, "the stream sent nothing"
    return chunks


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
async def test_the_wire_carries_the_models_answer(endpoint: str, stream: bool) -> None:
    standin = StandIn()
    if endpoint == "chat":
        messages = [{"role": "user", "content": "What is 2+2?"}]
        body: dict[str, Any] = {"model": "m", "messages": messages}
        path, prompt = "/v1/chat/completions", chat_prompt(messages)
    else:
        body = {"model": "m", "prompt": "Q: 2+2"}
        path, prompt = "/v1/completions", [1, *encode("Q: 2+2")]
    expected = answer(prompt)
    async with serving(standin.app) as base, httpx.AsyncClient() as http:
        payloads = await post(http, base + path, {**body, **TOKEN_OPTIONS, "stream": stream})
    ids: list[int] = []
    values: list[float] = []
    texts: list[str] = []
    prompts = []
    for payload in payloads:
        prompts.append(payload.get("prompt_token_ids"))
        choice = payload["choices"][0]
        prompts.append(choice.get("prompt_token_ids"))
        ids += choice.get("token_ids") or []
        message = choice.get("message") or choice.get("delta") or {}
        texts.append(message.get("content") or choice.get("text") or "")
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            entries = logprobs.get("content") or []
            values += [e["logprob"] for e in entries] or logprobs["token_logprobs"]
            names = [e["token"] for e in entries] or logprobs["tokens"]
            assert names == [f"token_id:{t}" for t in choice["token_ids"]]
    assert [p for p in prompts if p is not None] == [prompt]  # sent once
    assert ids == expected.response_ids and values == expected.logprobs
    assert "".join(texts) == expected.text
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    assert standin.answered == [
        {
            "prompt_ids": prompt,
            "response_ids": expected.response_ids,
            "logprobs": expected.logprobs,
            "text": expected.text,
        }
    ]


async def test_a_tool_call_carries_the_models_logprobs_of_its_tokens() -> None:
    standin = StandIn()
    messages = [{"role": "user", "content": "add"}]
    tool = {"type": "function", "function": {"name": "add", "parameters": {}}}
    body = {"model": "tool", "messages": messages, "tools": [tool], **TOKEN_OPTIONS}
    async with serving(standin.app) as base, httpx.AsyncClient() as http:
        (payload,) = await post(http, base + "/v1/chat/completions", body)
    choice = payload["choices"][0]
    call = choice["message"]["tool_calls"][0]["function"]
    said = encode(f"<call {call['name']} {call['arguments']}>") + [EOS]
    assert choice["token_ids"] == said and choice["finish_reason"] == "tool_calls"
    prompt = chat_prompt(messages)
    values = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert values == [float(model().logprobs(prompt, said[:n])[t]) for n, t in enumerate(said)]
    assert all(np.isfinite(values))


def handshake() -> tuple[
    list[tuple[str, int]], Callable[[int], Awaitable[None]], Callable[[], None]
]:
    """A log of chunks sent and received, the stand-in's pace (it sends its next chunk only once
    the client has read the previous one) and the client's receipt."""
    log: list[tuple[str, int]] = []
    read = asyncio.Semaphore(0)
    received = [0]

    async def pace(n: int) -> None:
        await asyncio.wait_for(read.acquire(), 60)  # never released if the chunks were held back
        log.append(("sent", n))

    def receipt() -> None:
        log.append(("got", received[0]))
        received[0] += 1
        read.release()

    return log, pace, receipt


async def read_chunks(response: httpx.Response, receipt: Callable[[], None]) -> list[str]:
    lines = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            lines.append(line)
            receipt()
    return lines


def alternates(log: list[tuple[str, int]], pauses: int) -> bool:
    """Each chunk was read before the next one was sent: the role chunk (read first, unpaced),
    then each pause's chunk sent and read in turn, then `[DONE]` read."""
    expected = [("got", 0)]
    for n in range(pauses):
        expected += [("sent", n), ("got", n + 1)]
    return log == [*expected, ("got", pauses + 1)]


async def test_a_slow_stream_arrives_in_pieces() -> None:
    log, pace, receipt = handshake()
    standin = StandIn(pace=pace)
    messages = [{"role": "user", "content": "slowly"}]
    expected = answer(chat_prompt(messages))
    body = {"model": "slow-stream", "messages": messages, "stream": True, **TOKEN_OPTIONS}
    async with serving(standin.app) as base, httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", base + "/v1/chat/completions", json=body) as response:
            lines = await read_chunks(response, receipt)
    # role, one chunk per token, the finish chunk, [DONE]; a pause before each token and the end
    assert len(lines) == len(expected.response_ids) + 3 and lines[-1] == "data: [DONE]"
    assert alternates(log, len(expected.response_ids) + 1), log


async def test_a_slow_stream_takes_at_least_its_pauses() -> None:
    delay = 0.05
    standin = StandIn(chunk_delay_s=delay)
    messages = [{"role": "user", "content": "slowly"}]
    pauses = len(answer(chat_prompt(messages)).response_ids) + 1  # before each token and the end
    body = {"model": "slow-stream", "messages": messages, "stream": True}
    async with serving(standin.app) as base, httpx.AsyncClient(timeout=120) as http:
        started = time.monotonic()
        await post(http, base + "/v1/chat/completions", body)
        took = time.monotonic() - started
    assert took >= pauses * delay  # a lower bound: load only makes it longer


@pytest.fixture
def sqlite_url(tmp_path: Path) -> AsyncIterator[str]:
    with fresh_database("sqlite", tmp_path) as url:
        yield url


async def test_a_slow_stream_through_the_gateway_arrives_in_pieces_and_is_recorded_whole(
    sqlite_url: str,
) -> None:
    from sessions.gateway.server import serve
    from sessions.ledger import Ledger

    log, pace, receipt = handshake()
    standin = StandIn(pace=pace)
    messages = [{"role": "user", "content": "slowly"}]
    expected = answer(chat_prompt(messages))
    body = {"model": "slow-stream", "messages": messages, "stream": True}
    async with (
        Ledger.open(sqlite_url, run="gw") as ledger,
        serving(standin.app) as upstream,
        serve(ledger, [upstream]) as gateway,
        httpx.AsyncClient(timeout=120) as http,
    ):
        async with gateway.session("slow", **identity()) as s:
            headers = {"authorization": f"Bearer {s.api_key}"}
            url = s.base_url + "/chat/completions"
            async with http.stream("POST", url, json=body, headers=headers) as response:
                lines = await read_chunks(response, receipt)
        (call,) = (await ledger.load_session("slow")).view.recorded_calls()
    assert len(lines) == len(expected.response_ids) + 3 and lines[-1] == "data: [DONE]"
    assert alternates(log, len(expected.response_ids) + 1), log
    arrays = call.arrays()
    assert arrays.response_ids.tolist() == expected.response_ids
    assert arrays.logprobs.tolist() == expected.logprobs


def test_importing_the_standin_loads_no_torch() -> None:
    code = "import sys, sessions.gateway.standin; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
