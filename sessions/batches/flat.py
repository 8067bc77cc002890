"""The flat form: every row's tokens concatenated, plus per-row lengths, and its conversions.

Flat is the hub between layouts: the jagged builder writes from it, and any batch (padded or
jagged) reduces to it, so densify and concat_padded need one writer each way instead of one per
pair of layouts. Going back to per-row arrays (``_rows_from_flat``) yields numpy views, never
copies, for the padded writer to copy straight into place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase

from sessions.batches.collect import _Rows, check_exact_lengths
from sessions.batches.columns import (
    COLUMN_DTYPES,
    LAYOUT_COLUMNS,
    NUMPY_DTYPES,
    UNKNOWN_TURNS,
)
from sessions.batches.non_tensor_stacks import non_tensor
from sessions.errors import InvalidArgument, InvalidArgumentType


@dataclass(slots=True)
class _Flat:
    """All rows' tokens concatenated (row order) plus per-row lengths: the jagged layout's form."""

    prompt_ids: torch.Tensor  # [Np] int64
    prompt_lengths: torch.Tensor  # [B] int64
    response_ids: torch.Tensor  # [Nr] int64
    response_lengths: torch.Tensor  # [B] int64
    response_mask: torch.Tensor  # [Nr] int64
    rm_scores: torch.Tensor  # [Nr] float32
    rollout_log_probs: torch.Tensor | None  # [Nr] float32
    is_placeholder: torch.Tensor  # [B] bool
    num_turns: torch.Tensor  # [B] int64
    non_tensor: dict[str, list[Any]]

    @property
    def batch_size(self) -> int:
        return int(self.prompt_lengths.numel())


def _concat(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def _reward_at_last_token(rewards: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """Flat rm_scores: zeros, with each row's reward on its last response token (if any)."""
    scores = torch.zeros(int(response_lengths.sum()), dtype=COLUMN_DTYPES["rm_scores"])
    has_response = response_lengths > 0
    last = torch.cumsum(response_lengths, 0) - 1
    scores[last[has_response]] = rewards[has_response]
    return scores


def _flat_from_rows(rows: _Rows) -> _Flat:
    """Concatenate every token column once (rows without logprobs contribute zeros)."""
    lp_dtype = NUMPY_DTYPES["rollout_log_probs"]
    logprobs = None
    if rows.rollout_log_probs is not None:
        logprobs = [
            np.zeros(r.shape[0], lp_dtype) if lp is None else lp
            for r, lp in zip(rows.responses, rows.rollout_log_probs)
        ]
    r_lengths = torch.from_numpy(rows.response_lengths)
    return _Flat(
        prompt_ids=torch.from_numpy(_concat(rows.prompts, NUMPY_DTYPES["prompts"])),
        prompt_lengths=torch.from_numpy(rows.prompt_lengths),
        response_ids=torch.from_numpy(_concat(rows.responses, NUMPY_DTYPES["responses"])),
        response_lengths=r_lengths,
        response_mask=torch.from_numpy(_concat(rows.response_mask, NUMPY_DTYPES["response_mask"])),
        rm_scores=_reward_at_last_token(torch.from_numpy(rows.rewards), r_lengths),
        rollout_log_probs=torch.from_numpy(_concat(logprobs, lp_dtype)) if logprobs else None,
        is_placeholder=torch.from_numpy(rows.is_placeholder),
        num_turns=torch.from_numpy(rows.num_turns),
        non_tensor=rows.non_tensor,
    )


def _read_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view to read a CPU tensor through, leaving the tensor as it was.

    Through DLPack: ``Tensor.numpy()`` would mark the storage of the caller's batch
    non-resizable. A tensor DLPack cannot export (needs grad, dtype unknown to this numpy) is
    copied instead.
    """
    try:
        return np.from_dlpack(tensor)
    except (BufferError, TypeError, RuntimeError):
        return tensor.detach().clone().numpy()


def _split(values: torch.Tensor, lengths: np.ndarray) -> list[np.ndarray]:
    """Flat values -> one numpy view per row."""
    if lengths.shape[0] == 0:
        return []
    return np.split(_read_view(values), np.cumsum(lengths[:-1]))


def _rows_from_flat(flat: _Flat) -> _Rows:
    """Flat columns (from a batch) -> per-row views, rm_scores kept as they are.

    The per-row lengths are copies: truncation writes them, and they may be a caller's column.
    """
    p_len, r_len = _read_view(flat.prompt_lengths).copy(), _read_view(flat.response_lengths).copy()
    lp = flat.rollout_log_probs
    return _Rows(
        prompts=_split(flat.prompt_ids, p_len),
        responses=_split(flat.response_ids, r_len),
        response_mask=_split(flat.response_mask, r_len),
        rollout_log_probs=_split(lp, r_len) if lp is not None else None,
        rm_scores=_split(flat.rm_scores, r_len),
        rewards=np.zeros(p_len.shape[0], NUMPY_DTYPES["rm_scores"]),
        prompt_lengths=p_len,
        response_lengths=r_len,
        is_placeholder=_read_view(flat.is_placeholder),
        num_turns=_read_view(flat.num_turns),
        non_tensor=flat.non_tensor,
    )


def _length_column(lengths: np.ndarray, name: str, keys: list[Any] | None) -> torch.Tensor:
    """int64 lengths -> the float32 batch column, refusing a length float32 would round."""
    check_exact_lengths(lengths, name, keys)
    return torch.tensor(lengths, dtype=COLUMN_DTYPES[name])


def _row_columns(
    prompt_lengths: np.ndarray,
    response_lengths: np.ndarray,
    is_placeholder: np.ndarray,
    num_turns: np.ndarray,
    keys: list[Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-row columns as fresh tensors (never views of the input they came from).

    Lengths arrive as int64 (they index tokens everywhere inside this package) and leave as
    the float32 columns docs/design.md §6 declares; ``keys`` name a refused row.
    """
    return {
        "prompt_length": _length_column(prompt_lengths, "prompt_length", keys),
        "response_length": _length_column(response_lengths, "response_length", keys),
        "is_placeholder": torch.tensor(is_placeholder, dtype=COLUMN_DTYPES["is_placeholder"]),
        "num_turns": torch.tensor(num_turns, dtype=COLUMN_DTYPES["num_turns"]),
    }


def _non_tensor_columns(
    non_tensor: dict[str, list[Any]], num_turns: np.ndarray
) -> dict[str, list[Any]]:
    """The non-tensor columns a written batch gets: the given ones plus the two verl reads.

    ``__num_turns__`` is always ``num_turns`` again (so the two cannot disagree);
    ``multi_modal_inputs`` keeps a re-laid-out batch's dicts, ``{}`` for rows without one. Each
    row gets its own dict: one shared by all would change every row when a trainer wrote one.
    """
    columns = dict(non_tensor)
    columns["__num_turns__"] = num_turns.tolist()
    given = columns.get("multi_modal_inputs")
    if given is None:
        columns["multi_modal_inputs"] = [{} for _ in range(num_turns.shape[0])]
    else:
        columns["multi_modal_inputs"] = [{} if v is None else v for v in given]
    return columns


def _default_turns(is_placeholder: torch.Tensor) -> torch.Tensor:
    """``num_turns`` for a batch without the column: 0 on placeholders, else UNKNOWN_TURNS."""
    unknown = torch.full(is_placeholder.shape, UNKNOWN_TURNS, dtype=COLUMN_DTYPES["num_turns"])
    return unknown.masked_fill(is_placeholder.to(torch.bool), 0)


def lengths_as_index(lengths: torch.Tensor, name: str) -> torch.Tensor:
    """A ``prompt_length``/``response_length`` column read back as int64, to index tokens with.

    Takes the float32 columns of docs/design.md §6 and the int64 ones of older exports; a
    negative or fractional length is refused (it cannot have come from a row).
    """
    if lengths.dtype.is_floating_point:
        whole = torch.isfinite(lengths) & (lengths >= 0) & (lengths == lengths.round())
        if not bool(torch.all(whole)):
            raise InvalidArgument(
                f"column {name!r} holds negative, fractional or infinite lengths; not a batch's"
            )
    elif lengths.numel() and int(lengths.min()) < 0:
        raise InvalidArgument(f"column {name!r} holds negative lengths; not a batch's")
    return lengths.to(torch.int64)


def _split_columns(batch: TensorDictBase) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Tensor columns and non-tensor columns (as lists); rejects nested sub-TensorDicts."""
    tensors: dict[str, Any] = {}
    non_tensors: dict[str, list[Any]] = {}
    for key in batch.keys():
        value = batch.get(key)
        if isinstance(value, (NonTensorStack, NonTensorData)):
            non_tensors[key] = non_tensor(batch, key)
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            raise InvalidArgumentType(
                f"column {key!r}: unsupported entry of type {type(value).__name__}"
            )
    return tensors, non_tensors


def _reject_unknown(tensors: dict[str, Any]) -> None:
    unknown = sorted(set(tensors) - LAYOUT_COLUMNS)
    if unknown:
        raise InvalidArgument(
            f"unknown tensor columns {unknown}: only section 6 columns are re-laid out"
        )
