"""Reading rows back out of TransferQueue, padded in verl's layout (docs/design.md §6).

``kv_batch_get`` returns 2-D fields as jagged nested tensors; callers want what ``Ledger.batch``
gives, so the section 6 columns go through ``sessions.batches.densify`` and only the columns it
does not know (uni-agent's ``loss_mask``, a trainer's own) are padded here. torch is imported on
first use, so importing the adapter stays cheap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sessions.errors import InvalidArgument, InvalidArgumentType, NotFound
from sessions.integrations.transferqueue.runtime import import_transfer_queue

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase

__all__ = ["aread_rows", "list_partition", "read_rows", "row_keys", "to_padded"]


def read_rows(partition_id: str, keys: Sequence[str], *, pad_token_id: int = 0) -> TensorDict:
    """``kv_batch_get`` the keys' rows and return them padded (docs/design.md §6), in ``keys`` order.

    Blocking (TransferQueue's own client thread does the I/O); use ``aread_rows`` in a coroutine.
    """
    keys = list(keys)
    if not keys:
        return _empty_batch(pad_token_id)
    raw = import_transfer_queue().kv_batch_get(keys=keys, partition_id=partition_id)
    return to_padded(raw, pad_token_id=pad_token_id, keys=keys)


async def aread_rows(
    partition_id: str, keys: Sequence[str], *, pad_token_id: int = 0
) -> TensorDict:
    """``async_kv_batch_get`` counterpart of ``read_rows``."""
    keys = list(keys)
    if not keys:
        return _empty_batch(pad_token_id)
    raw = await import_transfer_queue().async_kv_batch_get(keys=keys, partition_id=partition_id)
    return to_padded(raw, pad_token_id=pad_token_id, keys=keys)


def _empty_batch(pad_token_id: int) -> TensorDict:
    from sessions.batches import build_padded

    return build_padded([], pad_token_id=pad_token_id)


def to_padded(
    raw: TensorDictBase, *, pad_token_id: int = 0, keys: Sequence[str] | None = None
) -> TensorDict:
    """What ``kv_batch_get`` returns (jagged nested tensors) -> a padded batch with the original dtypes.

    Section 6 columns go through ``sessions.batches.densify`` (prompts left-padded, responses
    right-padded, ``input_ids`` / ``attention_mask`` / ``position_ids`` re-derived). Other jagged
    columns are padded with 0 to the side they align with (response length: right-padded to the
    responses' width, like ``loss_mask``; sequence length: like ``input_ids``; prompt length:
    left-padded); dense and non-tensor columns pass through. With ``keys`` and a ``key`` column,
    rows are returned in ``keys`` order.
    """
    import torch
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    from sessions.batches import COLUMN_DTYPES, LAYOUT_COLUMNS, densify, non_tensor
    from sessions.batches.flat import lengths_as_index
    from sessions.batches.jagged import jagged_from_parts

    batch_size = int(raw.batch_size[0]) if raw.batch_size else 0
    core: dict[str, Any] = {}
    extra: dict[str, torch.Tensor] = {}
    lists: dict[str, list[Any]] = {}
    for name in raw.keys():
        value = raw.get(name)
        if isinstance(value, (NonTensorStack, NonTensorData)):
            lists[name] = non_tensor(raw, name)
        elif name in LAYOUT_COLUMNS:
            core[name] = value
        elif isinstance(value, torch.Tensor):
            extra[name] = value
        else:
            raise InvalidArgumentType(
                f"column {name!r}: unsupported entry of type {type(value).__name__}"
            )
    if "prompts" not in core or "responses" not in core:
        raise InvalidArgument(
            f"not a row batch: columns {sorted(raw.keys())} lack prompts/responses"
        )
    placeholder_dtype = COLUMN_DTYPES["is_placeholder"]
    core.setdefault("is_placeholder", torch.zeros(batch_size, dtype=placeholder_dtype))
    core["is_placeholder"] = core["is_placeholder"].to(placeholder_dtype)
    for name in (
        "response_mask",
        "rm_scores",
    ):  # rows from writers without them: all-ones mask, no reward
        if name not in core:
            values = core["responses"].values()
            fill = (
                torch.ones_like(values)
                if name == "response_mask"
                else torch.zeros(values.shape[0], dtype=COLUMN_DTYPES[name])
            )
            core[name] = jagged_from_parts(fill, core["responses"].offsets())
    jagged = TensorDict(core, batch_size=[batch_size])
    for name, values in lists.items():
        jagged.set(name, NonTensorStack.from_list(list(values)))
    dense = densify(jagged, pad_token_id=pad_token_id)
    widths = (dense.get("prompts").shape[1], dense.get("responses").shape[1])
    lengths = tuple(lengths_as_index(dense.get(n), n) for n in ("prompt_length", "response_length"))
    for name, value in extra.items():
        dense.set(name, _pad_extra(value, lengths, widths))
    if keys is not None and "key" in lists:
        got = lists["key"]
        if got != list(keys):
            index = {k: i for i, k in enumerate(got)}
            missing = [k for k in keys if k not in index]
            if missing:
                raise NotFound(f"TransferQueue returned no rows for keys {missing[:5]}")
            dense = dense[torch.tensor([index[k] for k in keys], dtype=torch.long)]
    return dense


def _pad_extra(value: Any, lengths: tuple[Any, ...], widths: tuple[int, int]) -> Any:
    """Pad one extra column to the side it aligns with (see ``to_padded``); 0 fills the padding."""
    import torch

    from sessions.batches.jagged import jagged_parts, row_ids_and_positions

    if not value.is_nested:
        return value
    if value.layout != torch.jagged:
        return torch.nested.to_padded_tensor(value, 0)
    values, offsets = jagged_parts(value)
    row_lengths = offsets.diff()
    p_len, r_len = lengths
    P, R = widths
    if torch.equal(row_lengths, r_len):  # response side: right-padded to the responses' width
        width, shift = R, torch.zeros_like(r_len)
    elif torch.equal(row_lengths, p_len + r_len):  # [prompt | response], like input_ids
        width, shift = P + R, P - p_len
    elif torch.equal(row_lengths, p_len):  # prompt side: left-padded
        width, shift = P, P - p_len
    else:  # aligned with neither: right-padded to its own longest row
        width, shift = (
            (int(row_lengths.max()) if row_lengths.numel() else 0),
            torch.zeros_like(row_lengths),
        )
    rows, positions = row_ids_and_positions(row_lengths)
    out = values.new_zeros((row_lengths.numel(), width, *values.shape[1:]))
    out[rows, shift[rows] + positions] = values
    return out


def list_partition(partition_id: str) -> dict[str, dict[str, Any]]:
    """``kv_list(partition_id)`` -> ``{key: tags}`` of that partition (empty if it does not exist)."""
    return dict(import_transfer_queue().kv_list(partition_id=partition_id).get(partition_id, {}))


def row_keys(listing: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The row keys (not group tags) of a ``list_partition`` result, in listing order."""
    return [key for key, tags in listing.items() if not tags.get("is_prompt")]
