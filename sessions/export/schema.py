"""The exported columns, declared once: name, type and whether they may be null.

The Parquet schema, the JSONL keys and the table in `docs/export.md` all come from this list (a
test compares the page with it), so a column cannot be added in one place and forgotten in
another. Types are named as strings and mapped to Arrow types lazily: pyarrow is optional.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["COLUMNS", "OPTIONAL_SESSION_COLUMNS", "Column", "arrow_schema", "columns_for"]


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # string | int64 | int32 | float64 | bool | timestamp | list<int32> | list<uint8> | list<float32>
    nullable: bool = True


#: Every column, in file order. Token columns are those of one trajectory (see docs/export.md).
COLUMNS: tuple[Column, ...] = (
    Column("run", "string", False),
    Column("session_id", "string", False),
    Column("uid", "string", False),
    Column("session_index", "int64", False),
    Column("group_size", "int64", False),
    Column("partition", "string", False),
    Column("global_step", "int64"),
    Column("data_source", "string"),
    Column("state", "string", False),
    Column("failure_reason", "string"),
    Column("error_type", "string"),
    Column("message", "string"),
    Column("placeholder", "bool", False),
    Column("reward", "float64"),
    Column("score_source", "string"),
    Column("reward_info", "string", False),
    Column("num_trajectories", "int64", False),
    Column("selected_rows", "int64", False),
    Column("trajectory_index", "int64"),
    Column("selected", "bool"),
    Column("num_turns", "int64"),
    Column("prompt_len", "int64"),
    Column("response_len", "int64"),
    Column("trainable_tokens", "int64"),
    Column("prompt_ids", "list<int32>"),
    Column("response_ids", "list<int32>"),
    Column("response_mask", "list<uint8>"),
    Column("response_logprobs", "list<float32>"),
    Column("created_at", "timestamp", False),
    Column("terminal_at", "timestamp"),
    Column("created_position", "int64", False),
    Column("terminal_position", "int64"),
)

#: Session columns a newer schema revision adds: exported (after `message`) when the database's
#: `sessions` table has them, so one export works before and after that migration.
OPTIONAL_SESSION_COLUMNS: tuple[Column, ...] = (
    Column("attempts", "int64"),
    Column("failure_origin", "string"),
)

#: Added when a tokenizer is given.
TEXT_COLUMNS: tuple[Column, ...] = (
    Column("prompt_text", "string"),
    Column("response_text", "string"),
)

#: Where the optional session columns go: after the failure columns they qualify.
_AFTER = "message"


def columns_for(table_columns: Sequence[str], *, text: bool) -> tuple[Column, ...]:
    """The file's columns for a database whose `sessions` table has `table_columns`."""
    present = set(table_columns)
    extra = tuple(c for c in OPTIONAL_SESSION_COLUMNS if c.name in present)
    out: list[Column] = []
    for col in COLUMNS:
        out.append(col)
        if col.name == _AFTER:
            out.extend(extra)
        if col.name == "response_logprobs" and text:
            out.extend(TEXT_COLUMNS)
    return tuple(out)


def _arrow_type(pa: Any, name: str) -> Any:
    scalar = {
        "string": pa.string(),
        "int64": pa.int64(),
        "int32": pa.int32(),
        "uint8": pa.uint8(),
        "float32": pa.float32(),
        "float64": pa.float64(),
        "bool": pa.bool_(),
        "timestamp": pa.timestamp("us", tz="UTC"),
    }
    if name.startswith("list<"):
        return pa.list_(scalar[name[5:-1]])
    return scalar[name]


def arrow_schema(pa: Any, columns: Sequence[Column]) -> Any:
    return pa.schema(
        [pa.field(c.name, _arrow_type(pa, c.type), nullable=c.nullable) for c in columns]
    )
