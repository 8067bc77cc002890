"""Unbiased seq-mean losses in verl's worker path: per-row advantage weights.

In verl 0.9.1's worker loss (``workers/utils/losses.py`` ``ppo_loss`` -> ``agg_loss``), the
seq-mean ``loss_agg_mode``s sum each mini-batch's sequence losses over the rows with a loss token
and divide by ``global_batch_size`` = ``ppo_mini_batch_size x rollout.n``, the mini-batch's row
count. Placeholder and filler rows have no loss token, so they add nothing above the line and
count below it: the mini-batch's loss (and gradient) shrinks by R / G, its share of trainable
rows -- a learning-rate cut that follows the failure rate. ``token-mean`` divides by the global
token count and is unaffected; so is ``agg_loss`` called without global batch info (it then
divides by the trainable rows itself).

The fix: weight each trainable row's advantage by G / R of its mini-batch (0 on the rest). The
clipped PPO surrogate is positively homogeneous in the advantage, so the policy-gradient loss
and its gradient become exactly the mean over the trainable rows. It does not reach the entropy
and KL-loss terms (``entropy_coeff``, ``use_kl_loss``; both off by default in verl), which keep
the R / G factor.

Mini-batches are what verl's worker makes with ``actor.shuffle=False`` (its default): the batch
is split into ``dp_size`` contiguous shards (``DataProto.chunk``), each rank walks its shard in
order, and mini-batch m is every rank's m-th slice. Compute the weights after ``_balance_batch``
(it reorders rows). With ``shuffle=True`` membership is random: pass ``mini_batch_size`` = the
batch size for a batch-wide correction, exact on average only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from sessions.errors import InvalidArgument

if TYPE_CHECKING:
    from verl.protocol import DataProto

__all__ = ["SEQ_MEAN_MODES", "seq_mean_weights", "unbiased_seq_mean"]

SEQ_MEAN_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_TOKEN_MODES = ("token-mean", "token-sum")


def seq_mean_weights(
    response_mask: torch.Tensor, *, loss_agg_mode: str, mini_batch_size: int, dp_size: int = 1
) -> torch.Tensor:
    """Per-row factors [B] (float32) that make a seq-mean loss the mean over trainable rows.

    ``mini_batch_size``: rows per optimizer step over all ranks, i.e. verl's
    ``actor.ppo_mini_batch_size x rollout.n``. Token modes get ones (nothing to fix).
    """
    if loss_agg_mode in _TOKEN_MODES:
        return torch.ones(response_mask.shape[0], dtype=torch.float32)
    if loss_agg_mode not in SEQ_MEAN_MODES:
        raise InvalidArgument(
            f"unknown loss_agg_mode {loss_agg_mode!r}; verl's are {_TOKEN_MODES + SEQ_MEAN_MODES}"
        )
    rows = int(response_mask.shape[0])
    for name, value in (("mini_batch_size", mini_batch_size), ("dp_size", dp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"{name} must be an integer >= 1, got {value!r}")
    if mini_batch_size % dp_size:
        raise InvalidArgument(
            f"mini_batch_size {mini_batch_size} must be a multiple of dp_size {dp_size}, as verl's worker asserts"
        )
    if rows % mini_batch_size:
        raise InvalidArgument(
            f"{rows} rows do not split into mini-batches of {mini_batch_size}, and verl's worker would refuse them "
            f"too; pad the batch first: to_data_proto(batch, pad_to_multiple={mini_batch_size})"
        )
    shard, per_rank = rows // dp_size, mini_batch_size // dp_size
    position = torch.arange(rows)
    mini_batch = (
        position % shard
    ) // per_rank  # row i is on rank i // shard, at local index i % shard
    trainable = (response_mask.sum(-1) > 0).to(torch.float64).cpu()
    count = torch.zeros(shard // per_rank, dtype=torch.float64).index_add_(0, mini_batch, trainable)
    weights = trainable * mini_batch_size / count[mini_batch].clamp(min=1)
    return weights.to(torch.float32)


@contextmanager
def unbiased_seq_mean(
    dp: DataProto, *, loss_agg_mode: str, mini_batch_size: int, dp_size: int = 1
) -> Iterator[torch.Tensor]:
    """Within the block, ``dp.batch["advantages"]`` carries the ``seq_mean_weights``; restored after.

    Wrap the actor update so logged ``critic/advantages/*`` stay the unweighted ones::

        class Trainer(RayPPOTrainer):
            def _update_actor(self, batch):
                actor = self.config.actor_rollout_ref.actor
                with unbiased_seq_mean(batch, loss_agg_mode=actor.loss_agg_mode,
                                       mini_batch_size=actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n,
                                       dp_size=self._get_dp_size(self.actor_rollout_wg, "actor")):
                    return super()._update_actor(batch)

    Yields the weights.
    """
    if "advantages" not in dp.batch.keys():
        raise InvalidArgument(
            "the DataProto has no 'advantages' yet; compute them (e.g. GRPO) before the actor update"
        )
    weights = seq_mean_weights(
        dp.batch["response_mask"],
        loss_agg_mode=loss_agg_mode,
        mini_batch_size=mini_batch_size,
        dp_size=dp_size,
    )
    original = dp.batch["advantages"]
    dp.batch["advantages"] = original * weights.to(original.device, original.dtype).unsqueeze(-1)
    try:
        yield weights
    finally:
        dp.batch["advantages"] = original
