"""BatchRows in, checked per-row arrays out: the one place rows are validated and truncated.

Both builders start here, so every layout refuses the same bad rows with the same message, and
an over-long row is reported before any tensor is allocated. The arrays are gathered once (the
caller's own, or views: truncation slices them), at O(1) Python work per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from tensordict import TensorDictBase

from sessions import validation
from sessions.batches.columns import (
    MAX_EXACT_LENGTH,
    META_COLUMNS,
    META_DEFAULTS,
    NUMPY_DTYPES,
    UNKNOWN_TURNS,
)
from sessions.batches.non_tensor_stacks import SCALAR_TYPES
from sessions.errors import InvalidArgument, InvalidArgumentType, LedgerError

__all__ = ["BatchRow", "BatchTooLongError"]

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
    """A row exceeds a length limit (``max_*_length`` or a fixed ``*_width``), truncation not asked."""

    def __init__(
        self, key: Any, side: str, length: int, limit: int, option: str | None = None
    ) -> None:
        option = option or f"max_{side}_length"
        self.key, self.side, self.length, self.limit, self.option = key, side, length, limit, option
        super().__init__(
            f"row {key!r}: {side} length {length} exceeds {option}={limit}; "
            f"pass truncate=True to cut it (prompts keep their last tokens, responses their "
            f"first) or raise {option}"
        )


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
    prompt_lengths: np.ndarray  # [B] int64 (indices; the batch column is float32)
    response_lengths: np.ndarray  # [B] int64
    is_placeholder: np.ndarray  # [B] bool
    num_turns: np.ndarray  # [B] int64
    non_tensor: dict[str, list[Any]]

    @property
    def batch_size(self) -> int:
        return int(self.prompt_lengths.shape[0])


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
        raise InvalidArgument(f"row {key!r}: {name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in kinds:
        raise InvalidArgument(
            f"row {key!r}: {name} has dtype {arr.dtype}, expected kind in {kinds!r}"
        )
    return arr


_PROMPT_IDS = attrgetter("prompt_ids")
_RESPONSE_IDS = attrgetter("response_ids")
_RESPONSE_MASK = attrgetter("response_mask")
_LOGPROBS = attrgetter("logprobs")
_DTYPE = attrgetter("dtype")
_NDIM = attrgetter("ndim")
_META_NAMES = (*META_COLUMNS, "num_turns")
_meta_values = itemgetter(*_META_NAMES)


def _check_rows_type(rows: object) -> None:
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Iterable):
        raise InvalidArgumentType(
            f"rows must be a list of BatchRow, got {type(rows).__name__}", argument="rows"
        )


def _plain_1d(arrays: list[Any], kinds: str) -> bool:
    """Whether every array is a plain 1-D ndarray of a dtype kind in ``kinds``: tested once per
    distinct dtype and over all arrays at C speed (``map``), not per row in bytecode."""
    return (
        _NDARRAY_ONLY.issuperset(map(type, arrays))
        and (not arrays or set(map(_NDIM, arrays)) == {1})
        and all(dtype.kind in kinds for dtype in set(map(_DTYPE, arrays)))
    )


_NDARRAY_ONLY = frozenset((np.ndarray,))


def _lengths(arrays: list[np.ndarray]) -> np.ndarray:
    return np.fromiter(map(len, arrays), np.int64, count=len(arrays))


def _arrays_at_once(
    rows: Sequence[BatchRow],
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], list[Any], bool] | None:
    """Each row's arrays, checked once per batch; None when any check fails, so the per-row
    loop (``_arrays_row_by_row``) takes over and names the row and what is wrong with it.

    Why: the per-row checks were a quarter of ``build_padded`` (cProfile of the projection
    workload); here each is a ``map`` or a set over all rows. Rows whose arrays are all 1-D
    ndarrays of the right kinds and lengths (what ``Ledger.batch`` and verl hand over) pass;
    lists, other dtypes or shapes, and empty arrays of another kind go to the loop, which
    accepts or refuses them as it always did.
    """
    if not _BATCH_ROW_ONLY.issuperset(map(type, rows)):
        return None
    prompts = list(map(_PROMPT_IDS, rows))
    responses = list(map(_RESPONSE_IDS, rows))
    masks = list(map(_RESPONSE_MASK, rows))
    logprobs = list(map(_LOGPROBS, rows))
    given = [lp for lp in logprobs if lp is not None]
    if not (
        _plain_1d(prompts, "iu")
        and _plain_1d(responses, "iu")
        and _plain_1d(masks, "iub")
        and _plain_1d(given, "f")
    ):
        return None
    response_lengths = _lengths(responses)
    if not np.array_equal(_lengths(masks), response_lengths):
        return None
    if given:
        with_lp = np.fromiter((lp is not None for lp in logprobs), bool, count=len(logprobs))
        if not np.array_equal(_lengths(given), response_lengths[with_lp]):
            return None
    return prompts, responses, masks, logprobs, bool(given)


_BATCH_ROW_ONLY = frozenset((BatchRow,))


def _arrays_row_by_row(
    rows: Sequence[BatchRow],
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], list[Any], bool]:
    """Gather and check each row's arrays one row at a time, raising for the first bad row."""
    prompts, responses, masks, logprobs = [], [], [], []
    has_logprobs = False
    for i, row in enumerate(rows):
        if not isinstance(row, BatchRow):
            raise InvalidArgumentType(
                f"rows[{i}] is a {type(row).__name__}, not a BatchRow", argument="rows"
            )
        key = _row_key(row, i)
        prompt = _as_1d(row.prompt_ids, key, "prompt_ids", "iu")
        response = _as_1d(row.response_ids, key, "response_ids", "iu")
        mask = _as_1d(row.response_mask, key, "response_mask", "iub")
        if mask.shape[0] != response.shape[0]:
            raise InvalidArgument(
                f"row {key!r}: response_mask length {mask.shape[0]} != response length "
                f"{response.shape[0]}"
            )
        lp = None
        if row.logprobs is not None:
            lp = _as_1d(row.logprobs, key, "logprobs", "f")
            if lp.shape[0] != response.shape[0]:
                raise InvalidArgument(
                    f"row {key!r}: logprobs length {lp.shape[0]} != response length "
                    f"{response.shape[0]}"
                )
            has_logprobs = True
        prompts.append(prompt)
        responses.append(response)
        masks.append(mask)
        logprobs.append(lp)
    return prompts, responses, masks, logprobs, has_logprobs


def _meta_columns(metas: list[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The META columns and ``num_turns``, as raw per-row lists (None / the default if absent).

    When every meta is a dict holding every name (what ``Ledger.batch``'s rows carry), one
    ``itemgetter`` call a row and a ``zip`` transpose in C; otherwise ``get`` per name and row
    (never ``[]`` on another mapping: a ``defaultdict`` would grow the caller's meta).
    """
    if _DICT_ONLY.issuperset(map(type, metas)):
        try:
            transposed = list(zip(*map(_meta_values, metas)))
        except KeyError:
            pass
        else:
            if not transposed:
                return {name: [] for name in _META_NAMES}
            return dict(zip(_META_NAMES, map(list, transposed)))
    return {name: [m.get(name, META_DEFAULTS.get(name)) for m in metas] for name in _META_NAMES}


_DICT_ONLY = frozenset((dict,))


def _collect(rows: Sequence[BatchRow]) -> tuple[_Rows, list[Any]]:
    """Gather and shape-check each row's arrays (and the keys errors name); O(1) work per row."""
    _check_rows_type(rows)
    arrays = _arrays_at_once(rows) if isinstance(rows, Sequence) else None
    if arrays is None:
        arrays = _arrays_row_by_row(rows)
    prompts, responses, masks, logprobs, has_logprobs = arrays
    n = len(rows)
    metas = [row.meta or _NO_META for row in rows]
    meta = _meta_columns(metas)
    keys = [k if k is not None else f"#{i}" for i, k in enumerate(meta["key"])]
    turns = meta.pop("num_turns")
    non_tensor = {name: _plain_column(values) for name, values in meta.items()}
    is_placeholder = np.fromiter(
        map(bool, map(_IS_PLACEHOLDER, rows)), NUMPY_DTYPES["is_placeholder"], count=n
    )
    collected = _Rows(
        prompts=prompts,
        responses=responses,
        response_mask=masks,
        rollout_log_probs=logprobs if has_logprobs else None,
        rm_scores=None,
        rewards=np.fromiter(map(float, map(_REWARD, rows)), NUMPY_DTYPES["rm_scores"], count=n),
        prompt_lengths=_lengths(prompts),
        response_lengths=_lengths(responses),
        is_placeholder=is_placeholder,
        num_turns=_num_turns(turns, is_placeholder, keys),
        non_tensor=non_tensor,
    )
    return collected, keys


_IS_PLACEHOLDER = attrgetter("is_placeholder")
_REWARD = attrgetter("reward")


_INT_ONLY = frozenset((int,))


def _num_turns(values: list[Any], is_placeholder: np.ndarray, keys: list[Any]) -> np.ndarray:
    """Each row's ``meta["num_turns"]``; without one, 0 for a placeholder, else UNKNOWN_TURNS."""
    if _INT_ONLY.issuperset(map(type, values)):  # what queue rows hold: tested at C speed
        turns = np.fromiter(values, NUMPY_DTYPES["num_turns"], count=len(values))
        if not turns.size or turns.min() >= 0:
            return turns
    out = np.where(is_placeholder, 0, UNKNOWN_TURNS).astype(NUMPY_DTYPES["num_turns"])
    for i, value in enumerate(values):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise InvalidArgument(
                f"row {keys[i]!r}: meta num_turns must be an int >= 0, got {value!r}"
            )
        out[i] = value
    return out


@dataclass(frozen=True, slots=True)
class Limits:
    """Per side: the length limit a writer applies, the option it came from, the fixed width.

    A fixed width implies a limit of the same value; with both a width and a ``max_*_length``
    the smaller one binds, and errors name it (the width on a tie).
    """

    prompt: int | None = None
    prompt_option: str = "max_prompt_length"
    response: int | None = None
    response_option: str = "max_response_length"
    prompt_width: int | None = None
    response_width: int | None = None


def _check_count(value: int | None, option: str, least: int, most: int | None = None) -> None:
    try:
        bad = value is not None and (
            isinstance(value, bool)
            or int(value) != value
            or value < least
            or (most is not None and value > most)
        )
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        bad = True
    if bad:
        kind = "a positive int" if least == 1 else f"an int >= {least}"
        if most is not None:
            kind += f" and <= {most}"
        raise InvalidArgument(f"{option} must be {kind} or None, got {value!r}", argument=option)


def _binding(max_length: int | None, width: int | None, side: str) -> tuple[int | None, str]:
    option = f"max_{side}_length"
    if width is not None and (max_length is None or width <= max_length):
        return int(width), f"{side}_width"
    return (None if max_length is None else int(max_length)), option


def limits(
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    prompt_width: int | None = None,
    response_width: int | None = None,
) -> Limits:
    """Check the four options and combine them per side.

    Limits are positive ints; widths may be 0 too (a batch whose rows all have empty prompts is
    0 wide there). None: no limit / as wide as the longest row.
    """
    for value, option, least, most in (
        (max_prompt_length, "max_prompt_length", 1, None),
        (max_response_length, "max_response_length", 1, None),
        # a width is allocated for every row: no wider than a length column holds exactly
        (prompt_width, "prompt_width", 0, MAX_EXACT_LENGTH),
        (response_width, "response_width", 0, MAX_EXACT_LENGTH),
    ):
        _check_count(value, option, least, most)
    prompt, prompt_option = _binding(max_prompt_length, prompt_width, "prompt")
    response, response_option = _binding(max_response_length, response_width, "response")
    return Limits(
        prompt,
        prompt_option,
        response,
        response_option,
        None if prompt_width is None else int(prompt_width),
        None if response_width is None else int(response_width),
    )


def _check_limit(
    keys: list[Any], lengths: np.ndarray, limit: int | None, side: str, option: str
) -> None:
    """Raise BatchTooLongError for the first row over ``limit`` (vectorised test)."""
    if limit is None:
        return
    over = np.flatnonzero(lengths > limit)
    if over.size:
        i = int(over[0])
        raise BatchTooLongError(keys[i], side, int(lengths[i]), limit, option)


def _truncate(rows: _Rows, max_prompt_length: int | None, max_response_length: int | None) -> None:
    """Cut in place, by slicing (views): prompts keep their last tokens, responses their first.

    A row cut to no response has no token for its reward (``_scores`` places none), as an empty row.

    Per-token scores of a batch being re-laid out (``rm_scores`` set) are cut alike, the cut
    tokens' scores added onto the new last token, so each row's score (``rm_scores.sum(-1)``,
    what GRPO reads) is unchanged -- as when rows are built, where the reward moves there.
    """
    if max_prompt_length is not None:
        for i in np.flatnonzero(rows.prompt_lengths > max_prompt_length).tolist():
            prompt = rows.prompts[i]
            rows.prompts[i] = prompt[prompt.shape[0] - max_prompt_length :]
        np.minimum(rows.prompt_lengths, max_prompt_length, out=rows.prompt_lengths)
    if max_response_length is not None:
        cut = slice(None, max_response_length)
        for i in np.flatnonzero(rows.response_lengths > max_response_length).tolist():
            rows.responses[i] = rows.responses[i][cut]
            rows.response_mask[i] = rows.response_mask[i][cut]
            if rows.rollout_log_probs is not None and rows.rollout_log_probs[i] is not None:
                rows.rollout_log_probs[i] = rows.rollout_log_probs[i][cut]
            if rows.rm_scores is not None:
                scores = rows.rm_scores[i]
                kept = scores[cut].copy()
                if kept.size:  # cut to nothing: no token to keep a score on, as for empty rows
                    kept[-1] += scores[max_response_length:].sum(dtype=kept.dtype)
                rows.rm_scores[i] = kept
        np.minimum(rows.response_lengths, max_response_length, out=rows.response_lengths)


def row_keys(rows: _Rows) -> list[Any]:
    """The names errors give rows of a batch being re-laid out: their ``key``, else ``#i``."""
    keys = rows.non_tensor.get("key") or [None] * rows.batch_size
    return [k if k is not None else f"#{i}" for i, k in enumerate(keys)]


def check_batch(batch: object, what: str) -> TensorDictBase:
    """The batch a function was handed, refused before any column is read unless it is one: a
    TensorDict with one batch dimension, as `Ledger.batch` and the builders return."""
    if not isinstance(batch, TensorDictBase):
        raise InvalidArgumentType(
            f"{what} takes a batch (a TensorDict from Ledger.batch or build_padded), "
            f"got {type(batch).__name__}",
            argument="batch",
        )
    if len(batch.batch_size) != 1:
        raise InvalidArgument(
            f"{what}: expected a batch with batch_size [B], got {list(batch.batch_size)}",
            argument="batch",
        )
    return batch


def check_flag(value: object, option: str) -> bool:
    """An on/off option as a bool (`sessions.validation.flag`, the one rule for every option)."""
    return validation.flag(value, option)


def check_token_id(value: object, option: str = "pad_token_id") -> int:
    """A token id option (the padding's) as an int the int64 token columns hold; any such id,
    -1 included (a pad id that is no token)."""
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, np.integer))
        or not -(2**63) <= value < 2**63
    ):
        raise InvalidArgument(
            f"{option} must be an integer the int64 token columns hold, got {value!r}",
            argument=option,
        )
    return int(value)


def apply_limits(rows: _Rows, keys: list[Any], limit: Limits, truncate: bool) -> None:
    """Truncate (by slicing) or refuse (naming the row and the option) rows over a limit."""
    if check_flag(truncate, "truncate"):
        _truncate(rows, limit.prompt, limit.response)
        return
    _check_limit(keys, rows.prompt_lengths, limit.prompt, "prompt", limit.prompt_option)
    _check_limit(keys, rows.response_lengths, limit.response, "response", limit.response_option)


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
        raise InvalidArgument(f"row {keys[row]!r}: response_mask values must be 0 or 1")
    for i in np.flatnonzero(rows.is_placeholder).tolist():
        if rows.response_mask[i].any():
            raise InvalidArgument(f"row {keys[i]!r}: a placeholder must have response_mask all 0")


def check_exact_lengths(lengths: np.ndarray, name: str, keys: list[Any] | None) -> None:
    """Refuse a row longer than a float32 ``prompt_length``/``response_length`` holds exactly."""
    over = np.flatnonzero(lengths > MAX_EXACT_LENGTH)
    if over.size:
        i = int(over[0])
        row = keys[i] if keys is not None and keys[i] is not None else f"#{i}"
        raise InvalidArgument(
            f"row {row!r}: {name} {int(lengths[i])} exceeds {MAX_EXACT_LENGTH} tokens, the longest "
            f"a float32 {name} column holds exactly; cut the row (truncate=True with a "
            f"max_*_length) or split it"
        )


def _rows_from_batch_rows(rows: Sequence[BatchRow], limit: Limits, truncate: bool) -> _Rows:
    """Validate (limits before anything is built), truncate by slicing, check mask values."""
    collected, keys = _collect(rows)
    apply_limits(collected, keys, limit, truncate)
    check_exact_lengths(collected.prompt_lengths, "prompt_length", keys)
    check_exact_lengths(collected.response_lengths, "response_length", keys)
    _check_values(collected, keys)
    return collected
