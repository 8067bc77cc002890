"""What a failing server or agent leaves in the log: failed calls, a failed session with its
recorded calls kept, and the session's placeholder row in the step's batch."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import identity, stack
from tests.gateway.test_recording import CONVERSATION, client

AGENT = str(Path(__file__).with_name("agent_script.py"))


async def failed_call_of(gateway: Any, session_id: str, call_id: str) -> Any:
    """The ModelCallFailed event of `call_id`, read from the session's stream."""
    from sessions import events as ev

    stored = await gateway.ledger.store.read_stream(session_id)
    for item in stored:
        event = ev.decode(item).event
        if type(event).__name__ == "ModelCallFailed" and event.call_id == call_id:
            return event
    raise AssertionError(f"no ModelCallFailed for {call_id} in {session_id}")


async def placeholder_of(gateway: Any, session_id: str, step: int = 0) -> str | None:
    """The failure reason of the session's row in the step's batch, asserting it is a placeholder."""
    batch = await gateway.ledger.batch("train", step, timeout=60)
    ids = list(batch["session_id"])
    row = ids.index(session_id)
    assert bool(batch["is_placeholder"][row])
    return batch["failure_reason"][row]


async def test_a_call_the_server_fails_is_failed_and_the_agent_sees_an_error(url: str) -> None:
    async with stack(url) as (gateway, _):
        async with gateway.session("f1", **identity()) as s:
            with pytest.raises(openai.InternalServerError, match="stand-in failure"):
                await client(s).chat.completions.create(model="fail", messages=CONVERSATION)
        handle = await gateway.ledger.load_session("f1")
        assert handle.view.calls["c1"].failed and handle.view.recorded_calls() == []
        failed = await failed_call_of(gateway, "f1", "c1")
        assert failed.error_type == "HTTP500" and "stand-in failure" in failed.message
        assert handle.state == "failed"  # no answer to train on: empty output, a placeholder
        assert await placeholder_of(gateway, "f1") is not None


async def test_a_server_without_token_ids_fails_the_session_closed(url: str) -> None:
    async with stack(url) as (gateway, standin):
        async with gateway.session("n1", **identity()) as s:
            reply = await client(s).chat.completions.create(model="no-ids", messages=CONVERSATION)
            assert reply.choices[0].message.content  # the agent got its answer
        handle = await gateway.ledger.load_session("n1")
        assert handle.view.recorded_calls() == []  # never re-tokenized by guesswork
        failed = await failed_call_of(gateway, "n1", "c1")
        assert failed.error_type == "MissingTokenIds" and "no prompt" in failed.message
        assert handle.state == "failed"
        assert await placeholder_of(gateway, "n1") == "missing_token_ids"


async def test_a_stream_that_breaks_is_a_failed_call(url: str) -> None:
    async with stack(url) as (gateway, _):
        async with gateway.session("d1", **identity()) as s:
            with pytest.raises(openai.APIError):
                chunks = await client(s).chat.completions.create(
                    model="drop", messages=CONVERSATION, stream=True
                )
                async for _ in chunks:
                    pass
        handle = await gateway.ledger.load_session("d1")
        assert handle.view.calls["c1"].failed
        assert (await failed_call_of(gateway, "d1", "c1")).error_type == "StreamError"


@pytest.mark.parametrize(
    ("calls", "then", "reason", "says"),
    [
        (2, "exit:3", "runner_error", "exited with status 3"),
        (1, "kill", "runner_error", "killed by SIGKILL"),
    ],
)
async def test_an_agent_that_dies_leaves_a_failed_session_with_its_calls(
    url: str, calls: int, then: str, reason: str, says: str
) -> None:
    async with stack(url) as (gateway, standin):
        async with gateway.session("a1", **identity()) as s:
            result = await s.run_agent([sys.executable, AGENT, str(calls), then], timeout=120)
            assert not result.ok and s.handle.terminal
        handle = await gateway.ledger.load_session("a1")
        assert handle.state == "failed" and handle.view.failure_reason == reason
        assert says in handle.view.message
        recorded = handle.view.recorded_calls()
        assert len(recorded) == calls == len(standin.answered)
        assert [e.arrays().response_ids.tolist() for e in recorded] == [
            a["response_ids"] for a in standin.answered
        ]
        assert await placeholder_of(gateway, "a1") == reason


async def test_an_agent_past_its_timeout_is_killed_and_its_session_fails(url: str) -> None:
    async with stack(url) as (gateway, _):
        async with gateway.session("t1", **identity()) as s:
            result = await s.run_agent([sys.executable, AGENT, "0", "hang"], timeout=1)
            assert result.timed_out
        handle = await gateway.ledger.load_session("t1")
        assert handle.state == "failed" and handle.view.failure_reason == "timeout"
        assert await placeholder_of(gateway, "t1") == "timeout"


async def test_an_agent_that_exits_cleanly_leaves_the_session_to_the_training_side(
    url: str,
) -> None:
    async with stack(url) as (gateway, _):
        async with gateway.session("ok1", **identity()) as s:
            result = await s.run_agent([sys.executable, AGENT, "2", "exit:0"], timeout=120)
            assert result.ok and not s.handle.terminal
            await s.post_reward(1.0)
        handle = await gateway.ledger.load_session("ok1")
        assert handle.state == "succeeded" and handle.view.reward == 1.0
        batch = await gateway.ledger.batch("train", 0, timeout=60)
        assert not bool(batch["is_placeholder"][0])


async def test_an_agent_that_leaves_mid_stream_leaves_a_failed_call(url: str) -> None:
    async with stack(url) as (gateway, standin), httpx.AsyncClient() as http:
        async with gateway.session("left", **identity()) as s:
            async with http.stream(
                "POST",
                s.base_url + "/chat/completions",
                json={"model": "stall", "messages": CONVERSATION, "stream": True},
                headers={"authorization": f"Bearer {s.api_key}"},
            ) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        break  # one chunk read, then the agent goes away
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while not s.handle.view.calls["c1"].failed:  # a condition with a deadline
                assert loop.time() < deadline, "the abandoned call was never settled"
                await asyncio.sleep(0.02)
            standin.release.set()
        failed = await failed_call_of(gateway, "left", "c1")
        assert failed.error_type == "ClientDisconnected"
