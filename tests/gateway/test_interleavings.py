"""Concurrent sessions' calls, interleaved in generated orders: each session's calls land in its
own stream, in the order its agent made them, each with its own conversation's tokens."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import openai
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import calls
from sessions.gateway.standin import answer, chat_prompt
from tests.gateway.conftest import identity, stack

SESSIONS = 4


async def one_turn(agent: openai.AsyncOpenAI, messages: list[dict[str, Any]], stream: bool) -> None:
    """One call of the session's conversation; the answer and the next user turn appended."""
    if stream:
        chunks = await agent.chat.completions.create(model="m", messages=messages, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    else:
        reply = await agent.chat.completions.create(model="m", messages=messages)
        text = reply.choices[0].message.content or ""
    assert text == answer(chat_prompt(messages)).text  # the stand-in model's greedy answer
    messages += [
        {"role": "assistant", "content": text},
        {"role": "user", "content": f"turn {len(messages) // 2}"},
    ]


async def run_schedule(gateway: Any, waves: list[list[tuple[int, bool]]]) -> None:
    tag = uuid.uuid4().hex[:8]
    sessions = []
    contexts = []
    for n in range(SESSIONS):
        context = gateway.session(f"{tag}-{n}", **identity(uid=f"{tag}x{n}"))
        contexts.append(context)
        sessions.append(await context.__aenter__())
    conversations = [[{"role": "user", "content": f"session {tag}-{n}"}] for n in range(SESSIONS)]
    expected: list[list[list[int]]] = [[] for _ in range(SESSIONS)]
    agents = [
        openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0) for s in sessions
    ]
    try:
        for wave in waves:
            chains: dict[int, list[bool]] = {}
            for index, stream in wave:
                chains.setdefault(index, []).append(stream)

            async def chain(index: int, streams: list[bool]) -> None:
                for stream in streams:
                    expected[index].append(chat_prompt(conversations[index]))
                    await one_turn(agents[index], conversations[index], stream)

            await asyncio.gather(*(chain(i, s) for i, s in chains.items()))
    finally:
        for context in reversed(contexts):
            await context.__aexit__(None, None, None)
    for n in range(SESSIONS):
        handle = await gateway.ledger.load_session(f"{tag}-{n}")
        recorded = handle.view.recorded_calls()
        assert [c.call_id for c in recorded] == [f"c{k + 1}" for k in range(len(expected[n]))]
        prompts = [prompt.tolist() for prompt, _ in calls.full_prompts(recorded)]
        assert prompts == expected[n]
        # a session with calls succeeds with its row; one without ends as empty output
        assert handle.state == ("succeeded" if expected[n] else "failed")


_wave = st.lists(st.tuples(st.integers(0, SESSIONS - 1), st.booleans()), min_size=1, max_size=6)


async def test_each_sessions_calls_land_in_its_own_stream_in_order(url: str) -> None:
    async with stack(url) as (gateway, _):
        loop = asyncio.get_running_loop()

        @settings(
            max_examples=12,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(waves=st.lists(_wave, min_size=1, max_size=4))
        def schedules(waves: list[list[tuple[int, bool]]]) -> None:
            asyncio.run_coroutine_threadsafe(run_schedule(gateway, waves), loop).result(timeout=120)

        await asyncio.to_thread(schedules)


async def test_one_sessions_concurrent_calls_are_each_recorded(url: str) -> None:
    async with stack(url) as (gateway, standin):
        async with gateway.session("parallel", **identity()) as s:
            agent = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
            conversations = [[{"role": "user", "content": f"branch {n}"}] for n in range(6)]
            await asyncio.gather(
                *(one_turn(agent, c, n % 2 == 0) for n, c in enumerate(conversations))
            )
        handle = await gateway.ledger.load_session("parallel")
        assert handle.view.open_calls() == []
        prompts = sorted(p.tolist() for p, _ in calls.full_prompts(handle.view.recorded_calls()))
        assert prompts == sorted(a["prompt_ids"] for a in standin.answered)
        assert len(prompts) == 6 and handle.state == "succeeded"
