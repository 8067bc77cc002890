"""The reward function the verl agent-loop tests give verl (``reward.custom_reward_function.path``).

verl's reward worker loads it by path and calls it per response, as it would a user's: a
verifiable toy task (does the answer contain the ground truth?) with a dict result, so
``reward_extra_info`` carries a number (``acc``) and a string (``pred``) beside ``score``. A
ground truth of ``"crash"`` makes it raise: the injected verifier failure.
"""

from __future__ import annotations

from typing import Any


class VerifierCrashed(RuntimeError):
    """The injected failure of the reward function."""


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any
) -> dict[str, Any]:
    if ground_truth == "crash":
        raise VerifierCrashed("injected: the verifier crashed")
    acc = float(ground_truth in solution_str)
    return {"score": acc, "acc": acc, "pred": solution_str[-6:]}
