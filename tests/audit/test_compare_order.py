"""The audit's in-memory side of the read-model compare comes in the order SQLite scans give.

`read_model_diff.compare_rows` sorts the rebuilt rows in Python and merges them with the stored
table read `ORDER BY` its natural key; a row sorted elsewhere than SQLite puts it would show up
as one row missing and one extra. Keys mix NULLs (a metric row's data source, an ad-hoc
validation step), integers and any text.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sessions.audit import read_model_diff

_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=4)
_ROW = st.tuples(
    st.sampled_from(["run", "rün", "r"]),
    st.none() | st.integers(-3, 3),
    st.none() | _TEXT,
    _TEXT,
    st.integers(-(2**63), 2**63 - 1),
)


def _sqlite_order(rows: list[tuple[Any, ...]], order: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("CREATE TABLE t (a TEXT, b INTEGER, c TEXT, d TEXT, e INTEGER)")
        conn.executemany("INSERT INTO t VALUES (?, ?, ?, ?, ?)", rows)
        return conn.execute(f"SELECT * FROM t ORDER BY {order}").fetchall()
    finally:
        conn.close()


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(_ROW, max_size=30, unique_by=lambda r: r[:4]))
def test_rows_sort_as_sqlite_orders_them(rows: list[tuple[Any, ...]]) -> None:
    assert read_model_diff._sorted(rows, (0, 1, 2, 3)) == _sqlite_order(rows, "a, b, c, d")


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(_ROW, max_size=30, unique_by=lambda r: r[3]))
def test_rows_sort_on_a_single_key_as_sqlite_orders_them(rows: list[tuple[Any, ...]]) -> None:
    assert read_model_diff._sorted(rows, (3,)) == _sqlite_order(rows, "d")
