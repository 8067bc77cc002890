"""Queue rows -> what one ``kv_batch_put`` stores: uni-agent's row fields and per-row tags.

The section 6 columns (``num_turns`` included) come from ``sessions.batches.build_jagged``; this
module adds only what uni-agent's writer puts beside them (``loss_mask``, ``global_steps``,
logprob zeros) and the tags verl's replay buffer filters on. The two non-tensor columns a padded
batch carries for verl's V0 trainer (``__num_turns__``, ``multi_modal_inputs``) are left out:
uni-agent does not write them, verl V1 derives ``__num_turns__`` from ``num_turns`` itself, and
``read_rows`` puts both back. torch is imported on first use, so importing the adapter stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sessions.errors import InvalidArgument
from sessions.placeholder import GROUP_UID, isolated_uid
from sessions.queues.sinks import QueueItem

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["rows_to_tensordict"]


def rows_to_tensordict(
    items: Sequence[QueueItem],
    *,
    write_log_probs: bool = True,
    isolate_placeholders: bool | None = None,
) -> TensorDict:
    """Row items -> the unpadded TensorDict one ``kv_batch_put`` stores (first dim = sample).

    Built with ``sessions.batches.build_jagged`` (one flat pass, no per-token Python loop), then
    completed with uni-agent's extra columns. Every row also carries ``group_uid`` (its prompt's
    uid). ``isolate_placeholders`` (None: on for ``train`` rows, off for ``val``) gives each
    placeholder row the ``uid`` field ``{uid}-ph{session_index}``: verl V1's GRPO groups the rows
    it reads by that field, so a failed session's 0 stays out of its siblings' baseline, as
    ``sessions.integrations.verl.to_data_proto`` does for V0; keys and tags keep the prompt's uid,
    so the replay buffer's prompt bookkeeping is untouched.
    """
    import torch
    from tensordict import NonTensorStack

    from sessions.batches import COLUMN_DTYPES, VERL_NON_TENSOR_COLUMNS, build_jagged
    from sessions.batches.jagged import jagged_from_parts

    rows = [item.row for item in items]
    if any(row is None for row in rows):
        raise InvalidArgument(
            "rows_to_tensordict takes row items only (QueueItem.row set), not group tags"
        )
    td = build_jagged(rows).exclude(*VERL_NON_TENSOR_COLUMNS)  # type: ignore[arg-type]
    responses = td.get("responses")
    if write_log_probs and "rollout_log_probs" not in td.keys():
        zeros = torch.zeros(responses.values().shape[0], dtype=COLUMN_DTYPES["rollout_log_probs"])
        td.set("rollout_log_probs", jagged_from_parts(zeros, responses.offsets()))
    elif not write_log_probs and "rollout_log_probs" in td.keys():
        del td["rollout_log_probs"]
    mask = td.get("response_mask")
    td.set("loss_mask", jagged_from_parts(mask.values().clone(), mask.offsets()))
    td.set(
        "global_steps",
        NonTensorStack.from_list(
            [item.tags.get("global_steps", item.global_step) for item in items]
        ),
    )
    td.set(GROUP_UID, NonTensorStack.from_list([item.uid for item in items]))
    td.set(
        "uid", NonTensorStack.from_list([_field_uid(item, isolate_placeholders) for item in items])
    )
    return td


def _field_uid(item: QueueItem, isolate: bool | None) -> str:
    """The row's ``uid`` field: the prompt's, or the placeholder's own when isolated."""
    row = item.row
    on = item.partition == "train" if isolate is None else isolate
    if on and row is not None and row.is_placeholder:
        return isolated_uid(item.uid, row.meta.get("session_index"))
    return item.uid


def _row_tags(item: QueueItem) -> dict[str, Any]:
    """The row's tags, completed as verl's replay buffer reads them (steps range, uid)."""
    tags = dict(item.tags)
    steps = tags.setdefault("global_steps", item.global_step)
    tags.setdefault("min_global_steps", steps)
    tags.setdefault("max_global_steps", steps)
    tags.setdefault("uid", item.uid)
    return tags
