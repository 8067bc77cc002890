"""Agent loops of a verl user's own, named by class path in the tests' agent-loop entries.

* ``SelfScoringLoop``: verl's single-turn loop that scores its own output (``reward_score`` and
  ``reward_extra_info`` set by the loop, as a loop that calls its verifier inside does), so
  verl passes no reward worker and a placeholder cannot learn the reward function's keys from
  verl; ``SUCCESS_GATE``, when set by a test, holds each success until the test opens it.
* ``BrokenConstructorLoop``: a loop whose constructor raises (a missing setting of the user's).
"""

from __future__ import annotations

import asyncio
from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

#: when a test sets it, every successful run waits for it before it returns
SUCCESS_GATE: asyncio.Event | None = None


class SelfScoringLoop(SingleTurnAgentLoop):
    """Scores itself: ``acc`` 1.0 when the answer holds the ground truth, ``pred`` its tail."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        output = await super().run(sampling_params, **kwargs)
        text = self.tokenizer.decode(output.response_ids)
        acc = float(str(kwargs["reward_model"]["ground_truth"]) in text)
        output.reward_score = acc
        output.extra_fields["reward_extra_info"] = {"acc": acc, "pred": text[-6:]}
        if SUCCESS_GATE is not None:
            await SUCCESS_GATE.wait()
        return output


class BrokenConstructorLoop(SingleTurnAgentLoop):
    """A user's loop whose constructor fails (the key it needs is not set)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("JUDGE_API_KEY is not set")
