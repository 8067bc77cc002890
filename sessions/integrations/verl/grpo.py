"""Stock verl GRPO made equal to the ledger's reference: placeholders out, ``min_valid`` honoured.

verl 0.9.1's ``compute_grpo_outcome_advantage`` groups rows by ``uid`` and counts every row in
its group's mean and std: a failed session's 0 moves its siblings' advantages, and a group
left with one real row gives that row its raw score (verl's group-of-one rule: mean 0, std 1).
The reference (``sessions.batches.advantage.grpo_outcome_advantage(..., exclude_placeholders=True,
min_valid=...)``, docs/design.md §5) leaves placeholders out of the statistics and gives a group
with fewer than ``min_valid`` valid rows no signal, which is what the ledger counts under
``groups/below_min_valid``. Two steps make verl's own function give the reference's numbers:

1. each placeholder in a group of its own (``to_data_proto`` does it for ledger batches; here
   ``_isolated_uids`` does it for any DataProto), so stock GRPO keeps it out of its siblings'
   baseline (a lone placeholder: score 0, mean 0 -> advantage 0);
2. ``zero_below_min_valid``: the advantages (and returns) of every row of a group with fewer
   than ``min_valid`` valid rows set to 0.

``ledger_grpo_advantage`` does both around verl's own function. Groups are the prompt's uid
(``group_uid`` when the batch has one, else ``uid``); placeholders are the rows the ledger
(``is_placeholder`` tensor) or the ledger agent loop (``is_placeholder`` True in the non-tensor
column verl builds from ``extra_fields``) marks. The reference computes in float64, verl in
float32: they agree to float32 rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sessions.errors import InvalidArgument
from sessions.events import DEFAULT_MIN_VALID
from sessions.placeholder import GROUP_UID, isolated_uid

if TYPE_CHECKING:
    from verl.protocol import DataProto

__all__ = [
    "ledger_grpo_advantage",
    "zero_below_min_valid",
]


def _placeholder_rows(dp: DataProto) -> np.ndarray:
    """Bool per row: a ledger placeholder (tensor column) or a failed agent-loop run (non-tensor)."""
    if "is_placeholder" in dp.batch.keys():
        return dp.batch["is_placeholder"].cpu().numpy().astype(bool)
    flags = dp.non_tensor_batch.get("is_placeholder")
    if flags is None:
        return np.zeros(len(dp), dtype=bool)
    return np.fromiter((flag is True or flag == 1 for flag in flags), dtype=bool, count=len(dp))


def _group_uids(dp: DataProto) -> np.ndarray:
    """The prompt's uid of each row (``group_uid`` once placeholders were isolated, else ``uid``)."""
    for name in (GROUP_UID, "uid"):
        if name in dp.non_tensor_batch:
            return dp.non_tensor_batch[name]
    raise InvalidArgument(
        "the DataProto has no 'uid' column; GRPO groups rows by it (verl's trainers add one)"
    )


def _isolated_uids(dp: DataProto) -> np.ndarray:
    """The uids with each placeholder row in a group of its own (``{uid}-ph{row}``)."""
    uids = _group_uids(dp).copy()
    taken = set(uids.tolist())
    for row in np.flatnonzero(_placeholder_rows(dp)):
        own = isolated_uid(uids[row], row)
        while own in taken:
            own += "x"
        uids[row] = own
        taken.add(own)
    return uids


def _valid_counts(dp: DataProto) -> np.ndarray:
    """Per row, how many valid (non-placeholder) rows its prompt's group has."""
    groups = _group_uids(dp)
    valid = ~_placeholder_rows(dp)
    counts: dict[Any, int] = {}
    for uid, ok in zip(groups.tolist(), valid.tolist()):
        counts[uid] = counts.get(uid, 0) + int(ok)
    return np.fromiter((counts[uid] for uid in groups.tolist()), dtype=np.int64, count=len(dp))


def zero_below_min_valid(dp: DataProto, min_valid: int = DEFAULT_MIN_VALID) -> int:
    """Zero ``advantages`` (and ``returns``) of the rows whose group has fewer than ``min_valid``
    valid rows, and of placeholders; returns how many rows were zeroed. In place."""
    if isinstance(min_valid, bool) or not isinstance(min_valid, int) or min_valid < 0:
        raise InvalidArgument(f"min_valid must be an integer >= 0, got {min_valid!r}")
    if "advantages" not in dp.batch.keys():
        raise InvalidArgument(
            "the DataProto has no 'advantages' yet; compute them (verl's compute_advantage) first"
        )
    zero = (_valid_counts(dp) < min_valid) | _placeholder_rows(dp)
    if zero.any():
        keep = torch.from_numpy(~zero).to(dp.batch["advantages"].device).unsqueeze(-1)
        for name in ("advantages", "returns"):
            if name in dp.batch.keys():
                dp.batch[name] = dp.batch[name] * keep.to(dp.batch[name].dtype)
    return int(zero.sum())


def ledger_grpo_advantage(
    dp: DataProto,
    *,
    min_valid: int = DEFAULT_MIN_VALID,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> DataProto:
    """verl's own GRPO on isolated placeholders, then ``zero_below_min_valid``: sets
    ``advantages`` and ``returns`` (from ``token_level_rewards``) as the reference gives them."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rewards = dp.batch["token_level_rewards"] if "token_level_rewards" in dp.batch.keys() else None
    if rewards is None:
        raise InvalidArgument(
            "the DataProto has no 'token_level_rewards'; set them (fit sets them from rm_scores) first"
        )
    advantages, returns = compute_grpo_outcome_advantage(
        token_level_rewards=rewards,
        response_mask=dp.batch["response_mask"],
        index=_isolated_uids(dp),
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )
    dp.batch["advantages"], dp.batch["returns"] = advantages, returns
    zero_below_min_valid(dp, min_valid)
    return dp
