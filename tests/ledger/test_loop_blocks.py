"""A runner that blocks the event loop is named (issue 39; docs/design.md §12).

A synchronous call inside an async runner (a blocking `generate`) stops every session of the loop,
so the others time out although their own work was fine. `run_session` times each runner step
(the code between two awaits): a step of `LOOP_BLOCK_S` or longer is logged, and every timeout it
caused says how long the loop was blocked and by which runner of which session.

The block is a real synchronous call (`time.sleep` standing in for a blocking client): the
measured step is at least its length whatever the machine's load, and the session it starves is
made to be waiting while it happens (an event it sets first), so the verdict does not depend on
timing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from sessions import Ledger, SessionHandle
from sessions.ledger.attempts import LOOP_BLOCK_S

KW: dict[str, Any] = {"group_size": 2, "partition": "val", "global_step": 0}
BLOCK_S = LOOP_BLOCK_S * 3


async def test_a_blocking_runner_is_named_in_the_timeouts_it_causes(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sessions.ledger.attempts")
    waiting = asyncio.Event()

    async def blocking_generate(handle: SessionHandle) -> None:
        await waiting.wait()  # the other session is inside its attempt now
        time.sleep(BLOCK_S)  # a synchronous client call inside `async def`: the loop stands still
        await handle.record_trajectory(prompt_ids=[1], response_ids=[2])
        await handle.post_reward(1.0)

    async def patient(handle: SessionHandle) -> None:
        waiting.set()
        await asyncio.Event().wait()  # its tool call never returns: only the timeout ends it

    async with Ledger.open(db_url) as ledger:
        blocker, starved = await asyncio.gather(
            ledger.run_session(
                blocking_generate, "blocker", uid="g", session_index=0, timeout=30, **KW
            ),
            ledger.run_session(
                patient, "starved", uid="g", session_index=1, timeout=BLOCK_S / 3, **KW
            ),
        )
    assert blocker.state == "succeeded", blocker
    assert (starved.state, starved.failure_reason) == ("failed", "timeout")
    message = str(starved.error)
    assert "event loop was blocked" in message and "session 'blocker'" in message, message
    assert "blocking_generate" in message and "asyncio.to_thread" in message, message
    seconds = float(message.split("the longest, ")[1].split("s,")[0])
    assert seconds >= round(BLOCK_S, 2), message  # the message rounds to 1/100 s
    warned = [r.getMessage() for r in caplog.records if "blocked the event loop" in r.getMessage()]
    assert len(warned) == 1 and "blocking_generate" in warned[0] and "blocker" in warned[0]


async def test_a_runner_that_awaits_is_not_blamed(tmp_path: Any) -> None:
    """A plain timeout (the runner only waits) says nothing of blocks: none happened."""

    async def waits(handle: SessionHandle) -> None:
        await asyncio.Event().wait()

    async with Ledger.open(tmp_path / "ledger.db") as ledger:
        outcome = await ledger.run_session(
            waits, "quiet", uid="q", session_index=0, timeout=0.05, **{**KW, "group_size": 1}
        )
    assert outcome.failure_reason == "timeout"
    assert "blocked" not in str(outcome.error)
