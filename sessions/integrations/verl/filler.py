"""Masked filler rows that bring a batch to a fixed multiple, and the views that leave them out.

verl needs batch sizes that divide evenly: ``DataProto.chunk`` across data-parallel ranks,
``_balance_batch`` (equal-size partitions) and the worker's mini-batch iterator all assert it.
A ledger step has as many rows as sessions survived its drop policy and cancellations (60 or 62
instead of 64), so it is padded with rows that train nothing, the idea of verl's V1
``padding_utils``: 1 prompt + 1 response token, ``response_mask`` 0, reward 0, a fresh uid per row
(a GRPO group of one, advantage 0), ``is_padding`` True. verl's own V1 padding uses 127 + 1 tokens
and one shared uid for all its rows; a 1 + 1 row is the ledger's placeholder shape (docs/design.md §5)
and the cheapest row that still has an attended response token.

Every column gets a value of its own dtype: the ones this module knows by name as above,
``num_turns`` / ``__num_turns__`` 0, ``multi_modal_inputs`` ``{}``, any other tensor column zeros,
any other non-tensor column None (``run``, ``partition``, ``global_step``, ``data_source`` are
copied from the first row, as verl copies its template row).

verl's ``compute_data_metrics`` does count filler rows (as zero-score sequences of length 1), as
it would its own; its V1 trainer removes its padding first. ``without_padding(dp)`` is that step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch

from sessions.errors import InvalidArgument
from sessions.placeholder import GROUP_UID

if TYPE_CHECKING:
    from verl.protocol import DataProto

__all__ = ["IS_PADDING", "append_filler_rows", "trainable_rows", "without_padding"]

#: bool tensor column, True on filler rows (the name verl's V1 trainer tags its padding with)
IS_PADDING = "is_padding"
#: what a filler row's reason column says
_FILLER_REASON = "batch_padding"
_TOKEN_COLUMNS = ("prompts", "responses", "input_ids")
_ZERO_COLUMNS = ("response_mask", "rm_scores", "rollout_log_probs", "is_placeholder", "num_turns")
_COPIED = ("run", "partition", "global_step", "data_source")


def _filler_uid(step: Any, index: int) -> str:
    """A filler row's uid: ``pad-{step}-{index}`` (no ``_``: verl splits keys on it)."""
    return f"pad-{step}-{index}"


def _filler_tensor(
    name: str, like: torch.Tensor, count: int, prompt_width: int, pad_token_id: int
) -> torch.Tensor:
    """``count`` filler values for one tensor column: a 1 + 1-token row in the padded layout."""
    out = torch.zeros((count, *like.shape[1:]), dtype=like.dtype, device=like.device)
    if name in _TOKEN_COLUMNS:
        out.fill_(pad_token_id)
    elif name == "attention_mask":
        out[:, prompt_width - 1 : prompt_width + 1] = 1
    elif name == "position_ids":  # cumsum(attention_mask) - 1, clamped at 0
        out[:, prompt_width:] = 1
    elif name in ("prompt_length", "response_length"):
        out.fill_(1)
    elif name == IS_PADDING:
        out.fill_(True)
    # _ZERO_COLUMNS and any column this module does not know: zeros
    return out


def _filler_values(name: str, first: Any, uids: list[str]) -> list[Any]:
    """Filler values for one non-tensor column."""
    count = len(uids)
    if name in ("uid", GROUP_UID, "session_id"):
        return list(uids)
    if name == "key":
        return [f"{uid}_0_0" for uid in uids]
    if name in ("session_index", "__num_turns__"):
        return [0] * count
    if name == "materialization_reason":
        return [_FILLER_REASON] * count
    if name == "multi_modal_inputs":
        return [{} for _ in range(count)]
    if name in _COPIED:
        return [first] * count
    return [None] * count


def append_filler_rows(
    tensors: Mapping[str, torch.Tensor],
    non_tensors: Mapping[str, np.ndarray],
    *,
    multiple: int,
    pad_token_id: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], int]:
    """The columns with filler rows appended until the row count is a multiple of ``multiple``.

    Returns (tensors, non_tensors, new row count). An empty batch stays empty (0 is a multiple).
    """
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise InvalidArgument(f"pad_to_multiple must be an integer >= 1, got {multiple!r}")
    if not 0 <= pad_token_id < 2**31:
        raise InvalidArgument(f"pad_token_id must be in [0, 2**31), got {pad_token_id}")
    size = int(tensors["is_placeholder"].shape[0])
    count = -size % multiple
    if count == 0:
        return dict(tensors), dict(non_tensors), size
    prompt_width = int(tensors["prompts"].shape[1])
    step = non_tensors["global_step"][0] if "global_step" in non_tensors else None
    uids = [_filler_uid(step, i) for i in range(count)]
    taken = set(non_tensors["uid"].tolist()) if "uid" in non_tensors else set()
    clash = taken.intersection(uids)
    if clash:
        raise InvalidArgument(
            f"filler uid(s) {sorted(clash)[:3]} already in the batch (a uid spelt pad-<step>-<i>, or a batch "
            "padded twice); pad each step's batch once, before concatenating"
        )
    out_tensors = {
        name: torch.cat([value, _filler_tensor(name, value, count, prompt_width, pad_token_id)])
        for name, value in tensors.items()
    }
    out_non_tensors = {}
    for name, values in non_tensors.items():
        filler = np.empty(count, dtype=object)
        for i, value in enumerate(_filler_values(name, values[0], uids)):
            filler[i] = value
        out_non_tensors[name] = np.concatenate([values, filler])
    return out_tensors, out_non_tensors, size + count


def _select(dp: DataProto, keep: np.ndarray) -> DataProto:
    if bool(keep.all()):
        return dp
    return dp.select_idxs(keep)


def without_padding(dp: DataProto) -> DataProto:
    """The rows that are not filler: what to hand verl's ``compute_data_metrics`` (and any metric).

    verl's V1 trainer does the same with its own padding before its metrics. Placeholders stay:
    they count as zeros in the reward figures (docs/design.md §5). ``dp`` itself when it has no
    filler rows.
    """
    if IS_PADDING not in dp.batch.keys():
        return dp
    return _select(dp, ~dp.batch[IS_PADDING].cpu().numpy().astype(bool))


def trainable_rows(dp: DataProto) -> DataProto:
    """The rows with at least one loss token (no placeholders, no filler): what per-sequence
    diagnostics such as verl's ``rollout_corr/*`` should average over (``dp`` itself if all are)."""
    keep = (dp.batch["response_mask"].sum(-1) > 0).cpu().numpy()
    return _select(dp, keep)
