"""Row selection, concatenation and splitting of batches, in either layout, on every tensordict.

``batch[index]``, ``torch.cat`` and ``batch.split`` work on padded batches with every tensordict
this package supports, and on jagged batches with tensordict 0.15.3; with 0.10.0 (verl 0.9.1's
pin) they fail on jagged batches and on any selection of no rows (``tensordict_compat``). These
functions do the same on every version and layout, written against plain tensors: dense
columns are indexed, jagged ones re-gathered from their values and offsets (columns that shared
offsets share the new ones, and each result carries its ``min_seqlen``/``max_seqlen``, so
``to_padded_tensor`` stays as wide as the longest row), non-tensor columns follow as lists.
Results equal tensordict 0.15.3's own where it has them (tested), except that ``select_rows``
with an int returns a batch of one row, not a 0-d row view.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from sessions.batches.collect import check_batch
from sessions.batches.jagged import (
    is_jagged,
    jagged_from_parts,
    jagged_parts,
    row_ids_and_positions,
    seqlen_bounds,
)
from sessions.batches.non_tensor_stacks import non_tensor, set_non_tensor_columns
from sessions.errors import InvalidArgument, InvalidArgumentType, RowIndexError

__all__ = ["concat_batches", "select_rows", "split_batch"]

_RowIndex = int | slice | Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor


def _batch_rows(batch: TensorDictBase, what: str) -> int:
    return int(check_batch(batch, what).batch_size[0])


def _row_ids(index: _RowIndex, n: int) -> torch.Tensor:
    """Any supported index -> int64 row ids in [0, n), in the order they select rows."""
    if isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_)):
        if not -n <= int(index) < n:
            raise RowIndexError(f"row {int(index)} out of range for a batch of {n} rows")
        return torch.tensor([int(index) % n], dtype=torch.int64)
    if isinstance(index, slice):
        return torch.tensor(range(n)[index], dtype=torch.int64)
    try:
        ids = index if isinstance(index, torch.Tensor) else torch.as_tensor(np.asarray(index))
    except (TypeError, ValueError, RuntimeError) as error:
        raise RowIndexError(
            f"a row index is an int, a slice, a boolean mask or integer row ids, got {index!r}"
        ) from error
    if ids.dim() != 1:
        raise RowIndexError(f"a row index must be 1-D, got shape {list(ids.shape)}")
    if ids.dtype == torch.bool:
        if ids.numel() != n:
            raise RowIndexError(f"a boolean row mask must have {n} entries, got {ids.numel()}")
        return ids.nonzero().flatten()
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    if ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise RowIndexError(f"row indices must be integers or booleans, got {ids.dtype}")
    ids = ids.to(torch.int64)
    bad = (ids < -n) | (ids >= n)
    if bool(bad.any()):
        raise RowIndexError(f"row {int(ids[bad][0])} out of range for a batch of {n} rows")
    return torch.where(ids < 0, ids + n, ids)


def _columns(batch: TensorDictBase) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
    """Tensor and non-tensor columns, in key order; refuses sub-TensorDicts."""
    tensors: dict[str, torch.Tensor] = {}
    lists: dict[str, list[Any]] = {}
    for key in batch.keys():
        value = batch.get(key)
        if isinstance(value, (NonTensorStack, NonTensorData)):
            lists[key] = non_tensor(batch, key)
        elif isinstance(value, torch.Tensor):
            if value.is_nested and not is_jagged(value):
                raise InvalidArgumentType(
                    f"column {key!r}: only torch.jagged nested tensors are supported"
                )
            tensors[key] = value
        else:
            raise InvalidArgumentType(
                f"column {key!r}: unsupported entry of type {type(value).__name__}"
            )
    return tensors, lists


def _structure_key(value: torch.Tensor) -> tuple[int, int]:
    """Identifies the offsets (and lengths) a jagged column shares with others in its batch."""
    return id(value.offsets()), id(value.lengths())


def _gather_jagged(
    value: torch.Tensor, rows: torch.Tensor, cache: dict[Any, tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """The jagged column's selected rows, copied; columns sharing offsets share the result's."""
    values, offsets = jagged_parts(value)
    key = _structure_key(value)
    if key not in cache:
        lengths = offsets.diff()[rows]
        row_ids, positions = row_ids_and_positions(lengths)
        tokens = offsets[:-1][rows][row_ids] + positions
        new_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        cache[key] = (tokens, new_offsets)
    tokens, new_offsets = cache[key]
    return jagged_from_parts(values[tokens], new_offsets, bounds=seqlen_bounds(new_offsets))


def _new_batch(
    tensors: dict[str, torch.Tensor], lists: dict[str, list[Any]], rows: int, like: TensorDictBase
) -> TensorDict:
    out = TensorDict(tensors, batch_size=[rows], device=like.device)
    set_non_tensor_columns(out, lists)
    return out


def select_rows(batch: TensorDictBase, index: _RowIndex) -> TensorDict:
    """The rows ``index`` selects, as a new batch of the same layout and columns.

    ``index``: an int (a batch of that one row), a slice, a boolean mask of B entries, or
    integer row ids (tensor, array or list; negatives count from the end, repeats repeat).
    Every column follows, non-tensor ones included; jagged columns are copied, not viewed.
    """
    n = _batch_rows(batch, "select_rows")
    rows = _row_ids(index, n)
    tensors, lists = _columns(batch)
    cache: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
    picked = {
        key: _gather_jagged(value, rows, cache) if is_jagged(value) else value.index_select(0, rows)
        for key, value in tensors.items()
    }
    ids = rows.tolist()
    return _new_batch(picked, {k: [v[i] for i in ids] for k, v in lists.items()}, len(ids), batch)


def _cat_jagged(
    name: str, values: list[torch.Tensor], cache: dict[Any, torch.Tensor]
) -> torch.Tensor:
    parts = [jagged_parts(v) for v in values]
    if len({p[0].shape[1:] for p in parts}) > 1:
        raise InvalidArgument(f"column {name!r}: inner shapes differ between the batches")
    key = tuple(_structure_key(v) for v in values)
    if key not in cache:
        starts = np.cumsum([0] + [int(o[-1]) for _, o in parts[:-1]])
        pieces = [torch.zeros(1, dtype=torch.int64)]
        pieces += [o[1:] + int(s) for (_, o), s in zip(parts, starts)]
        cache[key] = torch.cat(pieces)
    offsets = cache[key]
    flat = torch.cat([p[0] for p in parts])
    return jagged_from_parts(flat, offsets, bounds=seqlen_bounds(offsets))


def concat_batches(batches: Sequence[TensorDictBase]) -> TensorDict:
    """Batches with the same columns (and, padded, the same widths) -> one, rows in order.

    ``torch.cat`` for batches, on every layout and tensordict version. Batches of different
    widths or columns: ``concat_padded`` (re-pads) or ``pad_to_widths`` first.
    """
    if isinstance(batches, TensorDictBase) or not isinstance(batches, Sequence):
        raise InvalidArgumentType(
            f"concat_batches takes a list of batches, got {type(batches).__name__}",
            argument="batches",
        )
    if not batches:
        raise InvalidArgument(
            "concat_batches needs at least one batch (build_padded([]) makes an empty one)"
        )
    for b in batches:
        check_batch(b, "concat_batches")
    split = [_columns(b) for b in batches]
    tensors0, lists0 = split[0]
    for i, (tensors, lists) in enumerate(split[1:], start=1):
        if set(tensors) != set(tensors0) or set(lists) != set(lists0):
            differ = sorted((set(tensors) | set(lists)) ^ (set(tensors0) | set(lists0)))
            raise InvalidArgument(
                f"batch {i} has other columns than batch 0 (differing: {differ}); "
                "concat_padded fills missing logprobs and non-tensor columns"
            )
    cache: dict[Any, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key in tensors0:
        values = [tensors[key] for tensors, _ in split]
        jagged = [is_jagged(v) for v in values]
        if any(jagged) and not all(jagged):
            raise InvalidArgument(f"column {key!r} is jagged in some batches and dense in others")
        if all(jagged):
            out[key] = _cat_jagged(key, values, cache)
            continue
        shapes = {tuple(v.shape[1:]) for v in values}
        if len(shapes) > 1:
            raise InvalidArgument(
                f"column {key!r}: widths differ between the batches ({sorted(shapes)}); "
                "concat_padded re-pads them, pad_to_widths gives batches equal widths"
            )
        out[key] = torch.cat(values)
    lists = {key: [v for _, batch_lists in split for v in batch_lists[key]] for key in lists0}
    rows = sum(_batch_rows(b, "concat_batches") for b in batches)
    return _new_batch(out, lists, rows, batches[0])


def split_batch(batch: TensorDictBase, split_size: int | Sequence[int]) -> tuple[TensorDict, ...]:
    """``batch.split(split_size)`` on every layout and version: consecutive row chunks.

    An int gives chunks of that many rows (the last may be shorter; a batch of 0 rows gives one
    empty chunk, as ``torch.split`` does); a sequence gives chunks of those sizes, which must add
    up to the batch's rows. A chunk of 0 rows is a proper empty batch (tensordict 0.15.3's own
    split makes its non-tensor columns ``LazyStackedTensorDict``s, which are no columns at all).
    """
    n = _batch_rows(batch, "split_batch")
    if isinstance(split_size, (int, np.integer)) and not isinstance(split_size, bool):
        if split_size < 1:
            raise InvalidArgument(f"split_size must be >= 1, got {split_size}")
        bounds = list(range(0, n, int(split_size))) or [0]
        sizes = [min(int(split_size), n - start) for start in bounds]
    else:
        if not isinstance(split_size, Sequence) or not all(
            isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in split_size
        ):
            raise InvalidArgumentType(
                f"split_size must be an int or a list of ints, got {split_size!r}",
                argument="split_size",
            )
        sizes = [int(s) for s in split_size]
        if any(s < 0 for s in sizes) or sum(sizes) != n:
            raise InvalidArgument(
                f"split sizes {sizes} must be >= 0 and add up to the batch's {n} rows"
            )
    starts = np.cumsum([0] + sizes[:-1]).tolist()
    return tuple(select_rows(batch, slice(a, a + s)) for a, s in zip(starts, sizes))
