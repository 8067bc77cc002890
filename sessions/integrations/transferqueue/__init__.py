"""TransferQueue adapter (optional extra ``transferqueue``): the queue verl and uni-agent use.

``TransferQueueSink`` (``sink``) is a ``QueueSink`` the projector writes every projected row and
group tag to, through TransferQueue's key-value API (``async_kv_batch_put``), in uni-agent's
conventions (``fields``):

* row key ``{uid}_{session_index}_{i}`` (``QueueItem.key``), partition ids ``train`` / ``val``;
* one unpadded row per sample: 1-D int64 ``prompts``, ``responses``, ``input_ids``,
  ``attention_mask``, ``position_ids``, ``response_mask`` (and ``loss_mask``, the same values),
  float32 ``rm_scores`` (the reward on the last response token), float32 ``rollout_log_probs``
  (zeros where a row has none, as uni-agent writes them), a per-row int64 ``num_turns``, bool
  ``is_placeholder``, float32 ``prompt_length`` / ``response_length``, and strings (any plain
  scalar) in ``NonTensorStack``: ``uid``, ``data_source``, ``session_id``, ``session_index``,
  ``key``, ``run``, ``partition``, ``global_step``, ``global_steps``, ``failure_reason``,
  ``materialization_reason``;
* per-row tags (``QueueItem.tags``: ``status``, ``global_steps``, ``prompt_len``,
  ``response_len``, ``seq_len``, ``uid``, ``materialization_reason``, ``is_placeholder``; plus
  ``min_global_steps`` / ``max_global_steps`` = ``global_steps`` unless given);
* the group tag on key ``{uid}`` (``{"is_prompt": True, "status": "finished"|"failure",
  "global_steps": s}``), written only after the group's rows. TransferQueue merges tags with
  ``dict.update``, so keys registered earlier (by verl's replay buffer, say) survive.

``read_rows`` / ``aread_rows`` (``readback``) read rows back with ``kv_batch_get`` and return
them padded in verl's layout (docs/design.md §6); ``start_transferqueue`` (``runtime``) starts a
local TransferQueue sized for small machines (tests, a laptop, a 2-core CI box).

``transfer_queue`` (and torch) are imported lazily: importing this package without the extra
works, using it raises ``ImportError`` naming the extra.
"""

from __future__ import annotations

from sessions.integrations.transferqueue.fields import rows_to_tensordict
from sessions.integrations.transferqueue.readback import (
    aread_rows,
    list_partition,
    read_rows,
    row_keys,
    to_padded,
)
from sessions.integrations.transferqueue.runtime import (
    RAY_LOOPBACK_ENV,
    TQ_VERSION,
    TransferQueueHandle,
    TransferQueueStartError,
    import_transfer_queue,
    set_tq_num_threads,
    start_transferqueue,
)
from sessions.integrations.transferqueue.sink import (
    TransferQueueSink,
    TransferQueueSinkError,
    TransferQueueTimeout,
)

__all__ = [
    "RAY_LOOPBACK_ENV",
    "TQ_VERSION",
    "TransferQueueHandle",
    "TransferQueueSink",
    "TransferQueueSinkError",
    "TransferQueueStartError",
    "TransferQueueTimeout",
    "aread_rows",
    "import_transfer_queue",
    "list_partition",
    "read_rows",
    "row_keys",
    "rows_to_tensordict",
    "set_tq_num_threads",
    "start_transferqueue",
    "to_padded",
]
