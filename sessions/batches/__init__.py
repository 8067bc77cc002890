"""Projected rows -> verl-convention torch batches (DESIGN.md section 6).

Two layouts of the same columns:

* padded (``build_padded``): what verl's trainer consumes. Prompts are left-padded, responses
  right-padded, ``input_ids = cat(prompts, responses)``, the reward sits on the last attended
  response token of ``rm_scores``.
* jagged (``build_jagged``): unpadded ``torch.jagged`` nested tensors, what row stores such as
  TransferQueue hold. ``densify`` turns it into the padded layout.

Rows are gathered once into per-row arrays (the caller's own, or views: truncation slices them).
The padded writer fills each output once and copies every row's slices straight into place: a
handful of numpy slice writes per row, no per-token Python loop, no per-token index arrays, no
[B, P+R] temporaries. The jagged builder concatenates each column once (the *flat* form, all
rows' tokens plus per-row lengths); ``densify`` and ``concat_padded`` split flat columns back
into per-row views for the same padded writer.

Non-tensor columns (``NON_TENSOR_COLUMNS``) are stored as ``tensordict.NonTensorStack`` of
length B. ``batch["uid"]`` returns a ``list`` subclass; ``non_tensor(batch, "uid")`` returns a
plain ``list`` and also copes with a column set through ``set_non_tensor``. Indexing, boolean
selection and ``torch.cat`` of batches keep these columns aligned with the rows. A stack is one
``NonTensorData`` object per row, so these 10 columns cost more than the tensor columns; they
are built directly, with the cyclic GC paused (``sessions.batches.non_tensor_stacks``).

Decisions recorded here (the contract is silent on them):

* ``rollout_log_probs`` exists iff at least one row carries logprobs; rows without logprobs get
  zeros in it (they are then indistinguishable from logprob 0.0 -- check ``is_placeholder`` or
  keep logprobs on all rows if that matters).
* A row with an empty response (length 0) keeps its reward out of ``rm_scores`` (there is no
  attended response token to put it on). verl reads such a row as "aborted" and excludes it from
  score metrics anyway; the 1+1-token placeholder exists precisely to avoid this case.
* A placeholder row must have an all-zero ``response_mask``; otherwise ``ValueError``.
* An empty ``rows`` sequence gives ``batch_size=[0]`` with every tensor key present and width 0.
  ``torch.cat`` needs equal widths for padded batches, so use ``concat_padded`` to concatenate
  padded batches of different widths (including empty ones); jagged batches with the same keys
  ``torch.cat`` as is (``concat_padded`` also takes them, with or without ``rollout_log_probs``).
* ``meta`` keys outside ``NON_TENSOR_COLUMNS`` are ignored; numpy scalars are turned into Python
  scalars so the columns stay ``torch.load(weights_only=True)``-safe.
"""

from __future__ import annotations

from sessions.errors import LedgerError

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from sessions.batches.non_tensor_stacks import SCALAR_TYPES, set_non_tensor_columns

__all__ = [
    "BatchRow",
    "BatchTooLongError",
    "NON_TENSOR_COLUMNS",
    "PROMPT_COLUMNS",
    "RESPONSE_COLUMNS",
    "SEQUENCE_COLUMNS",
    "build_padded",
    "build_jagged",
    "densify",
    "concat_padded",
    "non_tensor",
    "ROW_COLUMNS",
    "to_plain_dict",
    "from_plain_dict",
]

NON_TENSOR_COLUMNS: tuple[str, ...] = (
    "run",
    "uid",
    "session_id",
    "session_index",
    "key",
    "partition",
    "global_step",
    "data_source",
    "failure_reason",
    "materialization_reason",
)

#: token-level columns, by which side of the sequence they belong to
PROMPT_COLUMNS: tuple[str, ...] = ("prompts",)
RESPONSE_COLUMNS: tuple[str, ...] = ("responses", "response_mask", "rm_scores", "rollout_log_probs")
SEQUENCE_COLUMNS: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids")
ROW_COLUMNS: tuple[str, ...] = ("prompt_length", "response_length", "is_placeholder")
_TOKEN_COLUMNS = PROMPT_COLUMNS + RESPONSE_COLUMNS + SEQUENCE_COLUMNS

#: separator of the plain-dict keys of jagged columns: ``"prompts.values"``, ``"prompts.offsets"``
_VALUES_SUFFIX = ".values"
_OFFSETS_SUFFIX = ".offsets"

_PLAIN_SCALARS = (type(None), bool, int, float, str)
#: the value types ``NonTensorData`` stores as they are (tensordict's pytree scalar leaves)
_NO_META: Mapping[str, Any] = {}


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One projected trajectory or placeholder, as numpy arrays (any int dtype for ids)."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    logprobs: np.ndarray | None
    reward: float
    is_placeholder: bool
    meta: Mapping[str, Any] = field(default_factory=dict)


class BatchTooLongError(LedgerError, ValueError):
    """A row exceeds ``max_prompt_length``/``max_response_length`` and truncation was not asked."""

    def __init__(self, key: Any, side: str, length: int, limit: int) -> None:
        self.key, self.side, self.length, self.limit = key, side, length, limit
        super().__init__(
            f"row {key!r}: {side} length {length} exceeds max_{side}_length={limit}; "
            f"pass truncate=True to cut it (prompts keep their last tokens, responses their "
            f"first) or raise max_{side}_length"
        )


# --------------------------------------------------------------------------------------------
# intermediates: per-row arrays (-> padded) and flat columns (-> jagged)
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Rows:
    """Each row's token arrays plus per-row scalars: what the padded layout is written from.

    The arrays are the caller's own or views of them (truncation slices them, never copies):
    the padded writer copies each one straight into its place in the output, so the output is
    written once (plus one fill) and no flat copy or per-token index array is built for it.
    """

    prompts: list[np.ndarray]
    responses: list[np.ndarray]
    response_mask: list[np.ndarray]
    rollout_log_probs: list[np.ndarray | None] | None  # None: no row has them; a None entry: zeros
    rm_scores: list[np.ndarray] | None  # None: each row's reward on its last response token
    rewards: np.ndarray  # [B] float32, read when rm_scores is None
    prompt_lengths: np.ndarray  # [B] int64
    response_lengths: np.ndarray  # [B] int64
    is_placeholder: np.ndarray  # [B] bool
    non_tensor: dict[str, list[Any]]

    @property
    def batch_size(self) -> int:
        return int(self.prompt_lengths.shape[0])


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
    non_tensor: dict[str, list[Any]]

    @property
    def batch_size(self) -> int:
        return int(self.prompt_lengths.numel())


def _row_key(row: BatchRow, index: int) -> Any:
    """The name an error message uses for a row: its queue key, else its position."""
    key = row.meta.get("key") if row.meta is not None else None
    return key if key is not None else f"#{index}"


def _plain_column(values: list[Any]) -> list[Any]:
    """numpy scalars -> Python scalars, so non-tensor columns stay weights_only-loadable."""
    if SCALAR_TYPES.issuperset(map(type, values)):  # the usual case, tested at C speed
        return values
    return [v.item() if isinstance(v, np.generic) else v for v in values]


def _as_1d(array: Any, key: Any, name: str, kinds: str) -> np.ndarray:
    arr = np.asarray(array)
    if arr.ndim != 1:
        raise ValueError(f"row {key!r}: {name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in kinds:
        raise ValueError(f"row {key!r}: {name} has dtype {arr.dtype}, expected kind in {kinds!r}")
    return arr


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def _collect(rows: Sequence[BatchRow]) -> tuple[_Rows, list[Any]]:
    """Gather and shape-check each row's arrays (and the keys errors name); O(1) work per row."""
    keys, prompts, responses, masks, logprobs = [], [], [], [], []
    metas: list[Mapping[str, Any]] = []
    has_logprobs = False
    for i, row in enumerate(rows):
        key = _row_key(row, i)
        prompt = _as_1d(row.prompt_ids, key, "prompt_ids", "iu")
        response = _as_1d(row.response_ids, key, "response_ids", "iu")
        mask = _as_1d(row.response_mask, key, "response_mask", "iub")
        if mask.shape[0] != response.shape[0]:
            raise ValueError(
                f"row {key!r}: response_mask length {mask.shape[0]} != response length "
                f"{response.shape[0]}"
            )
        lp = None
        if row.logprobs is not None:
            lp = _as_1d(row.logprobs, key, "logprobs", "f")
            if lp.shape[0] != response.shape[0]:
                raise ValueError(
                    f"row {key!r}: logprobs length {lp.shape[0]} != response length "
                    f"{response.shape[0]}"
                )
            has_logprobs = True
        keys.append(key)
        prompts.append(prompt)
        responses.append(response)
        masks.append(mask)
        logprobs.append(lp)
        metas.append(row.meta or _NO_META)
    n = len(rows)
    non_tensor = {name: _plain_column([m.get(name) for m in metas]) for name in NON_TENSOR_COLUMNS}
    collected = _Rows(
        prompts=prompts,
        responses=responses,
        response_mask=masks,
        rollout_log_probs=logprobs if has_logprobs else None,
        rm_scores=None,
        rewards=np.fromiter((float(r.reward) for r in rows), np.float32, count=n),
        prompt_lengths=np.fromiter((a.shape[0] for a in prompts), np.int64, count=n),
        response_lengths=np.fromiter((a.shape[0] for a in responses), np.int64, count=n),
        is_placeholder=np.fromiter((bool(r.is_placeholder) for r in rows), bool, count=n),
        non_tensor=non_tensor,
    )
    return collected, keys


def _check_limit(keys: list[Any], lengths: np.ndarray, limit: int | None, side: str) -> None:
    """Raise BatchTooLongError for the first row over ``limit`` (vectorised test)."""
    if limit is None:
        return
    over = np.flatnonzero(lengths > limit)
    if over.size:
        i = int(over[0])
        raise BatchTooLongError(keys[i], side, int(lengths[i]), limit)


def _check_limit_arg(limit: int | None, side: str) -> None:
    if limit is not None and (isinstance(limit, bool) or int(limit) != limit or limit < 1):
        raise ValueError(f"max_{side}_length must be a positive int or None, got {limit!r}")


def _truncate(rows: _Rows, max_prompt_length: int | None, max_response_length: int | None) -> None:
    """Cut in place, by slicing (views): prompts keep their last tokens, responses their first."""
    if max_prompt_length is not None:
        for i in np.flatnonzero(rows.prompt_lengths > max_prompt_length).tolist():
            rows.prompts[i] = rows.prompts[i][-max_prompt_length:]
        np.minimum(rows.prompt_lengths, max_prompt_length, out=rows.prompt_lengths)
    if max_response_length is not None:
        cut = slice(None, max_response_length)
        for i in np.flatnonzero(rows.response_lengths > max_response_length).tolist():
            rows.responses[i] = rows.responses[i][cut]
            rows.response_mask[i] = rows.response_mask[i][cut]
            if rows.rollout_log_probs is not None and rows.rollout_log_probs[i] is not None:
                rows.rollout_log_probs[i] = rows.rollout_log_probs[i][cut]
        np.minimum(rows.response_lengths, max_response_length, out=rows.response_lengths)


def _check_values(rows: _Rows, keys: list[Any]) -> None:
    """Mask values must be 0/1 and placeholders fully masked; names the first bad row.

    One pass over all masks concatenated in their own dtype (1 byte per token as stored), with
    the per-token search for the culprit only on the error path.
    """
    flat = np.concatenate(rows.response_mask) if rows.response_mask else np.zeros(0, np.uint8)
    # mixed dtypes may promote to float64 (uint64 + int64): 0 and 1 stay exact, others stay off
    if flat.size and (flat.max() > 1 or flat.min() < 0):
        first = int(np.flatnonzero((flat != 0) & (flat != 1))[0])
        row = int(np.searchsorted(np.cumsum(rows.response_lengths), first, side="right"))
        raise ValueError(f"row {keys[row]!r}: response_mask values must be 0 or 1")
    for i in np.flatnonzero(rows.is_placeholder).tolist():
        if rows.response_mask[i].any():
            raise ValueError(f"row {keys[i]!r}: a placeholder must have response_mask all 0")


def _rows_from_batch_rows(
    rows: Sequence[BatchRow],
    max_prompt_length: int | None,
    max_response_length: int | None,
    truncate: bool,
) -> _Rows:
    """Validate (limits before anything is built), truncate by slicing, check mask values."""
    _check_limit_arg(max_prompt_length, "prompt")
    _check_limit_arg(max_response_length, "response")
    collected, keys = _collect(rows)
    if truncate:
        _truncate(collected, max_prompt_length, max_response_length)
    else:
        _check_limit(keys, collected.prompt_lengths, max_prompt_length, "prompt")
        _check_limit(keys, collected.response_lengths, max_response_length, "response")
    _check_values(collected, keys)
    return collected


def _row_ids_and_positions(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For flat tokens of rows with ``lengths``: each token's row id and position in its row.

    Done in numpy: ``torch.repeat_interleave`` enters a parallel region even for a handful of
    elements and costs milliseconds per call on a busy 2-core host.
    """
    n = lengths.numpy().astype(np.int64, copy=False)
    rows = np.repeat(np.arange(n.size), n)
    positions = np.arange(rows.size) - (np.cumsum(n) - n)[rows]
    return torch.from_numpy(rows), torch.from_numpy(positions)


def _reward_at_last_token(rewards: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """Flat rm_scores: zeros, with each row's reward on its last response token (if any)."""
    scores = torch.zeros(int(response_lengths.sum()), dtype=torch.float32)
    has_response = response_lengths > 0
    last = torch.cumsum(response_lengths, 0) - 1
    scores[last[has_response]] = rewards[has_response]
    return scores


def _flat_from_rows(rows: _Rows) -> _Flat:
    """Concatenate every token column once (rows without logprobs contribute zeros)."""
    logprobs = None
    if rows.rollout_log_probs is not None:
        logprobs = [
            np.zeros(r.shape[0], np.float32) if lp is None else lp
            for r, lp in zip(rows.responses, rows.rollout_log_probs)
        ]
    r_lengths = torch.from_numpy(rows.response_lengths)
    return _Flat(
        prompt_ids=torch.from_numpy(_concat(rows.prompts, np.int64)),
        prompt_lengths=torch.from_numpy(rows.prompt_lengths),
        response_ids=torch.from_numpy(_concat(rows.responses, np.int64)),
        response_lengths=r_lengths,
        response_mask=torch.from_numpy(_concat(rows.response_mask, np.int64)),
        rm_scores=_reward_at_last_token(torch.from_numpy(rows.rewards), r_lengths),
        rollout_log_probs=torch.from_numpy(_concat(logprobs, np.float32)) if logprobs else None,
        is_placeholder=torch.from_numpy(rows.is_placeholder),
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
    """Flat columns (from a batch) -> per-row views, rm_scores kept as they are."""
    p_len, r_len = _read_view(flat.prompt_lengths), _read_view(flat.response_lengths)
    lp = flat.rollout_log_probs
    return _Rows(
        prompts=_split(flat.prompt_ids, p_len),
        responses=_split(flat.response_ids, r_len),
        response_mask=_split(flat.response_mask, r_len),
        rollout_log_probs=_split(lp, r_len) if lp is not None else None,
        rm_scores=_split(flat.rm_scores, r_len),
        rewards=np.zeros(p_len.shape[0], np.float32),
        prompt_lengths=p_len,
        response_lengths=r_len,
        is_placeholder=_read_view(flat.is_placeholder),
        non_tensor=flat.non_tensor,
    )


# --------------------------------------------------------------------------------------------
# -> padded / jagged
# --------------------------------------------------------------------------------------------


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A new torch tensor and a numpy view of its memory, which the padded writer fills.

    numpy rather than torch: the writes are many small slice copies (well under a microsecond
    each in numpy, several through torch's dispatcher) and a few whole-array fills that torch
    would split over its intra-op threads, which on a busy 2-core host costs more than it saves.
    The view comes through DLPack: ``Tensor.numpy()`` would mark the storage non-resizable, so
    ``resize_`` on a batch column would fail where it works on tensors torch builds itself.
    """
    tensor = torch.empty(shape, dtype=dtype)
    view = np.from_dlpack(tensor)
    if not view.flags.writeable:  # numpy < 2 hands DLPack memory out read-only
        view = tensor.numpy()
    return tensor, view


def _pad_rows_right(
    arrays: list[np.ndarray | None], lengths: list[int], width: int, dtype: torch.dtype
) -> torch.Tensor:
    """[B, width] zeros with each row's array at its start (a None row stays zeros)."""
    tensor, out = _empty((len(lengths), width), dtype)
    out.fill(0)
    for i, (values, n) in enumerate(zip(arrays, lengths)):
        if values is not None:
            out[i, :n] = values
    return tensor


def _token_columns(
    rows: _Rows, p_len: list[int], r_len: list[int], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """prompts, responses, input_ids, attention_mask, position_ids and response_mask.

    One loop over the rows, a few slice writes each, into outputs filled once beforehand; no
    [B, P+R] temporaries. position_ids is verl's ``(cumsum(attention_mask) - 1).clamp(min=0)``
    written directly: 0 on the left padding, 0..n-1 on the n attended tokens, n-1 (or 0) on the
    right padding.
    """
    B, P, R = len(p_len), max(p_len, default=0), max(r_len, default=0)
    T = P + R
    input_ids, ids = _empty((B, T), torch.int64)
    attention_mask, attn = _empty((B, T), torch.int64)
    position_ids, pos = _empty((B, T), torch.int64)
    response_mask, mask = _empty((B, R), torch.int64)
    ids.fill(pad_token_id)
    attn.fill(0)
    mask.fill(0)
    # a row's positions up to its last attended token: the window of `ramp` at T - start
    ramp = np.zeros(2 * T, np.int64)
    ramp[T:] = np.arange(T)
    columns = zip(rows.prompts, rows.responses, rows.response_mask, p_len, r_len)
    for i, (prompt, response, response_mask_i, a, b) in enumerate(columns):
        start, end = P - a, P + b
        row = ids[i]
        row[start:P] = prompt
        row[P:end] = response
        attn[i, start:end] = 1
        row = pos[i]
        row[:end] = ramp[T - start : T + a + b]
        row[end:] = a + b - 1 if a + b else 0
        mask[i, :b] = response_mask_i
    prompts, prompts_np = _empty((B, P), torch.int64)
    np.copyto(prompts_np, ids[:, :P])
    responses, responses_np = _empty((B, R), torch.int64)
    np.copyto(responses_np, ids[:, P:])
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
    if rows.rm_scores is not None:
        return _pad_rows_right(rows.rm_scores, r_len, R, torch.float32)
    tensor, out = _empty((len(r_len), R), torch.float32)
    out.fill(0.0)
    lengths = rows.response_lengths
    has_response = np.flatnonzero(lengths > 0)
    out[has_response, lengths[has_response] - 1] = rows.rewards[has_response]
    return tensor


def _row_columns(
    prompt_lengths: np.ndarray, response_lengths: np.ndarray, is_placeholder: np.ndarray
) -> dict[str, torch.Tensor]:
    """Per-row columns as fresh tensors (never views of the input they came from)."""
    return {
        "prompt_length": torch.tensor(prompt_lengths),
        "response_length": torch.tensor(response_lengths),
        "is_placeholder": torch.tensor(is_placeholder),
    }


def _padded_from_rows(rows: _Rows, pad_token_id: int) -> TensorDict:
    """Section 6 padded columns, as wide as the longest prompt and response."""
    p_len, r_len = rows.prompt_lengths.tolist(), rows.response_lengths.tolist()
    R = max(r_len, default=0)
    columns = _token_columns(rows, p_len, r_len, pad_token_id)
    columns["rm_scores"] = _scores(rows, r_len, R)
    if rows.rollout_log_probs is not None:
        logprobs = _pad_rows_right(rows.rollout_log_probs, r_len, R, torch.float32)
        columns["rollout_log_probs"] = logprobs
    columns.update(_row_columns(rows.prompt_lengths, rows.response_lengths, rows.is_placeholder))
    batch = TensorDict(columns, batch_size=[rows.batch_size])
    set_non_tensor_columns(batch, rows.non_tensor)
    return batch


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])


def _jagged(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def _jagged_from_flat(flat: _Flat) -> TensorDict:
    """Section 6 columns as torch.jagged nested tensors; response-side columns share offsets."""
    p_len, r_len = flat.prompt_lengths, flat.response_lengths
    seq_len = p_len + r_len
    p_off, r_off, s_off = _offsets(p_len), _offsets(r_len), _offsets(seq_len)
    input_ids = torch.empty(int(seq_len.sum()), dtype=torch.int64)
    rows, positions = _row_ids_and_positions(p_len)
    input_ids[s_off[rows] + positions] = flat.prompt_ids
    rows, positions = _row_ids_and_positions(r_len)
    input_ids[s_off[rows] + p_len[rows] + positions] = flat.response_ids
    _, seq_positions = _row_ids_and_positions(seq_len)
    columns: dict[str, torch.Tensor] = {
        "prompts": _jagged(flat.prompt_ids, p_off),
        "responses": _jagged(flat.response_ids, r_off),
        "input_ids": _jagged(input_ids, s_off),
        "attention_mask": _jagged(torch.ones_like(input_ids), s_off),
        "position_ids": _jagged(seq_positions, s_off),
        "response_mask": _jagged(flat.response_mask, r_off),
        "rm_scores": _jagged(flat.rm_scores, r_off),
    }
    if flat.rollout_log_probs is not None:
        columns["rollout_log_probs"] = _jagged(flat.rollout_log_probs, r_off)
    columns.update(
        _row_columns(
            _read_view(flat.prompt_lengths),
            _read_view(flat.response_lengths),
            _read_view(flat.is_placeholder),
        )
    )
    batch = TensorDict(columns, batch_size=[flat.batch_size])
    set_non_tensor_columns(batch, flat.non_tensor)
    return batch


# --------------------------------------------------------------------------------------------
# batch -> flat (for densify / concat_padded)
# --------------------------------------------------------------------------------------------


def _is_jagged(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_nested and value.layout == torch.jagged


def _jagged_parts(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, offsets starting at 0) of a jagged nested tensor, whatever view it is."""
    if value.lengths() is not None:  # a narrow()-style view with holes
        value = value.contiguous()
    offsets = value.offsets()
    values = value.values()[int(offsets[0]) : int(offsets[-1])]
    return values, offsets - offsets[0]


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
            raise TypeError(f"column {key!r}: unsupported entry of type {type(value).__name__}")
    return tensors, non_tensors


def _reject_unknown(tensors: Mapping[str, Any]) -> None:
    unknown = sorted(set(tensors) - set(_TOKEN_COLUMNS) - set(ROW_COLUMNS))
    if unknown:
        raise ValueError(
            f"unknown tensor columns {unknown}: only section 6 columns are re-laid out"
        )


def _flat_from_jagged(batch: TensorDictBase) -> _Flat:
    tensors, non_tensors = _split_columns(batch)
    _reject_unknown(tensors)
    parts = {k: _jagged_parts(v) for k, v in tensors.items() if _is_jagged(v)}
    missing = {"prompts", "responses", "response_mask", "rm_scores"} - set(parts)
    if missing:
        raise ValueError(f"not a jagged batch: missing jagged columns {sorted(missing)}")
    prompt_ids, p_off = parts["prompts"]
    response_ids, r_off = parts["responses"]
    p_len, r_len = p_off.diff(), r_off.diff()
    for name in RESPONSE_COLUMNS:
        if name in parts and not torch.equal(parts[name][1], r_off):
            raise ValueError(f"column {name!r}: row lengths differ from 'responses'")
    lp = parts.get("rollout_log_probs")
    return _Flat(
        prompt_ids=prompt_ids.to(torch.int64),
        prompt_lengths=p_len,
        response_ids=response_ids.to(torch.int64),
        response_lengths=r_len,
        response_mask=parts["response_mask"][0].to(torch.int64),
        rm_scores=parts["rm_scores"][0].to(torch.float32),
        rollout_log_probs=lp[0].to(torch.float32) if lp is not None else None,
        is_placeholder=tensors["is_placeholder"].to(torch.bool),
        non_tensor=non_tensors,
    )


def _flat_from_padded(batch: TensorDictBase) -> _Flat:
    tensors, non_tensors = _split_columns(batch)
    _reject_unknown(tensors)
    p_len, r_len = tensors["prompt_length"], tensors["response_length"]
    P, R = tensors["prompts"].shape[1], tensors["responses"].shape[1]
    in_prompt = torch.arange(P) >= (P - p_len)[:, None]
    in_response = torch.arange(R) < r_len[:, None]
    lp = tensors.get("rollout_log_probs")
    return _Flat(
        prompt_ids=tensors["prompts"][in_prompt],
        prompt_lengths=p_len,
        response_ids=tensors["responses"][in_response],
        response_lengths=r_len,
        response_mask=tensors["response_mask"][in_response],
        rm_scores=tensors["rm_scores"][in_response],
        rollout_log_probs=lp[in_response] if lp is not None else None,
        is_placeholder=tensors["is_placeholder"],
        non_tensor=non_tensors,
    )


def _flat_from_batch(batch: TensorDictBase) -> _Flat:
    """Either layout -> flat, dispatching on whether ``prompts`` is jagged."""
    if _is_jagged(batch.get("prompts")):
        return _flat_from_jagged(batch)
    return _flat_from_padded(batch)


def _concat_flats(flats: Sequence[_Flat]) -> _Flat:
    """Row-wise concatenation; missing logprobs -> zeros, missing non-tensor columns -> None."""
    any_lp = any(f.rollout_log_probs is not None for f in flats)
    names = list(dict.fromkeys(name for f in flats for name in f.non_tensor))
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
                else torch.zeros(f.response_ids.numel(), dtype=torch.float32)
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


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def build_padded(
    rows: Sequence[BatchRow],
    *,
    pad_token_id: int = 0,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    truncate: bool = False,
) -> TensorDict:
    """Rows -> padded section 6 batch (prompts left-, responses right-padded).

    Without ``truncate`` an over-long row raises ``BatchTooLongError`` before any tensor is
    built; with it, prompts keep their last and responses their first tokens (mask and
    logprobs cut alike) and the reward moves to the new last response token.
    """
    return _padded_from_rows(
        _rows_from_batch_rows(rows, max_prompt_length, max_response_length, truncate), pad_token_id
    )


def build_jagged(
    rows: Sequence[BatchRow],
    *,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    truncate: bool = False,
) -> TensorDict:
    """Rows -> unpadded batch: token columns are ``torch.jagged`` nested tensors [B, j]."""
    collected = _rows_from_batch_rows(rows, max_prompt_length, max_response_length, truncate)
    return _jagged_from_flat(_flat_from_rows(collected))


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


def non_tensor(batch: TensorDictBase, name: str) -> list[Any]:
    """A non-tensor column as a plain list of length B.

    Handles both a ``NonTensorStack`` (what the builders write) and a single
    ``NonTensorData`` (what ``set_non_tensor`` with a non-list writes), which is broadcast.
    """
    value = batch.get(name)
    if isinstance(value, NonTensorStack):
        return list(value.tolist())
    if isinstance(value, NonTensorData):
        data = value.data
        if isinstance(data, list) and len(data) == batch.batch_size[0]:
            return list(data)
        return [data] * batch.batch_size[0]
    raise TypeError(f"column {name!r} is not a non-tensor column ({type(value).__name__})")


def _check_plain(name: str, values: list[Any]) -> None:
    for v in values:
        if not isinstance(v, _PLAIN_SCALARS):
            raise TypeError(
                f"non-tensor column {name!r} holds a {type(v).__name__}; only None/bool/int/"
                "float/str survive torch.load(weights_only=True)"
            )


def to_plain_dict(batch: TensorDictBase) -> dict[str, Any]:
    """Batch -> dict of tensors and lists, loadable with ``torch.load(weights_only=True)``.

    Dense tensor columns keep their key. A jagged column ``c`` becomes two tensors,
    ``"c.values"`` (all rows' tokens concatenated) and ``"c.offsets"`` (int64 [B+1], row i is
    ``values[offsets[i]:offsets[i+1]]``). Non-tensor columns become Python lists of length B.
    ``from_plain_dict`` inverts it. Plain values/offsets rather than pickled nested tensors:
    readable by any consumer (numpy, other torch versions) without nested-tensor internals
    (torch 2.13 does load jagged tensors with ``weights_only=True``; that is not a stable promise).
    """
    tensors, non_tensors = _split_columns(batch)
    plain: dict[str, Any] = {}
    for key, value in tensors.items():
        if _is_jagged(value):
            values, offsets = _jagged_parts(value)
            plain[key + _VALUES_SUFFIX] = values.clone()
            plain[key + _OFFSETS_SUFFIX] = offsets.clone()
        elif value.is_nested:
            raise TypeError(f"column {key!r}: only torch.jagged nested tensors are supported")
        else:
            plain[key] = value.clone()
    for key, values in non_tensors.items():
        _check_plain(key, values)
        plain[key] = list(values)
    return plain


def _plain_batch_size(plain: Mapping[str, Any]) -> int:
    for key, value in plain.items():
        if key.endswith(_OFFSETS_SUFFIX):
            return int(value.numel()) - 1
        if isinstance(value, torch.Tensor) and not key.endswith(_VALUES_SUFFIX):
            return int(value.shape[0])
    for value in plain.values():
        return len(value)
    return 0


def from_plain_dict(plain: Mapping[str, Any]) -> TensorDict:
    """Inverse of ``to_plain_dict``; jagged columns sharing row lengths share one offsets tensor."""
    columns: dict[str, torch.Tensor] = {}
    lists: dict[str, list[Any]] = {}
    shared_offsets: list[torch.Tensor] = []
    for key, value in plain.items():
        if key.endswith(_OFFSETS_SUFFIX):
            continue
        if key.endswith(_VALUES_SUFFIX):
            name = key[: -len(_VALUES_SUFFIX)]
            offsets = plain[name + _OFFSETS_SUFFIX]
            offsets = next((o for o in shared_offsets if torch.equal(o, offsets)), offsets)
            if not any(o is offsets for o in shared_offsets):
                shared_offsets.append(offsets)
            columns[name] = _jagged(value, offsets)
        elif isinstance(value, torch.Tensor):
            columns[key] = value
        else:
            lists[key] = list(value)
    batch = TensorDict(columns, batch_size=[_plain_batch_size(plain)])
    set_non_tensor_columns(batch, lists)
    return batch
