"""Each row's `reward_info` as batch columns, every key on every row (verl's `reward_extra_info`).

verl's validation builds one list per key over a step's rows and fails when a row lacks a key its
siblings carry; a placeholder (a failed session) never posted the verifier's keys. So a batch's
reward-info columns are the union of its rows' keys, and a row without a key gets the
documented default for that key's values: 0.0 when they are numbers (a failure scores zero, as
its reward), False when they are booleans, "" when they are strings, else None.
`reward` and `finished` are the ledger's own (`rm_scores` holds the reward; a placeholder's
`finished` is forced False) and never become columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sessions.errors import InvalidArgument

__all__ = ["RESERVED", "add_reward_info", "default_for", "reward_info_columns"]

RESERVED = frozenset({"reward", "finished"})


def default_for(values: Sequence[Any]) -> Any:
    """The value a row lacking the key gets, from the values its siblings carry."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return False
    if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return 0.0
    if present and all(isinstance(v, str) for v in present):
        return ""
    return None


def reward_info_columns(infos: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """One list per key (sorted by name), a value per row: the row's own or the key's default."""
    keys = sorted({key for info in infos for key in info} - RESERVED)
    columns: dict[str, list[Any]] = {}
    for key in keys:
        default = default_for([info[key] for info in infos if key in info])
        columns[key] = [info.get(key, default) for info in infos]
    return columns


def add_reward_info(batch: Any, infos: Sequence[Mapping[str, Any]]) -> list[str]:
    """Add `reward_info_columns(infos)` to `batch` as non-tensor columns; returns their names. A
    key that would shadow one of the batch's own columns is refused (rename it where it is posted)."""
    from sessions.batches.non_tensor_stacks import set_non_tensor_columns

    columns = reward_info_columns(infos)
    taken = set(batch.keys())
    for key in columns:
        if key in taken:
            raise InvalidArgument(
                f"reward_info key {key!r} would shadow the batch's own {key!r} column; post it under another name "
                "(or build the batch without reward_info=True)"
            )
    set_non_tensor_columns(batch, columns)
    return list(columns)
