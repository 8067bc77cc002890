"""The row a conversation makes through the gateway is the row the same conversation makes
through the Python runner API (`start_call` / `record_call` by hand): one front door more, not
another path."""

from __future__ import annotations

import torch

from sessions import SessionHandle
from sessions.gateway.standin import WEIGHTS_VERSION
from tests.gateway.conftest import identity, stack
from tests.gateway.test_recording import client, converse


async def test_the_gateway_row_is_the_runner_api_row(url: str) -> None:
    async with stack(url) as (gateway, standin):
        async with gateway.session("via-gateway", **identity(index=0, group_size=2)) as s:
            await converse(client(s), stream=False, turns=3)
            await s.post_reward(0.5)
        answered = list(standin.answered)

        async def runner(handle: SessionHandle) -> None:
            for call in answered:
                call_id = await handle.start_call()
                await handle.record_call(
                    call_id,
                    prompt_ids=call["prompt_ids"],
                    response_ids=call["response_ids"],
                    response_logprobs=call["logprobs"],
                    finish_reason="stop",
                    min_version=WEIGHTS_VERSION,
                )
            await handle.post_reward(0.5)

        outcome = await gateway.ledger.run_session(
            runner, "via-runner", **identity(index=1, group_size=2)
        )
        assert outcome.succeeded
        batch = await gateway.ledger.batch("train", 0, timeout=60)
        ids = list(batch["session_id"])
        a, b = ids.index("via-gateway"), ids.index("via-runner")
        compared = [k for k, v in batch.items() if isinstance(v, torch.Tensor)]
        assert {"prompts", "responses", "response_mask"} <= set(compared)
        for key in compared:
            assert torch.equal(batch[key][a], batch[key][b]), key
        for key in ("min_global_steps", "max_global_steps", "failure_reason", "num_turns"):
            if key in batch.keys():
                assert batch[key][a] == batch[key][b], key
