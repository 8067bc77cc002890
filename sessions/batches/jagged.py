"""The jagged layout: token columns as unpadded ``torch.jagged`` nested tensors [B, j].

What row stores such as TransferQueue hold. This module owns both directions (flat -> jagged
batch, jagged batch -> flat) and the few nested-tensor operations other code needs, so values /
offsets arithmetic is written once: ``jagged_from_parts``, ``jagged_parts``, ``is_jagged``,
``seqlen_bounds`` and ``row_ids_and_positions`` are public for the integrations that read
jagged rows back and for ``indexing``. Every nested tensor is built with its
``min_seqlen``/``max_seqlen``, so ``to_padded_tensor`` is as wide as the longest row.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from sessions.batches.collect import BatchRow, _rows_from_batch_rows, limits
from sessions.batches.columns import COLUMN_DTYPES, RESPONSE_COLUMNS
from sessions.batches.flat import (
    _default_turns,
    _Flat,
    _flat_from_rows,
    _non_tensor_columns,
    _read_view,
    _reject_unknown,
    _row_columns,
    _split_columns,
)
from sessions.batches.non_tensor_stacks import set_non_tensor_columns
from sessions.errors import InvalidArgument

__all__ = [
    "build_jagged",
    "is_jagged",
    "jagged_from_parts",
    "jagged_parts",
    "row_ids_and_positions",
    "seqlen_bounds",
]

#: the jagged columns a batch must have to be read back (the rest are derived or optional)
_REQUIRED = frozenset({"prompts", "responses", "response_mask", "rm_scores"})


def is_jagged(value: Any) -> bool:
    """Whether ``value`` is a ``torch.jagged`` nested tensor (the only nested layout we write)."""
    return isinstance(value, torch.Tensor) and value.is_nested and value.layout == torch.jagged


def jagged_parts(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, offsets starting at 0) of a jagged nested tensor, whatever view it is."""
    if value.lengths() is not None:  # a narrow()-style view with holes
        value = value.contiguous()
    offsets = value.offsets()
    values = value.values()[int(offsets[0]) : int(offsets[-1])]
    return values, offsets - offsets[0]


def seqlen_bounds(offsets: torch.Tensor) -> tuple[int, int]:
    """(shortest, longest) row of jagged ``offsets`` ((0, 0) for no rows)."""
    if offsets.numel() < 2:
        return 0, 0
    lengths = offsets.diff()
    return int(lengths.min()), int(lengths.max())


def jagged_from_parts(
    values: torch.Tensor,
    offsets: torch.Tensor,
    *,
    bounds: tuple[int, int] | None = None,
) -> torch.Tensor:
    """A jagged nested tensor over ``values``; columns given one offsets tensor share row lengths.

    Built with its ``min_seqlen``/``max_seqlen`` (``bounds``, computed from ``offsets`` unless
    given): without them torch takes the row width to be the total token count, so
    ``to_padded_tensor`` of one 1,024-token row in a 20k-token batch made 20k columns.
    """
    low, high = seqlen_bounds(offsets) if bounds is None else bounds
    return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=low, max_seqlen=high)


def row_ids_and_positions(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For flat tokens of rows with ``lengths``: each token's row id and position in its row.

    Done in numpy: ``torch.repeat_interleave`` enters a parallel region even for a handful of
    elements and costs milliseconds per call on a busy 2-core host.
    """
    n = lengths.numpy().astype(np.int64, copy=False)
    rows = np.repeat(np.arange(n.size), n)
    positions = np.arange(rows.size) - (np.cumsum(n) - n)[rows]
    return torch.from_numpy(rows), torch.from_numpy(positions)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])


def _jagged_from_flat(flat: _Flat) -> TensorDict:
    """Section 6 columns as torch.jagged nested tensors; response-side columns share offsets."""
    p_len, r_len = flat.prompt_lengths, flat.response_lengths
    seq_len = p_len + r_len
    p_off, r_off, s_off = _offsets(p_len), _offsets(r_len), _offsets(seq_len)
    input_ids = torch.empty(int(seq_len.sum()), dtype=COLUMN_DTYPES["input_ids"])
    rows, positions = row_ids_and_positions(p_len)
    input_ids[s_off[rows] + positions] = flat.prompt_ids
    rows, positions = row_ids_and_positions(r_len)
    input_ids[s_off[rows] + p_len[rows] + positions] = flat.response_ids
    _, seq_positions = row_ids_and_positions(seq_len)
    p_b, r_b, s_b = seqlen_bounds(p_off), seqlen_bounds(r_off), seqlen_bounds(s_off)
    columns: dict[str, torch.Tensor] = {
        "prompts": jagged_from_parts(flat.prompt_ids, p_off, bounds=p_b),
        "responses": jagged_from_parts(flat.response_ids, r_off, bounds=r_b),
        "input_ids": jagged_from_parts(input_ids, s_off, bounds=s_b),
        "attention_mask": jagged_from_parts(torch.ones_like(input_ids), s_off, bounds=s_b),
        "position_ids": jagged_from_parts(seq_positions, s_off, bounds=s_b),
        "response_mask": jagged_from_parts(flat.response_mask, r_off, bounds=r_b),
        "rm_scores": jagged_from_parts(flat.rm_scores, r_off, bounds=r_b),
    }
    if flat.rollout_log_probs is not None:
        columns["rollout_log_probs"] = jagged_from_parts(flat.rollout_log_probs, r_off, bounds=r_b)
    turns = _read_view(flat.num_turns)
    columns.update(
        _row_columns(
            _read_view(flat.prompt_lengths),
            _read_view(flat.response_lengths),
            _read_view(flat.is_placeholder),
            turns,
            flat.non_tensor.get("key"),
        )
    )
    batch = TensorDict(columns, batch_size=[flat.batch_size])
    set_non_tensor_columns(batch, _non_tensor_columns(flat.non_tensor, turns))
    return batch


def _flat_from_jagged(batch: TensorDictBase) -> _Flat:
    """A jagged batch -> flat; response-side columns must agree with ``responses`` row by row."""
    tensors, non_tensors = _split_columns(batch)
    _reject_unknown(tensors)
    parts = {k: jagged_parts(v) for k, v in tensors.items() if is_jagged(v)}
    missing = _REQUIRED - set(parts)
    if missing:
        raise InvalidArgument(f"not a jagged batch: missing jagged columns {sorted(missing)}")
    prompt_ids, p_off = parts["prompts"]
    response_ids, r_off = parts["responses"]
    p_len, r_len = p_off.diff(), r_off.diff()
    for name in RESPONSE_COLUMNS:
        if name in parts and not torch.equal(parts[name][1], r_off):
            raise InvalidArgument(f"column {name!r}: row lengths differ from 'responses'")
    lp = parts.get("rollout_log_probs")
    is_placeholder = tensors["is_placeholder"].to(COLUMN_DTYPES["is_placeholder"])
    turns = tensors.get("num_turns")
    return _Flat(
        prompt_ids=prompt_ids.to(COLUMN_DTYPES["prompts"]),
        prompt_lengths=p_len,
        response_ids=response_ids.to(COLUMN_DTYPES["responses"]),
        response_lengths=r_len,
        response_mask=parts["response_mask"][0].to(COLUMN_DTYPES["response_mask"]),
        rm_scores=parts["rm_scores"][0].to(COLUMN_DTYPES["rm_scores"]),
        rollout_log_probs=lp[0].to(COLUMN_DTYPES["rollout_log_probs"]) if lp is not None else None,
        is_placeholder=is_placeholder,
        num_turns=_default_turns(is_placeholder)
        if turns is None
        else turns.to(COLUMN_DTYPES["num_turns"]),
        non_tensor=non_tensors,
    )


def build_jagged(
    rows: Sequence[BatchRow],
    *,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    truncate: bool = False,
) -> TensorDict:
    """Rows -> unpadded batch: token columns are ``torch.jagged`` nested tensors [B, j].

    Limits and truncation as in ``build_padded``; there are no widths (nothing is padded).
    """
    limit = limits(max_prompt_length, max_response_length)
    return _jagged_from_flat(_flat_from_rows(_rows_from_batch_rows(rows, limit, truncate)))
