"""Batch <-> dict of plain tensors and lists, safe for ``torch.load(weights_only=True)``.

What ``rollout-ledger export`` writes with ``torch.save``: a file any consumer can load without
this package or tensordict.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from tensordict import TensorDict, TensorDictBase

from sessions.batches.collect import check_batch
from sessions.batches.flat import _length_column, _split_columns, lengths_as_index
from sessions.batches.jagged import is_jagged, jagged_from_parts, jagged_parts
from sessions.batches.non_tensor_stacks import set_non_tensor_columns
from sessions.errors import InvalidArgumentType

__all__ = ["from_plain_dict", "to_plain_dict"]

#: separator of the plain-dict keys of jagged columns: ``"prompts.values"``, ``"prompts.offsets"``
_VALUES_SUFFIX = ".values"
_OFFSETS_SUFFIX = ".offsets"

#: per-row lengths, float32 since docs/design.md §6 said so; older files hold int64
_LENGTH_COLUMNS = frozenset({"prompt_length", "response_length"})

#: the value types a non-tensor column may hold to stay weights_only-loadable
_PLAIN_SCALARS = (type(None), bool, int, float, str)


def _loadable(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` gives ``value`` back: plain scalars, and dicts
    (str keys) / lists / tuples of them or of tensors -- ``multi_modal_inputs`` is a dict a row."""
    if isinstance(value, _PLAIN_SCALARS):
        return True
    if isinstance(value, dict):
        return all(
            type(k) is str and (_loadable(v) or isinstance(v, torch.Tensor))
            for k, v in value.items()
        )
    if isinstance(value, (list, tuple)):
        return all(_loadable(v) or isinstance(v, torch.Tensor) for v in value)
    return False


def _check_plain(name: str, values: list[Any]) -> None:
    if all(type(v) in _PLAIN_SCALARS for v in values):  # the usual case, tested at C speed
        return
    for v in values:
        if not _loadable(v):
            raise InvalidArgumentType(
                f"non-tensor column {name!r} holds a {type(v).__name__}; only None/bool/int/"
                "float/str, and dicts (str keys) or lists of them or of tensors, survive "
                "torch.load(weights_only=True)"
            )


def to_plain_dict(batch: TensorDictBase) -> dict[str, Any]:
    """Batch -> dict of tensors and lists, loadable with ``torch.load(weights_only=True)``.

    Dense tensor columns keep their key. A jagged column ``c`` becomes two tensors,
    ``"c.values"`` (all rows' tokens concatenated) and ``"c.offsets"`` (int64 [B+1], row i is
    ``values[offsets[i]:offsets[i+1]]``). Non-tensor columns become Python lists of length B
    (``multi_modal_inputs``: a list of dicts, which ``weights_only`` loads too).
    ``from_plain_dict`` inverts it. Plain values/offsets rather than pickled nested tensors:
    readable by any consumer (numpy, other torch versions) without nested-tensor internals
    (torch 2.13 does load jagged tensors with ``weights_only=True``; that is not a stable promise).
    """
    tensors, non_tensors = _split_columns(check_batch(batch, "to_plain_dict"))
    plain: dict[str, Any] = {}
    for key, value in tensors.items():
        if is_jagged(value):
            values, offsets = jagged_parts(value)
            plain[key + _VALUES_SUFFIX] = values.clone()
            plain[key + _OFFSETS_SUFFIX] = offsets.clone()
        elif value.is_nested:
            raise InvalidArgumentType(
                f"column {key!r}: only torch.jagged nested tensors are supported"
            )
        else:
            plain[key] = value.clone()
    for key, values in non_tensors.items():
        _check_plain(key, values)
        plain[key] = [dict(v) if type(v) is dict else v for v in values]  # not the batch's dicts
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
    """Inverse of ``to_plain_dict``; jagged columns sharing row lengths share one offsets tensor.

    int64 ``prompt_length``/``response_length`` (files written before they became float32) come
    back as float32, so an old export still feeds verl's metrics.
    """
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
            columns[name] = jagged_from_parts(value, offsets)
        elif key in _LENGTH_COLUMNS and isinstance(value, torch.Tensor):
            columns[key] = _length_column(lengths_as_index(value, key).numpy(), key, None)
        elif isinstance(value, torch.Tensor):
            columns[key] = value
        else:
            lists[key] = list(value)
    batch = TensorDict(columns, batch_size=[_plain_batch_size(plain)])
    set_non_tensor_columns(batch, lists)
    return batch
