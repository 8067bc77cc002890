"""What a step's failures cost (`sessions.projection.costs`, docs/failures.md): every figure on
one hand-computed step, on both backends."""

from __future__ import annotations

import uuid

import pytest

from sessions import Ledger


async def test_one_step_s_cost_figures_by_hand(module_db_url: str) -> None:
    """Step 5, train, min_valid 2. Group A (3 sessions): a success over two calls (3 + 2
    tokens), a sandbox failure after one call (4 tokens), a success handed over whole. Group B
    (2): a success whose first attempt (a call of 5 tokens) was retried for a sandbox error, its
    second a call of 6 tokens, and a runner error with no call: one success, below min_valid, so
    its 6 tokens gave no signal. Group C (2): two timeouts, one after a call of 7 tokens."""
    run = f"cost{uuid.uuid4().hex[:8]}"
    async with Ledger.open(module_db_url, run=run) as ledger:

        async def session(uid: str, index: int, size: int):  # noqa: ANN202
            return await ledger.create_session(
                f"{run}-{uid}{index}",
                uid=f"{run}-{uid}",
                session_index=index,
                group_size=size,
                partition="train",
                global_step=5,
            )

        async def call(handle, prompt: list[int], tokens: int) -> None:  # noqa: ANN001
            await handle.record_call(
                await handle.start_call(),
                prompt_ids=prompt,
                response_ids=list(range(1, tokens + 1)),
            )

        a0, a1, a2 = [await session("a", i, 3) for i in range(3)]
        await call(a0, [9, 9], 3)
        await call(a0, [9, 9, 1, 2, 3, 8], 2)
        await a0.post_reward(1.0)
        await a0.complete()
        await call(a1, [7], 4)
        await a1.fail("sandbox_error")
        await a2.record_trajectory(prompt_ids=[5], response_ids=[6, 6])
        await a2.post_reward(0.5)
        await a2.complete()
        b0, b1 = [await session("b", i, 2) for i in range(2)]
        await call(b0, [4], 5)
        await b0.retry("sandbox_error")
        await b0.start()
        await call(b0, [4], 6)
        await b0.post_reward(1.0)
        await b0.complete()
        await b1.fail("runner_error")
        c0, c1 = [await session("c", i, 2) for i in range(2)]
        await call(c0, [3], 7)
        await c0.fail("timeout")
        await c1.fail("timeout")
        figures = await ledger.metrics_dict("train", 5, timeout=30)
    cost = {k.rsplit("/cost/", 1)[1]: v for k, v in figures.items() if "/all/cost/" in k}
    assert cost == pytest.approx(
        {
            "masked_share": 4 / 7,
            "masked_share/sandbox_error": 1 / 7,
            "masked_share/runner_error": 1 / 7,
            "masked_share/timeout": 2 / 7,
            "reward_gap": 2.5 / 3 - 2.5 / 7,
            "groups_all_failed": 1.0,
            "rows_no_signal": 1.0,
            "wasted_tokens/retried/sandbox_error": 5.0,
            "wasted_tokens/failed/sandbox_error": 4.0,
            "wasted_tokens/failed/timeout": 7.0,
            "wasted_tokens/no_signal/below_min_valid": 6.0,
            "wasted_tokens": 22.0,
        }
    )


async def test_a_group_is_held_to_the_min_valid_its_sessions_recorded(module_db_url: str) -> None:
    """A run recorded with min_valid 1, read by a ledger with the default (2): a group of one
    success and one failure gave GRPO its signal under the run's rule, so no row and no token
    of it is counted as without signal, whatever the reader's own setting."""
    run = f"mv{uuid.uuid4().hex[:8]}"
    async with Ledger.open(module_db_url, run=run, min_valid=1) as ledger:
        ok, bad = [
            await ledger.create_session(
                f"{run}-{i}",
                uid=f"{run}-u",
                session_index=i,
                group_size=2,
                partition="train",
                global_step=0,
            )
            for i in range(2)
        ]
        await ok.record_call(await ok.start_call(), prompt_ids=[1], response_ids=[2, 3])
        await ok.post_reward(1.0)
        await ok.complete()
        await bad.fail("sandbox_error")
    async with Ledger.open(module_db_url, run=run, migrate=False) as reader:
        assert reader.min_valid == 2
        figures = await reader.metrics_dict("train", 0, timeout=30)
    assert figures["ledger/train/all/cost/rows_no_signal"] == 0.0
    assert "ledger/train/all/cost/wasted_tokens/no_signal/below_min_valid" not in figures
