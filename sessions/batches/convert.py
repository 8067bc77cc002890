"""Batch -> batch: densify a jagged batch, concatenate batches of any widths and layouts, re-pad.

Both go through the flat form (``sessions.batches.flat``) and end in the padded writer, so their
output equals ``build_padded`` on the same rows, byte for byte.
"""

from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from sessions.batches.collect import (
    apply_limits,
    check_batch,
    check_token_id,
    limits,
    row_keys,
)
from sessions.batches.columns import COLUMN_DTYPES
from sessions.batches.flat import _Flat, _rows_from_flat
from sessions.batches.jagged import _flat_from_jagged, is_jagged
from sessions.batches.padded import _flat_from_padded, _padded_from_rows, build_padded
from sessions.errors import InvalidArgumentType

__all__ = ["concat_padded", "densify", "pad_to_widths"]


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
        num_turns=torch.cat([f.num_turns for f in flats]),
        non_tensor={
            name: [v for f in flats for v in f.non_tensor.get(name, [None] * f.batch_size)]
            for name in names
        },
    )


def _padded_from_flat(
    flat: _Flat,
    pad_token_id: int,
    prompt_width: int | None,
    response_width: int | None,
    truncate: bool,
) -> TensorDict:
    """Flat -> padded, widths checked (or rows truncated) against the given widths first."""
    limit = limits(prompt_width=prompt_width, response_width=response_width)
    rows = _rows_from_flat(flat)
    apply_limits(rows, row_keys(rows), limit, truncate)
    return _padded_from_rows(rows, pad_token_id, limit.prompt_width, limit.response_width)


def densify(
    jagged_td: TensorDictBase,
    pad_token_id: int = 0,
    *,
    prompt_width: int | None = None,
    response_width: int | None = None,
    truncate: bool = False,
) -> TensorDict:
    """Jagged batch -> padded batch, equal to ``build_padded`` on the same rows.

    Re-derives ``input_ids``/``attention_mask``/``position_ids`` from the prompt/response
    columns; unknown tensor columns raise rather than being silently dropped. Widths and
    ``truncate`` as in ``pad_to_widths``.
    """
    pad_token_id = check_token_id(pad_token_id)
    flat = _flat_from_jagged(check_batch(jagged_td, "densify"))
    return _padded_from_flat(flat, pad_token_id, prompt_width, response_width, truncate)


def concat_padded(
    batches: Sequence[TensorDictBase],
    *,
    pad_token_id: int = 0,
    prompt_width: int | None = None,
    response_width: int | None = None,
    truncate: bool = False,
) -> TensorDict:
    """Concatenate batches of different widths (``torch.cat`` needs equal P and R).

    Accepts padded or jagged batches (mixed) and re-pads to the widest prompt/response, or to
    the given widths (as in ``pad_to_widths``); a batch lacking ``rollout_log_probs``
    contributes zeros when another has it; missing non-tensor columns become None
    (``multi_modal_inputs``: ``{}``).
    """
    pad_token_id = check_token_id(pad_token_id)
    if isinstance(batches, TensorDictBase) or not isinstance(batches, Sequence):
        raise InvalidArgumentType(
            f"concat_padded takes a list of batches, got {type(batches).__name__}",
            argument="batches",
        )
    if not batches:
        return build_padded(
            [], pad_token_id=pad_token_id, prompt_width=prompt_width, response_width=response_width
        )
    flat = _concat_flats([_flat_from_batch(check_batch(b, "concat_padded")) for b in batches])
    return _padded_from_flat(flat, pad_token_id, prompt_width, response_width, truncate)


def pad_to_widths(
    batch: TensorDictBase,
    prompt_width: int | None,
    response_width: int | None,
    *,
    pad_token_id: int = 0,
    truncate: bool = False,
) -> TensorDict:
    """A padded (or jagged) batch re-padded to exactly ``prompt_width`` x ``response_width``.

    What makes batches of different steps ``torch.cat``-able, as verl's fixed
    ``max_prompt_length``/``max_response_length`` do. None keeps that side as wide as its
    longest row. A row longer than a width raises ``BatchTooLongError`` naming the row and the
    option, unless ``truncate``: then prompts keep their last tokens, responses their first, and
    the cut tokens' ``rm_scores`` are added onto the new last token (each row's score,
    ``rm_scores.sum(-1)``, is unchanged). ``pad_token_id`` fills the padding: the batch does not
    record the one it was built with. Token content, per-row and non-tensor columns are
    otherwise those of the input (``num_turns``/``__num_turns__``, ``multi_modal_inputs``
    included); unknown tensor columns are refused, as in ``densify``.
    """
    pad_token_id = check_token_id(pad_token_id)
    flat = _flat_from_batch(check_batch(batch, "pad_to_widths"))
    return _padded_from_flat(flat, pad_token_id, prompt_width, response_width, truncate)
