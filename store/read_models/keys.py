"""The read models' names and keys, and the small helpers every query of them uses.

`store` never imports `sessions`: these are table facts (the projector's checkpoint name, the
natural key of `groups`, a metric scope), not domain rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func, literal_column

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


def step_equals(column: Any, step: int | None) -> Any:
    """`coalesce(global_step, -1) = step` (-1 for None), -1 as SQL text: the very expression the
    natural-key indexes declare (`store.schema.tables.step_key`), so the planner can use the key
    past the step. `global_step = ?` cannot be matched to it, and every step was read (issue 28)."""
    return func.coalesce(column, literal_column("-1")) == (-1 if step is None else step)


def as_utc(value: datetime) -> datetime:
    """An aware UTC datetime (SQLite hands back naive ones; we only ever write UTC)."""
    return (
        value.replace(tzinfo=timezone.utc)
        if value.tzinfo is None
        else value.astimezone(timezone.utc)
    )
