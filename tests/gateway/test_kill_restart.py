"""A gateway killed with SIGKILL mid-calls and started again: every answer an agent received is in
the log; a session left with a call in flight fails closed on recovery; an agent's retry of the
call it lost is never recorded twice; the agents' keys work against the new process."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx
import openai

from sessions import calls
from sessions.gateway.standin import StandIn, chat_prompt, serving
from sessions.ledger import Ledger
from tests.gateway.test_cli import gateway_process

SESSIONS = 8
KILL_AFTER = 24  # answers received in all before the kill


async def agent_loop(
    session: dict[str, Any],
    received: list[list[int]],
    total: list[int],
    enough: asyncio.Event,
    pending: dict[str, list[dict[str, str]]],
) -> None:
    """Call until the gateway goes away; each answered call's prompt noted, and the conversation
    of the call that got no answer kept for the retry."""
    agent = openai.AsyncOpenAI(
        base_url=session["base_url"], api_key=session["api_key"], max_retries=0, timeout=60
    )
    messages = [{"role": "user", "content": f"start {session['session_id']}"}]
    while True:
        try:
            reply = await agent.chat.completions.create(model="slow", messages=messages)
        except openai.APIError:
            pending[session["session_id"]] = list(messages)
            return
        received.append(chat_prompt(messages))
        total[0] += 1
        if total[0] >= KILL_AFTER:
            enough.set()
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"tool {len(received)}"},
        ]


async def test_a_killed_gateway_loses_no_answered_call(url: str, tmp_path: Path) -> None:
    async with Ledger.open(url):
        pass
    standin = StandIn()
    key_file = tmp_path / "gateway.key"
    received: dict[str, list[list[int]]] = {}
    pending: dict[str, list[dict[str, str]]] = {}
    async with serving(standin.app) as upstream, httpx.AsyncClient() as http:
        async with gateway_process(url, upstream, key_file) as (base, admin, process):
            auth = {"authorization": f"Bearer {admin}"}
            sessions = []
            for n in range(SESSIONS):
                made = await http.post(
                    base + "/sessions",
                    json={
                        "session_id": f"k{n}",
                        "uid": f"u{n}",
                        "session_index": 0,
                        "group_size": 1,
                        "partition": "train",
                        "global_step": 0,
                    },
                    headers=auth,
                )
                assert made.status_code == 201, made.text
                sessions.append(made.json())
                received[f"k{n}"] = []
            total, enough = [0], asyncio.Event()
            loops = [
                asyncio.ensure_future(
                    agent_loop(s, received[s["session_id"]], total, enough, pending)
                )
                for s in sessions
            ]
            await asyncio.wait_for(enough.wait(), 120)
            process.send_signal(signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*loops), 120)
        answered = sum(len(r) for r in received.values())
        assert answered >= KILL_AFTER
        # what the log holds of each session at the kill
        lost: dict[str, str] = {}  # session -> what its retry must meet
        async with Ledger.open(url) as ledger:
            for session_id, prompts in received.items():
                handle = await ledger.load_session(session_id)
                recorded = handle.view.recorded_calls()
                full = [p.tolist() for p, _ in calls.full_prompts(recorded)]
                assert full[: len(prompts)] == prompts  # every answer received was recorded
                assert len(full) <= len(prompts) + 1  # at most one recorded, then lost
                if handle.view.open_calls():
                    lost[session_id] = "in_flight"
                elif len(full) > len(prompts):
                    lost[session_id] = "answer_lost"
                else:
                    lost[session_id] = "never_started"
        async with gateway_process(url, upstream, key_file) as (base, admin, _):
            auth = {"authorization": f"Bearer {admin}"}
            for s in sessions:  # each agent retries the call it got no answer to, as the SDK does
                session_id = s["session_id"]
                agent = openai.AsyncOpenAI(
                    base_url=s["base_url"].replace(s["base_url"].split("/sessions/")[0], base),
                    api_key=s["api_key"],
                    max_retries=0,
                )
                retry = agent.chat.completions.create(
                    model="slow",  # the request the agent sent before the kill, byte for byte
                    messages=pending[session_id],
                    extra_headers={"x-stainless-retry-count": "1"},
                )
                if lost[session_id] == "never_started":
                    await retry  # a new call: answered and recorded
                else:
                    try:
                        await retry
                        raise AssertionError(f"{session_id}: a retry after {lost[session_id]}")
                    except openai.ConflictError as refused:
                        expected = (
                            "session_ended" if lost[session_id] == "in_flight" else "answer_lost"
                        )
                        assert refused.body["type"] == expected, refused.body
                ended = await http.post(base + f"/sessions/{session_id}/end", json={}, headers=auth)
                assert ended.status_code == 200, ended.text
        async with Ledger.open(url) as ledger:
            for session_id, prompts in received.items():
                handle = await ledger.load_session(session_id)
                full = [p.tolist() for p, _ in calls.full_prompts(handle.view.recorded_calls())]
                assert len({tuple(p) for p in full}) == len(full)  # nothing recorded twice
                if lost[session_id] == "never_started":
                    assert handle.state == "succeeded" and len(full) == len(prompts) + 1
                else:  # fail closed: never a silently short row, never a row the agent did not see
                    assert handle.state == "failed"
                    assert handle.view.failure_reason == "incomplete_capture"
                    assert len(full) == len(prompts) + (lost[session_id] == "answer_lost")
    counts = {kind: list(lost.values()).count(kind) for kind in sorted(set(lost.values()))}
    print(
        f"kill-restart: {SESSIONS} sessions, {answered} answers received before the kill, all "
        f"recorded; at the kill {counts}; retries recorded nothing twice"
    )
