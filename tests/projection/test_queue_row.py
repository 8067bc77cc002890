"""The queue rows the rules make and the queue table hold the same columns, from one list
(`sessions.projection.queue_row.COLUMNS`): a column the table gains that no builder fills, or one a
builder fills that the table lacks, fails here rather than at the projector's first write."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from sessions.projection.queue_row import COLUMNS, batch_row, group_tag
from store.schema.tables import queue_rows

#: Numbered by the rules as they queue a row (`Rules._queue`), not made by a builder.
NUMBERED = "id"

SESSION = {
    "run": "r",
    "partition": "train",
    "global_step": 3,
    "uid": "u",
    "session_id": "s",
    "session_index": 1,
    "data_source": None,
}
GROUP = {**SESSION, "status": "finished"}


def test_the_list_is_the_tables_columns() -> None:
    table = [column.name for column in queue_rows.columns]
    assert len(COLUMNS) == len(set(COLUMNS))
    assert set(table) - {NUMBERED} == set(COLUMNS), (
        f"the table has {sorted(set(table) - {NUMBERED} - set(COLUMNS))} beside the list, the list "
        f"{sorted(set(COLUMNS) - set(table))} beside the table"
    )


@given(
    placeholder=st.booleans(),
    partial=st.booleans(),
    reason=st.one_of(st.none(), st.text(max_size=4)),
    materialization=st.one_of(st.none(), st.text(max_size=4)),
    step=st.one_of(st.none(), st.integers(0, 2**40)),
)
def test_both_builders_make_exactly_the_listed_columns(
    placeholder: bool, partial: bool, reason: Any, materialization: Any, step: Any
) -> None:
    session = {**SESSION, "global_step": step}
    row = batch_row(
        session,
        7,
        0,
        5,
        1.0,
        placeholder=placeholder,
        partial=partial,
        failure_reason=reason,
        materialization=materialization,
        num_turns=2,
        lengths=(3, 4),
    )
    tag = group_tag({**GROUP, "global_step": step}, 8)
    assert list(row) == list(COLUMNS), "batch_row's columns differ from the list"
    assert set(tag) == set(COLUMNS), "group_tag's columns differ from the list"
    assert tag["kind"] == "tag" and tag["key"] == "u" and tag["is_placeholder"] is False
    assert tag["session_id"] is None and tag["num_turns"] is None and tag["tags"]["is_prompt"]
