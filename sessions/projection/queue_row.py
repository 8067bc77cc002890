"""A batch row as the queue stores it: the projected row of a trajectory or a placeholder.

Its key is `{uid}_{session_index}_{i}` and its tags are TransferQueue's (docs/design.md §7); the
rules (`sessions.projection.rules`) decide what goes in, this module only lays it out.
"""

from __future__ import annotations

from sessions.projection.working_set import Row

__all__ = ["COLUMNS", "batch_row", "group_tag"]

#: The queue table's columns as the rules fill them, declared once: `batch_row` and `group_tag`
#: make exactly these, and `tests/projection/test_queue_row.py` holds the table
#: (`store/schema/tables.py`) to them. `id` is left out: the rules number a row as they queue it.
COLUMNS: tuple[str, ...] = (
    "run",
    "partition",
    "global_step",
    "key",
    "kind",
    "uid",
    "session_id",
    "session_index",
    "data_source",
    "source_position",
    "reward",
    "is_placeholder",
    "is_partial",
    "failure_reason",
    "materialization_reason",
    "num_turns",
    "prompt_len",
    "response_len",
    "tags",
    "produced_position",
    "min_global_steps",
    "max_global_steps",
)
#: What a group tag holds in the columns of a batch row: nothing, and it is no placeholder.
_TAG_BASE: Row = {**dict.fromkeys(COLUMNS), "is_placeholder": False, "is_partial": False}


def batch_row(
    s: Row,
    position: int,
    key_index: int,
    source_position: int,
    reward: float,
    *,
    placeholder: bool,
    partial: bool,
    failure_reason: str | None,
    materialization: str | None,
    num_turns: int,
    lengths: tuple[int, int],
    versions: tuple[int | None, int | None] = (None, None),
) -> Row:
    """The queue row of session `s`'s row `key_index`, produced at log `position`."""
    prompt_len, response_len = lengths
    uid, step = s["uid"], s["global_step"]
    return {
        "run": s["run"],
        "partition": s["partition"],
        "global_step": step,
        "key": f"{uid}_{s['session_index']}_{key_index}",
        "kind": "row",
        "uid": uid,
        "session_id": s["session_id"],
        "session_index": s["session_index"],
        "data_source": s["data_source"],
        "source_position": source_position,
        "reward": reward,
        "is_placeholder": placeholder,
        "is_partial": partial,
        "failure_reason": failure_reason,
        "materialization_reason": materialization,
        "num_turns": num_turns,
        "prompt_len": prompt_len,
        "response_len": response_len,
        "tags": {
            "status": "finished",
            "global_steps": step,
            "prompt_len": prompt_len,
            "response_len": response_len,
            "seq_len": prompt_len + response_len,
            "uid": uid,
            "materialization_reason": materialization,
            "is_placeholder": placeholder,
            **({"is_partial": True} if partial else {}),
        },
        "produced_position": position,
        "min_global_steps": versions[0],
        "max_global_steps": versions[1],
    }


def group_tag(group: Row, position: int) -> Row:
    """The queue row that tags a settled group (`finished` or `failure`), after its rows: the
    group's key columns, its tags; no row's columns."""
    return {
        **_TAG_BASE,
        "run": group["run"],
        "partition": group["partition"],
        "global_step": group["global_step"],
        "key": group["uid"],
        "kind": "tag",
        "uid": group["uid"],
        "data_source": group["data_source"],
        "tags": {
            "is_prompt": True,
            "status": group["status"],
            "global_steps": group["global_step"],
        },
        "produced_position": position,
    }
