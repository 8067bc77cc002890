"""``LedgerRayPPOTrainer``: verl's V0 trainer with the ledger's options on (docs/design.md §13).

``python -m sessions.integrations.verl.main_ppo +ledger.url=... ...`` runs verl's own
``main_ppo`` with this class in place of ``RayPPOTrainer`` (the one line of the trainer side);
it calls ``trainer_hook.LedgerTrainerHook`` at verl's actor update and validation. With the
rollout side on (the ledger agent loop) every sample of a step yields a row, so the batch has
verl's own fixed size (``train_batch_size x n``) and widths (``prompt_length`` /
``response_length``), and no filler row ever reaches verl's metrics. Imports verl's trainer.
"""

from __future__ import annotations

from typing import Any

from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from sessions.integrations.verl.trainer_hook import LedgerTrainerHook

__all__ = ["LedgerRayPPOTrainer"]


class LedgerRayPPOTrainer(RayPPOTrainer):
    """verl's V0 trainer, with placeholder-aware GRPO, ``min_valid``, the unbiased seq-mean scale
    and the ledger's figures in every step's log (train and validation)."""

    @property
    def ledger_hook(self) -> LedgerTrainerHook:
        hook = self.__dict__.get("_ledger_hook")
        if hook is None:
            hook = self.__dict__["_ledger_hook"] = LedgerTrainerHook(
                self.config, pad_token_id=getattr(self.tokenizer, "pad_token_id", None)
            )
        return hook

    def _update_actor(self, batch: Any) -> Any:
        dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
        with self.ledger_hook.actor_update(batch, dp_size):
            output = super()._update_actor(batch)
        output.meta_info["metrics"].update(
            self.ledger_hook.step_metrics("train", self.global_steps)
        )
        return output

    def _validate(self, merged: bool = False) -> Any:
        metrics = super()._validate(merged=merged)
        if not merged:
            for key, value in self.ledger_hook.step_metrics("val", self.global_steps).items():
                metrics.setdefault(key, value)
        return metrics
