"""Queue rows -> what one ``kv_batch_put`` stores: uni-agent's row fields and per-row tags.

The section 6 columns come from ``sessions.batches.build_jagged``; this module adds only what
uni-agent's writer puts beside them (``loss_mask``, ``num_turns``, ``global_steps``, logprob
zeros) and the tags verl's replay buffer filters on. torch is imported on first use, so
importing the adapter stays cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sessions.queues.sinks import QueueItem

if TYPE_CHECKING:
    from tensordict import TensorDict

log = logging.getLogger(__name__)

__all__ = ["rows_to_tensordict"]


def rows_to_tensordict(items: Sequence[QueueItem], *, write_log_probs: bool = True) -> TensorDict:
    """Row items -> the unpadded TensorDict one ``kv_batch_put`` stores (first dim = sample).

    Built with ``sessions.batches.build_jagged`` (one flat pass, no per-token Python loop), then
    completed with uni-agent's extra columns.
    """
    import torch
    from tensordict import NonTensorStack

    from sessions.batches import COLUMN_DTYPES, build_jagged
    from sessions.batches.jagged import jagged_from_parts

    rows = [item.row for item in items]
    if any(row is None for row in rows):
        raise ValueError("rows_to_tensordict takes row items only (QueueItem.row set), not group tags")
    td = build_jagged(rows)  # type: ignore[arg-type]
    responses = td.get("responses")
    if write_log_probs and "rollout_log_probs" not in td.keys():
        zeros = torch.zeros(responses.values().shape[0], dtype=COLUMN_DTYPES["rollout_log_probs"])
        td.set("rollout_log_probs", jagged_from_parts(zeros, responses.offsets()))
    elif not write_log_probs and "rollout_log_probs" in td.keys():
        del td["rollout_log_probs"]
    mask = td.get("response_mask")
    td.set("loss_mask", jagged_from_parts(mask.values().clone(), mask.offsets()))
    td.set("num_turns", torch.tensor([_num_turns(row) for row in rows], dtype=torch.int64))  # type: ignore[arg-type]
    td.set("global_steps", NonTensorStack.from_list([item.tags.get("global_steps", item.global_step) for item in items]))
    return td


_warned_num_turns = False


def _num_turns(row: Any) -> int:
    """``num_turns`` from the row's meta; 0 for a placeholder (DESIGN section 5); -1 if unknown."""
    global _warned_num_turns
    value = row.meta.get("num_turns") if row.meta is not None else None
    if value is not None:
        return int(value)
    if row.is_placeholder:
        return 0
    if not _warned_num_turns:
        _warned_num_turns = True
        log.warning("queue rows carry no num_turns; TransferQueue rows get num_turns=-1 (unknown)")
    return -1


def _row_tags(item: QueueItem) -> dict[str, Any]:
    """The row's tags, completed as verl's replay buffer reads them (steps range, uid)."""
    tags = dict(item.tags)
    steps = tags.setdefault("global_steps", item.global_step)
    tags.setdefault("min_global_steps", steps)
    tags.setdefault("max_global_steps", steps)
    tags.setdefault("uid", item.uid)
    return tags
