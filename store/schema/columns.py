"""What a column can store, derived from the table definitions: the one declaration that
validation at append and the projector's quarantine both check values against.

Where the backends differ, the stricter one wins, so a value accepted on SQLite is accepted on
PostgreSQL too: `Integer` is 32-bit (PostgreSQL's `integer`; SQLite would take 64), `BigInteger`
64-bit, `String(n)` at most n characters (PostgreSQL's `varchar(n)`; SQLite does not check),
text valid UTF-8 without NUL (PostgreSQL refuses both; SQLite's driver refuses lone
surrogates), floats finite (SQLite stores NaN as NULL, PostgreSQL's `jsonb` has no NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, Integer, LargeBinary, String

from store.errors import StoreInvariantError, UnknownColumn
from store.schema.tables import metadata

__all__ = ["INT32", "ColumnSpec", "column_spec"]

INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class ColumnSpec:
    """One column's storable values. `kind`: str, int, float, bool, json, bytes or datetime."""

    name: str
    kind: str
    nullable: bool
    max_length: int | None = None
    int_range: tuple[int, int] | None = None

    def problem(self, value: Any) -> str | None:
        """Why `value` cannot be stored in this column, or None if it can."""
        if value is None:
            return None if self.nullable else "must not be None"
        if self.kind == "str":
            if not isinstance(value, str):
                return f"must be a string, got {type(value).__name__}"
            if self.max_length is not None and len(value) > self.max_length:
                return f"is {len(value)} characters long, more than the {self.max_length} the column stores"
            return _text_problem(value)
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                return f"must be an integer, got {type(value).__name__}"
            low, high = self.int_range or _INT64
            if not low <= value <= high:
                return f"{value} is outside the column's integer range [{low}, {high}]"
            return None
        if self.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"must be a number, got {type(value).__name__}"
            try:
                number = float(value)
            except OverflowError:
                return f"{value} is too large for a float"
            return None if math.isfinite(number) else f"must be finite, got {number}"
        if self.kind == "bool":
            return (
                None
                if isinstance(value, bool)
                else f"must be True or False, got {type(value).__name__}"
            )
        if self.kind == "json":
            return _json_problem(value)
        return None


def _text_problem(value: str) -> str | None:
    """Why a string cannot be stored as text on both backends, or None."""
    if "\x00" in value:
        return "contains a NUL character, which PostgreSQL cannot store"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"is not valid UTF-8 (a lone surrogate at character {error.start})"
    return None


def _json_problem(value: Any) -> str | None:
    """Why a value cannot be stored as JSON on both backends (jsonb too), or None."""
    if value is None or isinstance(value, (bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"holds {value}, which JSON cannot store"
    if isinstance(value, str):
        return _text_problem(value)
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"has a key of type {type(key).__name__}; JSON keys are strings"
            problem = _text_problem(key) or _json_problem(item)
            if problem is not None:
                return (
                    f"[{key!r}] {problem}" if not problem.startswith("[") else f"[{key!r}]{problem}"
                )
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            problem = _json_problem(item)
            if problem is not None:
                return (
                    f"[{index}] {problem}" if not problem.startswith("[") else f"[{index}]{problem}"
                )
        return None
    return f"holds a {type(value).__name__}, which is not JSON"


def _spec(table: str, column: Any) -> ColumnSpec:
    name = f"{table}.{column.name}"
    kind_of = column.type
    if isinstance(kind_of, JSON):
        return ColumnSpec(name, "json", column.nullable)
    if isinstance(kind_of, Boolean):
        return ColumnSpec(name, "bool", column.nullable)
    if isinstance(kind_of, BigInteger):
        return ColumnSpec(name, "int", column.nullable, int_range=_INT64)
    if isinstance(kind_of, Integer):
        return ColumnSpec(name, "int", column.nullable, int_range=INT32)
    if isinstance(kind_of, Float):
        return ColumnSpec(name, "float", column.nullable)
    if isinstance(kind_of, String):
        return ColumnSpec(name, "str", column.nullable, max_length=kind_of.length)
    if isinstance(kind_of, LargeBinary):
        return ColumnSpec(name, "bytes", column.nullable)
    if isinstance(kind_of, DateTime):
        return ColumnSpec(name, "datetime", column.nullable)
    raise StoreInvariantError(  # pragma: no cover - every column type of tables.py has a rule
        f"column {name}: no storable-value rule for {kind_of!r}; add one to store/schema/columns.py"
    )


def _all_specs() -> dict[str, ColumnSpec]:
    out = {}
    for table in metadata.tables.values():
        for column in table.columns:
            impl = column.type
            variant = getattr(
                impl, "impl", impl
            )  # with_variant() keeps the generic type as its impl
            spec = _spec(table.name, column if variant is impl else column.copy(type_=variant))
            out[spec.name] = spec
    return out


_SPECS = _all_specs()


def column_spec(name: str) -> ColumnSpec:
    """The spec of `table.column`, e.g. `column_spec("sessions.uid")`."""
    try:
        return _SPECS[name]
    except KeyError:
        raise UnknownColumn(f"no column {name!r}; known: {', '.join(sorted(_SPECS))}") from None
