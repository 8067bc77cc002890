"""Calls through the gateway, made with the real `openai` client, are recorded as the server
answered them: token ids, log-probs, finish reason, weights version, server — streamed or not."""

from __future__ import annotations

from typing import Any

import numpy as np
import openai
import pytest

from sessions import calls
from sessions.gateway.standin import WEIGHTS_VERSION
from tests.gateway.conftest import identity, stack

CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "2+2?"},
]


def client(session: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


async def converse(agent: openai.AsyncOpenAI, *, stream: bool, turns: int = 2) -> list[str]:
    """A multi-turn chat (each answer, then a tool result, appended); the answers' texts."""
    messages = list(CONVERSATION)
    texts = []
    for turn in range(turns):
        if stream:
            chunks = await agent.chat.completions.create(model="m", messages=messages, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        else:
            reply = await agent.chat.completions.create(model="m", messages=messages)
            assert reply.choices[0].logprobs is None  # the agent did not ask for log-probs
            assert "token_ids" not in (reply.choices[0].model_extra or {})
            assert "prompt_token_ids" not in (reply.model_extra or {})
            text = reply.choices[0].message.content or ""
        texts.append(text)
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"tool says {turn}"},
        ]
    return texts


def recorded(gateway: Any, session_id: str) -> Any:
    return gateway.ledger.load_session(session_id)


@pytest.mark.parametrize("stream", [False, True])
async def test_each_call_is_recorded_as_the_server_answered_it(url: str, stream: bool) -> None:
    async with stack(url) as (gateway, standin):
        async with gateway.session("s1", **identity()) as s:
            texts = await converse(client(s), stream=stream)
        handle = await recorded(gateway, "s1")
        events = handle.view.recorded_calls()
        assert len(events) == len(standin.answered) == 2
        prompts = calls.full_prompts(events)
        for event, (prompt, _), answered, text in zip(events, prompts, standin.answered, texts):
            arrays = event.arrays()
            assert prompt.tolist() == answered["prompt_ids"]
            assert arrays.response_ids.tolist() == answered["response_ids"]
            assert arrays.logprobs is not None
            assert arrays.logprobs.tolist() == answered["logprobs"]
            assert event.finish_reason == "stop"
            assert event.min_version == event.max_version == WEIGHTS_VERSION
            assert event.server == gateway.settings.upstreams[0]
            assert event.text == text
            assert event.latency_s is not None and event.latency_s > 0
        # the second call's prompt extends the first call's context: one row, stored once
        assert events[1].prompt_shared == len(prompts[0][1])
        assert handle.state == "succeeded"
        # what the server was asked for: token ids, and log-probs as token ids
        sent = standin.requests[0]
        assert sent["return_token_ids"] is True and sent["logprobs"] is True
        assert sent["return_tokens_as_token_ids"] is True


async def test_streaming_and_not_record_the_same_call(url: str) -> None:
    async with stack(url) as (gateway, _):
        for session_id, stream in (("whole", False), ("streamed", True)):
            async with gateway.session(session_id, **identity(index=0, uid=session_id)) as s:
                await converse(client(s), stream=stream)
        whole = (await recorded(gateway, "whole")).view.recorded_calls()
        streamed = (await recorded(gateway, "streamed")).view.recorded_calls()
        assert len(whole) == len(streamed) == 2
        for a, b in zip(whole, streamed):
            assert a.payload == b.payload
            for name in (
                "prompt_shared",
                "prompt_len",
                "response_len",
                "has_logprobs",
                "finish_reason",
                "min_version",
                "max_version",
                "server",
                "text",
            ):
                assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_are_recorded_too(url: str, stream: bool) -> None:
    async with stack(url) as (gateway, standin):
        async with gateway.session("c1", **identity()) as s:
            agent = client(s)
            if stream:
                chunks = await agent.completions.create(model="m", prompt="Q: 1+1", stream=True)
                text = "".join([c.choices[0].text async for c in chunks if c.choices])
            else:
                reply = await agent.completions.create(model="m", prompt="Q: 1+1", logprobs=1)
                text = reply.choices[0].text
                # asked for: passed on as the server gave them
                assert reply.choices[0].logprobs is not None
                assert reply.choices[0].logprobs.token_logprobs == standin.answered[0]["logprobs"]
        (event,) = (await recorded(gateway, "c1")).view.recorded_calls()
        arrays = event.arrays()
        assert arrays.prompt_ids.tolist() == standin.answered[0]["prompt_ids"]
        assert arrays.response_ids.tolist() == standin.answered[0]["response_ids"]
        assert np.array_equal(arrays.logprobs, np.float32(standin.answered[0]["logprobs"]))
        assert event.text == text


async def test_the_key_alone_routes_a_call_to_its_session(url: str) -> None:
    async with stack(url) as (gateway, _):
        async with gateway.session("k1", **identity()) as s:
            agent = openai.AsyncOpenAI(
                base_url=gateway.base_url + "/v1", api_key=s.api_key, max_retries=0
            )
            await agent.chat.completions.create(model="m", messages=CONVERSATION)
        assert len((await recorded(gateway, "k1")).view.recorded_calls()) == 1
