"""The ``AgentLoopOutput`` a failed agent loop returns: the ledger's placeholder in verl's schema.

verl builds the step's batch from its rows' outputs and takes the batch's schema from row 0
(``AgentLoopWorker._postprocess``): ``rollout_log_probs`` only if row 0 has log-probs, the
``reward_extra_info`` keys only from row 0, ``rm_scores`` only if every row has a
``reward_score``. A placeholder that lacks any of them drops the column for the whole batch at
row 0 and raises (``TypeError`` / ``KeyError``) at any later row. So the placeholder carries:

* the §5 shape (docs/design.md): ``prompt_length`` + ``response_length`` tokens of the policy's
  ``token_id``, response mask 0, ``num_turns`` 0;
* log-probs (0.0 per response token) exactly when the sampling parameters ask the server for
  them (``logprobs``, verl's ``rollout.calculate_log_probs``), as every sibling's output has;
* ``reward_score`` 0.0 always: where the siblings are scored every row has one, and where they
  are not, ``rm_scores`` is dropped with or without it;
* ``reward_extra_info`` with the keys the reward function gives (declared in
  ``+ledger.reward_keys``, remembered from this process's last output, or scored on the
  placeholder's own tokens by verl's reward worker only to learn them: ``loop``), each valued as the ledger fills a placeholder's missing key
  (``sessions.batches.reward_info.default_for``: 0.0 for numbers, False, "", else None), so
  ``acc`` and the like count a failure as zero in verl's figures as in the ledger's;
* ``is_placeholder`` True and ``failure_reason`` in ``extra_fields`` (verl makes them non-tensor
  columns; successful rows leave them None), and ``min_global_steps`` / ``max_global_steps`` at
  the sample's step (no weights generated it), which V1's staleness tags read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sessions.batches.reward_info import default_for
from sessions.placeholder import PlaceholderPolicy

__all__ = [
    "FAILURE_REASON",
    "IS_PLACEHOLDER",
    "placeholder_output",
    "placeholder_reward_info",
    "wants_logprobs",
]

#: extra_fields keys the placeholder carries (non-tensor columns in verl's batch)
IS_PLACEHOLDER = "is_placeholder"
FAILURE_REASON = "failure_reason"


def wants_logprobs(sampling_params: Mapping[str, Any]) -> bool:
    """Whether the rollout asks the server for log-probs (so every sibling carries them)."""
    return bool(sampling_params.get("logprobs"))


def placeholder_reward_info(keys_and_values: Mapping[str, Any]) -> dict[str, Any]:
    """The reward function's keys, each with the value the ledger gives a placeholder's missing key."""
    return {key: default_for([value]) for key, value in keys_and_values.items()}


def placeholder_output(
    policy: PlaceholderPolicy,
    *,
    reason: str,
    logprobs: bool,
    reward_info: Mapping[str, Any] | None,
    global_step: int | None,
) -> Any:
    """A placeholder ``AgentLoopOutput`` for a session that failed with ``reason``."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    response = policy.response_length
    extra: dict[str, Any] = {
        IS_PLACEHOLDER: True,
        FAILURE_REASON: reason,
        "turn_scores": [],
        "tool_rewards": [],
        "min_global_steps": global_step,
        "max_global_steps": global_step,
    }
    if reward_info is not None:
        extra["reward_extra_info"] = dict(reward_info)
    return AgentLoopOutput(
        prompt_ids=[policy.token_id] * policy.prompt_length,
        response_ids=[policy.token_id] * response,
        response_mask=[0] * response,
        response_logprobs=[0.0] * response if logprobs else None,
        reward_score=0.0,
        num_turns=0,
        metrics=AgentLoopMetrics(),
        extra_fields=extra,
    )
