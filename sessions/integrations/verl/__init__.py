"""verl adapter (optional extra ``verl``): ledger batches as verl 0.9.1's trainer consumes them.

The padded batch ``Ledger.batch(...)`` returns is already in verl's column convention, so
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

verl's validation and batch figures computed from a step's rows (``Ledger.metrics_dict``) are not
here: they are numpy-only arithmetic the ledger itself uses, so they live in
``sessions.projection.verl_metrics`` and the ledger imports no adapter.

verl is imported only inside the functions that call it: importing this package needs torch and
tensordict only, and a function that needs verl raises ``ImportError`` naming the extra.
"""

from __future__ import annotations

from sessions.integrations.verl.data_proto import GROUP_UID, to_data_proto
from sessions.integrations.verl.filler import IS_PADDING, trainable_rows, without_padding
from sessions.integrations.verl.rollout_corr import patch_rollout_corr_metrics, rollout_corr_metrics
from sessions.integrations.verl.seq_mean import SEQ_MEAN_MODES, seq_mean_weights, unbiased_seq_mean

__all__ = [
    "GROUP_UID",
    "IS_PADDING",
    "SEQ_MEAN_MODES",
    "patch_rollout_corr_metrics",
    "rollout_corr_metrics",
    "seq_mean_weights",
    "to_data_proto",
    "trainable_rows",
    "unbiased_seq_mean",
    "without_padding",
]
