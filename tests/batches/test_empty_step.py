"""A step without log-probs has every column a normal step's has, when asked.

`Ledger.batch(..., logprobs=True)` gives the padded batch `rollout_log_probs` whether or not a row
carries log-probs, so a step with no sessions (or only placeholders) concatenates with a step
whose trajectories carry them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sessions import ConfigError, Ledger
from sessions.batches.convert import concat_padded


async def test_an_empty_step_concatenates_with_a_step_that_has_log_probs(tmp_path: Path) -> None:
    async with Ledger.open(str(tmp_path / "l.db")) as ledger:
        kw = {"uid": "u0", "session_index": 0, "group_size": 1, "partition": "train"}
        async with ledger.session("s0", global_step=0, **kw) as s:
            await s.record_trajectory(
                prompt_ids=[1, 2],
                response_ids=[3, 4],
                response_mask=[1, 1],
                response_logprobs=[-0.5, -0.25],
                num_turns=1,
            )
            await s.post_reward(1.0)
        async with ledger.session("s1", global_step=1, **kw) as s:
            await s.fail("sandbox_error")  # the step's one row is a placeholder, no log-probs
        full = await ledger.batch("train", 0, timeout=5)
        empty = await ledger.batch("train", 1, timeout=5, logprobs=True)
        assert bool(empty["is_placeholder"].all()) and set(full.keys()) == set(empty.keys())
        without = await ledger.batch("train", 1, timeout=5)
        assert "rollout_log_probs" not in without.keys()
        both = concat_padded([full, empty])
        assert torch.equal(both["rollout_log_probs"][:1, :2], full["rollout_log_probs"])
        assert not both["rollout_log_probs"][1:].any()
        with pytest.raises(ConfigError, match="jagged"):
            await ledger.batch("train", 1, timeout=5, jagged=True, logprobs=True)
