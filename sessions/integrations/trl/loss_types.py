"""Which of TRL's loss types average over placeholder rows, and the factor that undoes it.

In TRL 1.16's `GRPOTrainer._compute_loss` a placeholder (no loss token: `env_mask` 0, advantage
0) adds nothing to any loss's numerator. The denominators differ:

- `grpo`, `sapo`: the mean over the micro-batch's rows of each row's token mean (`mask.sum(-1)`
  clamped at 1), so a placeholder is a row of zero loss that still counts;
- `luspo`: the mean over rows of each row's token sum: the same;
- `dr_grpo`: the token sum over rows × `max_completion_length`: the same;
- `dapo` (the default), `cispo`, `vespo`: the step's loss-token count (`num_items_in_batch`), and
  `bnpo`: the micro-batch's loss-token count; a placeholder adds no token, so they are honest.

With R rows that have a loss token among the G rows of an optimizer step (all ranks, every
micro-batch of its gradient accumulation), the row-mean types give R/G times the loss over the
trainable rows, and so the gradient. Scaling the advantages (and the KL coefficient) of the
step by G/R gives exactly the loss over trainable rows (`trainer.py`, tested in
`tests/integrations/trl/test_trl.py`). A row TRL masks itself (`mask_truncated_completions`) has no loss token
either, and so leaves the denominator too.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ROW_MEAN_LOSS_TYPES", "TOKEN_MEAN_LOSS_TYPES", "step_scale"]

ROW_MEAN_LOSS_TYPES = frozenset({"grpo", "sapo", "luspo", "dr_grpo"})
TOKEN_MEAN_LOSS_TYPES = frozenset({"dapo", "bnpo", "cispo", "vespo"})


def step_scale(
    counts: Sequence[Sequence[float]],
    window: range,
    *,
    steps_per_generation: int,
    generate_every: int,
) -> float:
    """G/R of the optimizer step whose micro-batches are `window` (TRL's `_step` values).

    `counts[j]` = (rows with a loss token, rows) of the current generation's micro-batch j,
    summed over ranks. A step whose micro-batches come from two generations (TRL generated
    mid-step: `steps_per_generation x num_iterations` not a multiple of the accumulation) takes
    the current generation's G/R as a whole, the nearest figure known when its loss is computed.
    """
    if len({s // generate_every for s in window}) == 1:
        picks: Sequence[int] = [s % steps_per_generation for s in window]
    else:
        picks = range(len(counts))
    trainable = sum(counts[j][0] for j in picks)
    rows = sum(counts[j][1] for j in picks)
    return float(rows / trainable) if trainable > 0 else 1.0
