"""Reference GRPO outcome advantage that can keep placeholders out of the group baseline.

Follows verl's ``compute_grpo_outcome_advantage`` (trainer/ppo/core_algos.py): sequence score =
unmasked ``rm_scores.sum(-1)``; rows grouped by ``uid``; per group the mean and the unbiased
(``torch.std``) standard deviation; a group of one gets mean 0 and std 1; advantage
``(score - mean) / (std + epsilon)`` (or ``score - mean`` without std normalisation), broadcast
over the response and multiplied by ``response_mask``.

The difference (docs/design.md §5): in verl a masked row's reward still moves its siblings'
advantages, because masking stops at the loss, not at the baseline. With
``exclude_placeholders=True`` placeholder rows are left out of their group's statistics (the
group is computed as if they were absent, including the group-of-one rule) and get advantage 0.

``min_valid`` (default 2, as NeMo-RL and TRL): a group with fewer included rows than that gives no
signal — every row of it gets advantage 0 (verl would give a lone row its raw score). With
``min_valid=1`` and ``exclude_placeholders=False`` this is verl's function exactly. The ledger
counts such train groups under ``groups/below_min_valid``. Isolating placeholders into groups of
their own (``to_data_proto(isolate_placeholders=True)``) then running this with
``exclude_placeholders=False`` gives the same advantages as excluding them: a placeholder alone
has no valid member, and its siblings' group keeps its valid rows.

Statistics are computed in float64 and the result cast to float32, so a group of identical
scores gives exactly 0 rather than float32 rounding noise divided by ``epsilon``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import torch
from tensordict import TensorDictBase

from sessions.batches import non_tensor
from sessions.batches.collect import check_batch, check_flag
from sessions.errors import InvalidArgument, InvalidArgumentType
from sessions.events import DEFAULT_MIN_VALID

__all__ = ["grpo_outcome_advantage"]


def _group_index(uids: Sequence[Any]) -> tuple[torch.Tensor, int]:
    """Dense group ids in first-seen order (one dict lookup per row; no per-token work)."""
    missing = [i for i, uid in enumerate(uids) if uid is None]
    if missing:
        raise InvalidArgument(f"rows {missing[:5]} have no uid; GRPO needs a group for every row")
    codes: dict[Any, int] = {}
    ids = [codes.setdefault(uid, len(codes)) for uid in uids]
    return torch.tensor(ids, dtype=torch.int64), len(codes)


def _group_mean_std(
    scores: torch.Tensor, group: torch.Tensor, include: torch.Tensor, n_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and unbiased std over included rows; groups of <= 1 row -> (0, 1)."""
    weight = include.to(scores.dtype)
    count = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, group, weight)
    total = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, group, scores * weight)
    mean = total / count.clamp(min=1)
    deviation = (scores - mean[group]) * weight
    sq = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, group, deviation * deviation)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count <= 1
    return mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0)


def grpo_outcome_advantage(
    batch: TensorDictBase,
    *,
    exclude_placeholders: bool = True,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
    min_valid: int = DEFAULT_MIN_VALID,
) -> torch.Tensor:
    """GRPO outcome advantage [B, R] float32 for a padded section 6 batch.

    Needs ``rm_scores``, ``response_mask``, the ``uid`` non-tensor column and (when excluding)
    ``is_placeholder``. A jagged batch must be ``densify``-ed first.
    """
    check_batch(batch, "grpo_outcome_advantage")
    exclude_placeholders = check_flag(exclude_placeholders, "exclude_placeholders")
    norm_by_std = check_flag(norm_by_std, "norm_by_std")
    if (
        isinstance(epsilon, bool)
        or not isinstance(epsilon, numbers.Real)
        or not 0 <= epsilon < math.inf
    ):
        raise InvalidArgument(
            f"epsilon must be a finite number >= 0, got {epsilon!r}", argument="epsilon"
        )
    rm_scores = batch.get("rm_scores")
    if rm_scores.is_nested:
        raise InvalidArgumentType(
            "grpo_outcome_advantage needs a padded batch; densify() the jagged one"
        )
    response_mask = batch.get("response_mask")
    scores = rm_scores.sum(-1).to(torch.float64)
    group, n_groups = _group_index(non_tensor(batch, "uid"))
    if exclude_placeholders:
        include = ~batch.get("is_placeholder").to(torch.bool)
    else:
        include = torch.ones_like(scores, dtype=torch.bool)
    if isinstance(min_valid, bool) or not isinstance(min_valid, int) or min_valid < 0:
        raise InvalidArgument(f"min_valid must be an integer >= 0, got {min_valid!r}")
    mean, std = _group_mean_std(scores, group, include, n_groups)
    centred = scores - mean[group]
    scalar = centred / (std[group] + epsilon) if norm_by_std else centred
    valid = torch.zeros(n_groups, dtype=torch.int64).index_add_(0, group, include.to(torch.int64))
    signal = include & (valid[group] >= min_valid)
    scalar = torch.where(signal, scalar, torch.zeros_like(scalar))
    return (scalar.unsqueeze(-1) * response_mask.to(torch.float64)).to(torch.float32)
