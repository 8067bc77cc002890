"""Batch -> batch: densify a jagged batch, concatenate batches of any widths and layouts.

Both go through the flat form (``sessions.batches.flat``) and end in the padded writer, so their
output equals ``build_padded`` on the same rows, byte for byte.
"""

from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from sessions.batches.columns import COLUMN_DTYPES
from sessions.batches.flat import _Flat, _rows_from_flat
from sessions.batches.jagged import _flat_from_jagged, is_jagged
from sessions.batches.padded import _flat_from_padded, _padded_from_rows, build_padded

__all__ = ["concat_padded", "densify"]


def _flat_from_batch(batch: TensorDictBase) -> _Flat:
    """Either layout -> flat, dispatching on whether ``prompts`` is jagged."""
    if is_jagged(batch.get("prompts")):
        return _flat_from_jagged(batch)
    return _flat_from_padded(batch)


def _concat_flats(flats: Sequence[_Flat]) -> _Flat:
    """Row-wise concatenation; missing logprobs -> zeros, missing non-tensor columns -> None."""
    any_lp = any(f.rollout_log_probs is not None for f in flats)
    names = list(dict.fromkeys(name for f in flats for name in f.non_tensor))
    lp_dtype = COLUMN_DTYPES["rollout_log_probs"]
    return _Flat(
        prompt_ids=torch.cat([f.prompt_ids for f in flats]),
        prompt_lengths=torch.cat([f.prompt_lengths for f in flats]),
        response_ids=torch.cat([f.response_ids for f in flats]),
        response_lengths=torch.cat([f.response_lengths for f in flats]),
        response_mask=torch.cat([f.response_mask for f in flats]),
        rm_scores=torch.cat([f.rm_scores for f in flats]),
        rollout_log_probs=torch.cat(
            [
                f.rollout_log_probs
                if f.rollout_log_probs is not None
                else torch.zeros(f.response_ids.numel(), dtype=lp_dtype)
                for f in flats
            ]
        )
        if any_lp
        else None,
        is_placeholder=torch.cat([f.is_placeholder for f in flats]),
        non_tensor={
            name: [v for f in flats for v in f.non_tensor.get(name, [None] * f.batch_size)]
            for name in names
        },
    )


def densify(jagged_td: TensorDictBase, pad_token_id: int = 0) -> TensorDict:
    """Jagged batch -> padded batch, equal to ``build_padded`` on the same rows.

    Re-derives ``input_ids``/``attention_mask``/``position_ids`` from the prompt/response
    columns; unknown tensor columns raise rather than being silently dropped.
    """
    return _padded_from_rows(_rows_from_flat(_flat_from_jagged(jagged_td)), pad_token_id)


def concat_padded(batches: Sequence[TensorDictBase], *, pad_token_id: int = 0) -> TensorDict:
    """Concatenate batches of different widths (``torch.cat`` needs equal P and R).

    Accepts padded or jagged batches (mixed) and re-pads to the widest prompt/response; a
    batch lacking ``rollout_log_probs`` contributes zeros when another has it; missing
    non-tensor columns become None.
    """
    if not batches:
        return build_padded([], pad_token_id=pad_token_id)
    flat = _concat_flats([_flat_from_batch(b) for b in batches])
    return _padded_from_rows(_rows_from_flat(flat), pad_token_id)
