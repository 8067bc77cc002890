"""A gateway killed with SIGKILL mid-calls and started again: every answer an agent received is in
the log; a call left with an intent and no record fails its session closed when it ends; the
agents' keys work against the new process."""

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
    session: dict[str, Any], received: list[list[int]], total: list[int], enough: asyncio.Event
) -> None:
    """Call until the gateway goes away; each answered call's prompt noted."""
    agent = openai.AsyncOpenAI(
        base_url=session["base_url"], api_key=session["api_key"], max_retries=0, timeout=60
    )
    messages = [{"role": "user", "content": f"start {session['session_id']}"}]
    while True:
        try:
            reply = await agent.chat.completions.create(model="slow", messages=messages)
        except openai.APIError:
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
                asyncio.ensure_future(agent_loop(s, received[s["session_id"]], total, enough))
                for s in sessions
            ]
            await asyncio.wait_for(enough.wait(), 120)
            process.send_signal(signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*loops), 120)
        answered = sum(len(r) for r in received.values())
        assert answered >= KILL_AFTER
        async with Ledger.open(url) as ledger:
            open_at_kill = {}
            for session_id, prompts in received.items():
                handle = await ledger.load_session(session_id)
                recorded = handle.view.recorded_calls()
                full = [p.tolist() for p, _ in calls.full_prompts(recorded)]
                assert full[: len(prompts)] == prompts  # every answer received was recorded
                assert len(full) <= len(prompts) + 1  # at most one recorded, then lost
                open_at_kill[session_id] = bool(handle.view.open_calls())
        async with gateway_process(url, upstream, key_file) as (base, admin, _):
            auth = {"authorization": f"Bearer {admin}"}
            for s in sessions:  # the agents' keys work against the new process
                agent = openai.AsyncOpenAI(
                    base_url=s["base_url"].replace(s["base_url"].split("/sessions/")[0], base),
                    api_key=s["api_key"],
                    max_retries=0,
                )
                await agent.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "again"}]
                )
                ended = await http.post(
                    base + f"/sessions/{s['session_id']}/end", json={}, headers=auth
                )
                assert ended.status_code == 200, ended.text
        async with Ledger.open(url) as ledger:
            for session_id, was_open in open_at_kill.items():
                handle = await ledger.load_session(session_id)
                if was_open:  # fail closed: never a silently short row
                    assert handle.state == "failed"
                    assert handle.view.failure_reason == "incomplete_capture"
                else:
                    assert handle.state == "succeeded"
    print(
        f"kill-restart: {SESSIONS} sessions, {answered} answers received before the kill, all "
        f"recorded; {sum(open_at_kill.values())} session(s) had a call in flight and failed closed"
    )
