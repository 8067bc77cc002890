"""The padded layout verl's trainer consumes: prompts left-, responses right-padded.

``input_ids = cat(prompts, responses)``; the reward sits on the last attended response token of
``rm_scores``. The writer fills each output once and copies every row's slices straight into
place: a handful of numpy slice writes per row, no per-token Python loop, no per-token index
arrays, no [B, P+R] temporaries (``build_padded`` is benchmarked: ``python -m benchmarks``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from sessions.batches.buffers import empty_column
from sessions.batches.collect import (
    BatchRow,
    _Rows,
    _rows_from_batch_rows,
    check_token_id,
    limits,
)
from sessions.batches.columns import COLUMN_DTYPES
from sessions.batches.flat import (
    _default_turns,
    _Flat,
    _non_tensor_columns,
    _reject_unknown,
    _row_columns,
    _split_columns,
    lengths_as_index,
)
from sessions.batches.non_tensor_stacks import set_non_tensor_columns
from sessions.errors import InvalidArgument

__all__ = ["build_padded"]


def _empty(
    shape: tuple[int, ...], dtype: torch.dtype, column: str | None = None
) -> tuple[torch.Tensor, np.ndarray]:
    """A new torch tensor and a numpy view of its memory, which the padded writer fills.

    numpy rather than torch: the writes are many small slice copies (well under a microsecond
    each in numpy, several through torch's dispatcher) and a few whole-array fills that torch
    would split over its intra-op threads, which on a busy 2-core host costs more than it saves.
    The view comes through DLPack: ``Tensor.numpy()`` would mark the storage non-resizable, so
    ``resize_`` on a batch column would fail where it works on tensors torch builds itself.
    A named ``column`` may get memory an earlier batch's same column no longer uses
    (``sessions.batches.buffers``: never memory anyone still holds).
    """
    tensor = (
        torch.empty(shape, dtype=dtype) if column is None else empty_column(column, shape, dtype)
    )
    view = np.from_dlpack(tensor)
    if not view.flags.writeable:  # numpy < 2 hands DLPack memory out read-only
        view = tensor.numpy()
    return tensor, view


def _pad_rows_right(
    arrays: list[np.ndarray | None],
    lengths: list[int],
    width: int,
    dtype: torch.dtype,
    column: str | None = None,
) -> torch.Tensor:
    """[B, width] zeros with each row's array at its start (a None row stays zeros)."""
    tensor, out = _empty((len(lengths), width), dtype, column)
    out.fill(0)
    for i, (values, n) in enumerate(zip(arrays, lengths)):
        if values is not None:
            out[i, :n] = values
    return tensor


def _token_columns(
    rows: _Rows, p_len: list[int], r_len: list[int], P: int, R: int, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """prompts, responses, input_ids, attention_mask, position_ids and response_mask.

    One loop over the rows, a few slice writes each, into outputs filled once beforehand; no
    [B, P+R] temporaries. Each row's tokens go into ``prompts`` and ``responses``, and
    ``input_ids`` is those two copied side by side: copying them out of a filled ``input_ids``
    instead reads its B x (P+R) again, and the CPU time of the section was 3-7% more.
    position_ids is verl's ``(cumsum(attention_mask) - 1).clamp(min=0)`` written directly: 0 on
    the left padding, 0..n-1 on the n attended tokens, n-1 (or 0) on the right padding.
    """
    B, T = len(p_len), P + R
    prompts, prompts_np = _empty((B, P), COLUMN_DTYPES["prompts"], "prompts")
    responses, responses_np = _empty((B, R), COLUMN_DTYPES["responses"], "responses")
    attention_mask, attn = _empty((B, T), COLUMN_DTYPES["attention_mask"], "attention_mask")
    position_ids, pos = _empty((B, T), COLUMN_DTYPES["position_ids"], "position_ids")
    response_mask, mask = _empty((B, R), COLUMN_DTYPES["response_mask"], "response_mask")
    prompts_np.fill(pad_token_id)
    responses_np.fill(pad_token_id)
    attn.fill(0)
    mask.fill(0)
    # a row's positions up to its last attended token: the window of `ramp` at T - start
    ramp = np.zeros(2 * T, np.int64)
    ramp[T:] = np.arange(T)
    columns = zip(rows.prompts, rows.responses, rows.response_mask, p_len, r_len)
    for i, (prompt, response, response_mask_i, a, b) in enumerate(columns):
        start, end = P - a, P + b
        prompts_np[i, start:] = prompt
        responses_np[i, :b] = response
        attn[i, start:end] = 1
        row = pos[i]
        row[:end] = ramp[T - start : T + a + b]
        row[end:] = a + b - 1 if a + b else 0
        mask[i, :b] = response_mask_i
    input_ids, ids = _empty((B, T), COLUMN_DTYPES["input_ids"], "input_ids")
    ids[:, :P] = prompts_np
    ids[:, P:] = responses_np
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
    }


def _scores(rows: _Rows, r_len: list[int], R: int) -> torch.Tensor:
    """rm_scores [B, R]: the given per-row scores, else each reward on its last response token."""
    dtype = COLUMN_DTYPES["rm_scores"]
    if rows.rm_scores is not None:
        return _pad_rows_right(rows.rm_scores, r_len, R, dtype, "rm_scores")
    tensor, out = _empty((len(r_len), R), dtype, "rm_scores")
    out.fill(0.0)
    lengths = rows.response_lengths
    has_response = np.flatnonzero(lengths > 0)
    out[has_response, lengths[has_response] - 1] = rows.rewards[has_response]
    return tensor


def _padded_from_rows(
    rows: _Rows,
    pad_token_id: int,
    prompt_width: int | None = None,
    response_width: int | None = None,
) -> TensorDict:
    """Section 6 padded columns, as wide as the longest prompt and response or the given widths.

    A given width must hold every row (``collect.apply_limits`` made sure). The per-row columns
    come first: a row whose length float32 cannot hold is refused before anything large is built.
    """
    keys = rows.non_tensor.get("key")
    row_columns = _row_columns(
        rows.prompt_lengths, rows.response_lengths, rows.is_placeholder, rows.num_turns, keys
    )
    p_len, r_len = rows.prompt_lengths.tolist(), rows.response_lengths.tolist()
    P = max(p_len, default=0) if prompt_width is None else prompt_width
    R = max(r_len, default=0) if response_width is None else response_width
    columns = _token_columns(rows, p_len, r_len, P, R, pad_token_id)
    columns["rm_scores"] = _scores(rows, r_len, R)
    if rows.rollout_log_probs is not None:
        dtype = COLUMN_DTYPES["rollout_log_probs"]
        columns["rollout_log_probs"] = _pad_rows_right(
            rows.rollout_log_probs, r_len, R, dtype, "rollout_log_probs"
        )
    columns.update(row_columns)
    batch = TensorDict(columns, batch_size=[rows.batch_size])
    set_non_tensor_columns(batch, _non_tensor_columns(rows.non_tensor, rows.num_turns))
    return batch


def _flat_from_padded(batch: TensorDictBase) -> _Flat:
    """A padded batch -> flat: each row's attended tokens, found from its two lengths."""
    tensors, non_tensors = _split_columns(batch)
    _reject_unknown(tensors)
    p_len = lengths_as_index(tensors["prompt_length"], "prompt_length")
    r_len = lengths_as_index(tensors["response_length"], "response_length")
    P, R = tensors["prompts"].shape[1], tensors["responses"].shape[1]
    in_prompt = torch.arange(P) >= (P - p_len)[:, None]
    in_response = torch.arange(R) < r_len[:, None]
    lp = tensors.get("rollout_log_probs")
    is_placeholder = tensors["is_placeholder"].to(COLUMN_DTYPES["is_placeholder"])
    turns = tensors.get("num_turns")
    return _Flat(
        prompt_ids=tensors["prompts"][in_prompt],
        prompt_lengths=p_len,
        response_ids=tensors["responses"][in_response],
        response_lengths=r_len,
        response_mask=tensors["response_mask"][in_response],
        rm_scores=tensors["rm_scores"][in_response],
        rollout_log_probs=lp[in_response] if lp is not None else None,
        is_placeholder=is_placeholder,
        num_turns=_default_turns(is_placeholder)
        if turns is None
        else turns.to(COLUMN_DTYPES["num_turns"]),
        non_tensor=non_tensors,
    )


def build_padded(
    rows: Sequence[BatchRow],
    *,
    pad_token_id: int = 0,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    truncate: bool = False,
    prompt_width: int | None = None,
    response_width: int | None = None,
    logprobs: bool | None = None,
) -> TensorDict:
    """Rows -> padded section 6 batch (prompts left-, responses right-padded).

    Padded as wide as the longest prompt and response, or exactly ``prompt_width`` /
    ``response_width`` when given (verl pads every step to ``max_prompt_length`` /
    ``max_response_length``, so two steps' batches ``torch.cat``). A width is also a limit.
    Without ``truncate`` an over-long row raises ``BatchTooLongError`` (naming the row and the
    option it broke) before any tensor is built; with it, prompts keep their last and responses
    their first tokens (mask and logprobs cut alike) and the reward moves to the new last
    response token.

    ``logprobs``: whether the batch has ``rollout_log_probs``. None (default): when a row
    carries them (docs/design.md §6), so a step without rows has none; True: always (rows
    without logprobs, and a step without rows, get zeros, ``[0, R]`` for an empty one), which is
    how an empty step of a run that records logprobs ``torch.cat``-s / ``DataProto.concat``-s
    with its other steps; False: never (given logprobs are left out).
    """
    if logprobs is not None and not isinstance(logprobs, (bool, np.bool_)):  # not `in`: arrays
        raise InvalidArgument(f"logprobs must be None, True or False, got {logprobs!r}")
    pad_token_id = check_token_id(pad_token_id)
    limit = limits(max_prompt_length, max_response_length, prompt_width, response_width)
    rows_ = _rows_from_batch_rows(rows, limit, truncate)
    if logprobs is False:
        rows_.rollout_log_probs = None
    elif logprobs and rows_.rollout_log_probs is None:
        rows_.rollout_log_probs = [None] * rows_.batch_size  # a None entry: zeros
    return _padded_from_rows(rows_, pad_token_id, limit.prompt_width, limit.response_width)
