"""An agent's retry of a call whose answer it never got is answered from that call and never
recorded twice; after a restart, a retry the log cannot answer fails the session closed."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import calls
from sessions.gateway.keys import new_gateway_key
from sessions.vocabulary import INCOMPLETE_CAPTURE
from tests.gateway.conftest import identity, stack

#: a generated schedule's requests: a new turn, or a retry of the session's last call (marked as
#: the openai SDK marks it, and with the call's idempotency key when the call was sent with one)
NEW, RETRY = "new", "retry"


def chat_body(messages: list[dict[str, Any]], stream: bool, model: str = "m") -> bytes:
    return json.dumps({"model": model, "messages": messages, "stream": stream}).encode()


def answer_text(raw: bytes, stream: bool) -> str:
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"] or ""
    text = ""
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            text += chunk["choices"][0]["delta"].get("content") or ""
    return text


async def post(
    http: httpx.AsyncClient, session: Any, body: bytes, headers: dict[str, str]
) -> httpx.Response:
    return await http.post(
        session.base_url + "/chat/completions",
        content=body,
        headers={
            "authorization": f"Bearer {session.api_key}",
            "content-type": "application/json",
            **headers,
        },
    )


async def run_schedule(gateway: Any, schedule: list[tuple[str, bool, bool]]) -> None:
    """Play `schedule` in one session; each retry must get the retried call's answer, byte for
    byte, and the log must hold one call per new turn."""
    session_id = "r-" + uuid.uuid4().hex[:8]
    messages = [{"role": "user", "content": f"hello from {session_id}"}]
    last: tuple[bytes, dict[str, str], bytes] | None = None  # body, headers, answer
    new_turns = 0
    async with httpx.AsyncClient(timeout=60) as http:
        async with gateway.session(session_id, **identity(uid=session_id)) as s:
            for kind, stream, keyed in schedule:
                if kind == RETRY and last is not None:
                    body, headers, answer = last
                    again = await post(http, s, body, {**headers, "x-stainless-retry-count": "1"})
                    assert again.status_code == 200, again.text
                    assert again.content == answer  # the same answer, not a new sample
                    continue
                body = chat_body(messages, stream)
                headers = {"x-stainless-retry-count": "0"}
                if keyed:  # a client that sends a key with every request, kept over its retries
                    headers["idempotency-key"] = uuid.uuid4().hex
                reply = await post(http, s, body, headers)
                assert reply.status_code == 200, reply.text
                last = (body, headers, reply.content)
                new_turns += 1
                messages += [
                    {"role": "assistant", "content": answer_text(reply.content, stream)},
                    {"role": "user", "content": f"turn {new_turns}"},
                ]
        handle = await gateway.ledger.load_session(session_id)
    assert len(handle.view.recorded_calls()) == new_turns  # a retry records nothing
    assert handle.view.calls_failed == 0
    assert handle.state == "succeeded"


_schedules = st.lists(
    st.tuples(st.sampled_from([NEW, RETRY]), st.booleans(), st.booleans()), min_size=1, max_size=8
)


async def test_a_retried_call_gets_its_answer_again_and_is_recorded_once(url: str) -> None:
    async with stack(url) as (gateway, _):
        loop = asyncio.get_running_loop()

        @settings(
            max_examples=15,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(schedule=_schedules)
        def schedules(schedule: list[tuple[str, bool, bool]]) -> None:
            asyncio.run_coroutine_threadsafe(run_schedule(gateway, schedule), loop).result(120)

        await asyncio.to_thread(schedules)


async def test_the_same_request_unmarked_is_a_new_call(url: str) -> None:
    """An agent may ask the same thing twice to sample again: without a retry mark, a second call."""
    async with stack(url) as (gateway, standin), httpx.AsyncClient(timeout=60) as http:
        async with gateway.session("twice", **identity()) as s:
            body = chat_body([{"role": "user", "content": "roll a die"}], stream=False)
            for _ in range(2):
                reply = await post(http, s, body, {"x-stainless-retry-count": "0"})
                assert reply.status_code == 200, reply.text
            handle = s.handle
        assert len(standin.answered) == 2
        assert len(handle.view.recorded_calls()) == 2


async def test_a_retry_while_the_call_is_in_flight_waits_for_its_answer(url: str) -> None:
    """The client gave up waiting and asked again: one call upstream, one record, one answer."""
    async with stack(url) as (gateway, standin), httpx.AsyncClient(timeout=60) as http:
        async with gateway.session("inflight", **identity()) as s:
            body = chat_body([{"role": "user", "content": "think hard"}], True, model="stall")
            first = asyncio.ensure_future(post(http, s, body, {"x-stainless-retry-count": "0"}))
            while not standin.requests:  # the first call reached the server and stalls there
                await asyncio.sleep(0.005)
            retry = asyncio.ensure_future(post(http, s, body, {"x-stainless-retry-count": "1"}))
            await asyncio.sleep(0.05)  # let the retry reach the gateway (either order must pass)
            standin.release.set()
            replies = await asyncio.gather(first, retry)
            handle = s.handle
        assert [r.status_code for r in replies] == [200, 200]
        assert replies[0].content == replies[1].content
        assert len(standin.requests) == 1
        assert len(handle.view.recorded_calls()) == 1


async def test_after_a_restart_a_retry_of_a_lost_answer_fails_the_session_closed(url: str) -> None:
    """The log holds an answer the agent never saw: the session cannot go on truthfully."""
    secret = new_gateway_key()  # kept over the restart, so the agent's key still works
    async with stack(url, key=secret) as (gateway, _), httpx.AsyncClient(timeout=60) as http:
        await gateway.create("lost", **identity())
        from sessions.gateway.gateway import GatewaySession

        s = GatewaySession(gateway, await gateway.live("lost"))
        body = chat_body([{"role": "user", "content": "hello"}], stream=False)
        assert (await post(http, s, body, {"x-stainless-retry-count": "0"})).status_code == 200
        key = s.api_key
    async with stack(url, key=secret) as (gateway, standin), httpx.AsyncClient(timeout=60) as http:
        base = gateway.session_base_url("lost")
        again = await http.post(
            base + "/chat/completions",
            content=body,
            headers={
                "authorization": f"Bearer {key}",
                "content-type": "application/json",
                "x-stainless-retry-count": "1",
            },
        )
        assert again.status_code == 409
        assert again.json()["error"]["type"] == "answer_lost"
        assert standin.requests == []  # nothing forwarded, nothing recorded
        handle = await gateway.ledger.load_session("lost")
    assert handle.state == "failed"
    assert handle.view.failure_reason == INCOMPLETE_CAPTURE
    assert handle.view.error_type == "AnswerLost"
    assert len(handle.view.recorded_calls()) == 1


async def test_after_a_restart_a_session_with_a_call_in_flight_fails_closed_at_once(
    url: str,
) -> None:
    secret = new_gateway_key()
    async with stack(url, key=secret) as (gateway, _):
        await gateway.create("open", **identity())
        live = await gateway.live("open")
        await live.handle.start_call(sampling={})  # the dead process's call: intent, no record
        key = gateway.keys.key_for("open")
    async with stack(url, key=secret) as (gateway, standin), httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(
            gateway.session_base_url("open") + "/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "more"}]},
            headers={"authorization": f"Bearer {key}"},
        )
        assert reply.status_code == 409
        assert reply.json()["error"]["type"] == "session_ended"
        assert standin.requests == []
        ended = await gateway.end("open")  # the training side's end keeps the recovery's
        handle = await gateway.ledger.load_session("open")
    assert ended == "failed" and handle.state == "failed"
    assert handle.view.failure_reason == INCOMPLETE_CAPTURE
    assert handle.view.error_type == "GatewayRestarted"
    assert calls.full_prompts(handle.view.recorded_calls()) == []
