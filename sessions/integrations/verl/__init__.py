"""verl adapter (optional extra ``verl``): the ledger inside verl 0.9.1's training loop.

Both sides of a verl command (``docs/verl.md`` counts the setup, docs/design.md §13):

* the rollout side, ``agent_loop`` (``actor_rollout_ref.rollout.agent.agent_loop_config_path=``
  its ``AGENT_LOOP_CONFIG``): every agent-loop run a ledger session, a failed run a placeholder
  row in verl's batch instead of a failed step;
* the trainer side, ``main_ppo`` (``python -m sessions.integrations.verl.main_ppo``): verl's V0
  trainer as ``LedgerRayPPOTrainer`` (``trainer``), calling ``LedgerTrainerHook``
  (``trainer_hook``): GRPO with placeholders isolated and ``min_valid`` (``grpo``), the unbiased
  seq-mean scale, the ledger's figures in verl's log.

Ledger batches beside the loop: the padded batch ``Ledger.batch(...)`` returns is already in verl's column convention, so
``DataProto.from_tensordict(batch)`` is all a verl step needs to run. What verl cannot tell from
the batch, this package adds, each tested against verl's own code (``docs/verl.md``):

* ``to_data_proto(batch, isolate_placeholders=..., pad_to_multiple=..., prompt_width=...,
  response_width=...)`` (``data_proto``): each placeholder its own uid, so stock GRPO keeps it
  out of its siblings' baseline (default on for ``train``, off for ``val``; the prompt's uid
  stays in ``group_uid``); masked filler rows up to a fixed multiple, tagged ``is_padding``
  (``filler``); verl's fixed widths, so any two steps ``DataProto.concat``.
* ``without_padding(dp)`` (before ``compute_data_metrics``) and ``trainable_rows(dp)``.
* ``unbiased_seq_mean(dp, ...)`` / ``seq_mean_weights`` (``seq_mean``): the seq-mean loss modes
  in verl's worker divide by every row of a mini-batch; weighted advantages undo that.
* ``rollout_corr_metrics`` / ``patch_rollout_corr_metrics`` (``rollout_corr``): verl's
  off-policy diagnostics over trainable rows only.
* ``zero_below_min_valid(dp, min_valid)`` after stock GRPO, or ``ledger_grpo_advantage(dp,
  ...)`` for it (``grpo``): verl's advantages equal to the reference's.

verl's validation and batch figures computed from a step's rows (``Ledger.metrics_dict``) are not
here: they are numpy-only arithmetic the ledger itself uses, so they live in
``sessions.projection.verl_metrics`` and the ledger imports no adapter.

verl is imported only inside the functions that call it: importing this package needs torch and
tensordict only, and a function that needs verl raises ``ImportError`` naming the extra.
"""

from __future__ import annotations

from sessions.integrations.verl.data_proto import GROUP_UID, to_data_proto
from sessions.integrations.verl.filler import IS_PADDING, trainable_rows, without_padding
from sessions.integrations.verl.grpo import ledger_grpo_advantage, zero_below_min_valid
from sessions.integrations.verl.rollout_corr import patch_rollout_corr_metrics, rollout_corr_metrics
from sessions.integrations.verl.seq_mean import SEQ_MEAN_MODES, seq_mean_weights, unbiased_seq_mean

__all__ = [
    "GROUP_UID",
    "IS_PADDING",
    "SEQ_MEAN_MODES",
    "ledger_grpo_advantage",
    "patch_rollout_corr_metrics",
    "rollout_corr_metrics",
    "seq_mean_weights",
    "to_data_proto",
    "trainable_rows",
    "unbiased_seq_mean",
    "without_padding",
    "zero_below_min_valid",
]
