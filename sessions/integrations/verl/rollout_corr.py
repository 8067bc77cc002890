"""verl's ``rollout_corr/*`` diagnostics over the trainable rows only.

verl 0.9.1 (``trainer/ppo/rollout_corr_helper.py``) computes its off-policy diagnostics over
every row of the batch. The token-level ones are masked means and ignore rows without a loss
token, but the per-sequence ones average a per-row value over all rows, and a placeholder's (or
filler row's) value is that of an empty sequence: ``training_ppl`` / ``rollout_ppl`` /
``ppl_ratio`` count it as 1, ``*_log_ppl`` / ``log_ppl_diff`` / ``log_ppl_abs_diff`` as 0,
``chi2_seq`` as a squared ratio of 1, the sequence-level IS statistics (``rollout_is_seq_mean``,
``_std``, ``_min``, ``_max_deviation``, ``_fraction_low``) as a sequence of weight 0, and
``log_ppl_diff_max`` / ``_min`` take its 0 into the extremes. The rejection-sampling figures
(``rollout_rs_*``) already skip such rows. The IS weights and the rejection mask themselves are
right for every row (a row without loss tokens gets weight 0 and stays masked; batch
normalisation excludes it).

So the remedy replaces only the metrics. ``rollout_corr_metrics(dp, config)`` is verl's own
computation over ``trainable_rows(dp)``; ``patch_rollout_corr_metrics()`` points verl's V0 and
V1 trainers at a drop-in for ``compute_rollout_correction_and_add_to_batch`` that returns verl's
own batch with those metrics (V0 looks the function up inside ``fit``, V1 imported it at module
level; both are patched, idempotently).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable

from sessions.errors import MissingDependency
from sessions.integrations.verl.filler import trainable_rows

if TYPE_CHECKING:
    from verl.protocol import DataProto

__all__ = ["patch_rollout_corr_metrics", "rollout_corr_metrics"]

_NAME = "compute_rollout_correction_and_add_to_batch"
_V1_TRAINER = "verl.trainer.ppo.v1.trainer_base"
#: verl's own function, remembered when the patch replaces it
_verl_function: Callable[..., Any] | None = None


def _helper() -> Any:
    try:
        import verl.trainer.ppo.rollout_corr_helper as helper
    except ImportError as error:
        raise MissingDependency(
            "this needs verl: pip install -e '.[verl]' from a clone of rollout-ledger (verl 0.9.1, which pins tensordict 0.10.0)"
        ) from error
    return helper


def _verl_original() -> Callable[..., Any]:
    if _verl_function is not None:
        return _verl_function
    return getattr(_helper(), _NAME)


def rollout_corr_metrics(dp: DataProto, rollout_corr_config: Any) -> dict[str, float]:
    """verl's ``rollout_corr/*`` metrics for this batch, computed by verl over its trainable rows.

    Needs ``old_log_probs``, ``rollout_log_probs`` and ``response_mask`` (as verl's own call).
    """
    rows = trainable_rows(dp).select(
        batch_keys=["old_log_probs", "rollout_log_probs", "response_mask"], deepcopy=True
    )
    _, metrics = _verl_original()(rows, rollout_corr_config)
    return metrics


def _add_to_batch_with_trainable_metrics(
    batch: DataProto, rollout_corr_config: Any
) -> tuple[DataProto, dict]:
    """verl's ``compute_rollout_correction_and_add_to_batch``, metrics over trainable rows only."""
    metrics = rollout_corr_metrics(batch, rollout_corr_config)
    corrected, _ = _verl_original()(batch, rollout_corr_config)
    return corrected, metrics


def patch_rollout_corr_metrics() -> None:
    """Make verl's trainers log ``rollout_corr/*`` over trainable rows (idempotent)."""
    global _verl_function
    helper = _helper()
    current = getattr(helper, _NAME)
    if current is not _add_to_batch_with_trainable_metrics:
        _verl_function = current
    setattr(helper, _NAME, _add_to_batch_with_trainable_metrics)
    v1 = sys.modules.get(_V1_TRAINER)  # imported later, it picks the patched name up itself
    if v1 is not None and hasattr(v1, _NAME):
        setattr(v1, _NAME, _add_to_batch_with_trainable_metrics)
