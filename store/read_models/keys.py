"""The read models' names and keys, and the small helpers every query of them uses.

`store` never imports `sessions`: these are table facts (the projector's checkpoint name, the
natural key of `groups`, a metric scope), not domain rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

#: Bound parameters per IN (...) list.
CHUNK = 500
#: The projector's row in `checkpoints`.
PROJECTOR = "projector"
#: The natural key of `groups` (unique index `uq_groups_key`).
GROUP_KEY = ("run", "partition", "global_step", "uid")

#: (run, partition, global_step, data_source): where a metric count belongs.
MetricScope = tuple[str, str, "int | None", "str | None"]


def chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    """`items` in slices of at most `CHUNK`, one IN list each."""
    for start in range(0, len(items), CHUNK):
        yield items[start : start + CHUNK]


def equals(column: Any, value: Any) -> Any:
    """`column = value`, or `column IS NULL` when value is None (`= NULL` is never true).

    Not `IS NOT DISTINCT FROM`: PostgreSQL cannot use a b-tree index for that.
    """
    return column.is_(None) if value is None else column == value


def as_utc(value: datetime) -> datetime:
    """An aware UTC datetime (SQLite hands back naive ones; we only ever write UTC)."""
    return (
        value.replace(tzinfo=timezone.utc)
        if value.tzinfo is None
        else value.astimezone(timezone.utc)
    )
