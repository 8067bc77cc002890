"""What verl's trainer does at two places of a step, so training matches the ledger (docs/design.md §13).

``LedgerTrainerHook`` is the trainer side without verl's trainer class: ``LedgerRayPPOTrainer``
(``trainer``) calls it, and a trainer of your own can too.

* ``actor_update(batch, dp_size)``, around the actor update: GRPO as the ledger's reference
  computes it -- each placeholder in a group of its own and the groups below ``min_valid`` valid
  rows zeroed (``grpo.ledger_grpo_advantage``; stock verl GRPO counts a failure's 0 in its
  siblings' baseline and gives a lone survivor its raw score), so training matches
  ``groups/below_min_valid`` -- and the unbiased seq-mean scale inside (``seq_mean``: verl's
  seq-mean loss modes divide by every row of a mini-batch, placeholders included).
* ``step_metrics(partition, step)``: the ledger's own figures of the step (``ledger/...`` of
  ``metrics_dict``: failures by reason, coverage, the success-only reward beside the honest one)
  for verl's tracker. verl's own names stay verl's: the ledger's are equal on the same rows
  (``tests/integrations/verl/test_agent_loop.py``).

The run, database and ``min_valid`` come from the ``ledger`` config section the rollout side
reads too (``agent_loop.settings``), so both sides open the run with the same configuration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from sessions.integrations.verl.agent_loop.settings import LedgerSettings
from sessions.integrations.verl.grpo import ledger_grpo_advantage
from sessions.integrations.verl.seq_mean import unbiased_seq_mean

__all__ = ["LEDGER_PREFIX", "LedgerTrainerHook"]

#: the ledger's own figures in a tracker's dict (``metrics_dict``'s prefix)
LEDGER_PREFIX = "ledger/"
_GRPO = "grpo"


class LedgerTrainerHook:
    """What a verl trainer calls at two places of its step: before the actor update, and when it
    logs. ``config``: verl's trainer config; ``pad_token_id``: the tokenizer's."""

    def __init__(self, config: Any, *, pad_token_id: int | None = None, ledger: Any = None) -> None:
        self.config = config
        self.settings = LedgerSettings.from_config(config, pad_token_id=pad_token_id)
        self._ledger = ledger

    @property
    def ledger(self) -> Any:
        """The job's ledger, opened once (a ``SyncLedger``: verl's V0 loop is synchronous)."""
        if self._ledger is None:
            from sessions.ledger.sync import SyncLedger

            self._ledger = SyncLedger.open(self.settings.url, **self.settings.ledger_options())
        return self._ledger

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    def fix_advantages(self, batch: Any) -> bool:
        """GRPO recomputed with placeholders isolated and ``min_valid`` zeroing (GRPO only);
        returns whether it did. Sets ``advantages`` / ``returns`` in place."""
        algorithm = self.config.algorithm
        if str(getattr(algorithm.adv_estimator, "value", algorithm.adv_estimator)) != _GRPO:
            return False
        ledger_grpo_advantage(
            batch,
            min_valid=self.settings.min_valid,
            norm_adv_by_std_in_grpo=bool(algorithm.get("norm_adv_by_std_in_grpo", True)),
        )
        return True

    @contextlib.contextmanager
    def actor_update(self, batch: Any, dp_size: int) -> Iterator[Any]:
        """Around verl's actor update: advantages fixed first, seq-mean weights inside the block
        (the fixed, unweighted advantages are what verl logs afterwards)."""
        self.fix_advantages(batch)
        actor = self.config.actor_rollout_ref.actor
        mini_batch = int(actor.ppo_mini_batch_size) * int(self.config.actor_rollout_ref.rollout.n)
        with unbiased_seq_mean(
            batch, loss_agg_mode=actor.loss_agg_mode, mini_batch_size=mini_batch, dp_size=dp_size
        ) as weights:
            yield weights

    def step_metrics(self, partition: str, global_step: int) -> dict[str, float]:
        """The ledger's own figures of a settled step (``ledger/...``), for verl's tracker."""
        figures = self.ledger.metrics_dict(
            partition,
            global_step,
            timeout=120,
            max_prompt_length=int(self.config.actor_rollout_ref.rollout.prompt_length),
            max_response_length=int(self.config.actor_rollout_ref.rollout.response_length),
        )
        return {k: v for k, v in figures.items() if k.startswith(LEDGER_PREFIX)}
