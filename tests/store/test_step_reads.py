"""Batch ready when the step ends: the read-model writes and reads the last pages and
`ledger.batch` pay for stay indexed and linear in what they touch."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.dialects import sqlite

from store import create_engine
from store import read_models as rm
from store.schema.migrate import upgrade


async def _migrated(tmp_path: Path) -> Path:
    path = tmp_path / "plan.db"
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()
    return path


async def test_group_update_finds_its_row_through_the_natural_key_index(tmp_path: Path) -> None:
    """A bound -1 in `coalesce(global_step, ?)` hid `uq_groups_key` from the planner, and each
    group's update scanned every group of its step: the settling page was quadratic in them."""
    path = await _migrated(tmp_path)
    compiled = rm.group_update(["status"]).compile(dialect=sqlite.dialect())
    params = {name: None for name in compiled.params}
    sql = str(compiled)
    with sqlite3.connect(path) as db:
        plan = db.execute(
            f"EXPLAIN QUERY PLAN {sql}", [params[name] for name in compiled.positiontup]
        ).fetchall()
    details = " ".join(row[-1] for row in plan)
    assert "uq_groups_key" in details, details
    assert "uid=?" in details, details  # the whole key, not a prefix of it


COLUMNS = ("state", "reward", "version")
_values = st.one_of(st.none(), st.integers(0, 3), st.sampled_from(["running", "succeeded"]))
_rows = st.fixed_dictionaries({c: _values for c in COLUMNS})


@given(pairs=st.lists(st.tuples(_rows, st.one_of(st.none(), _rows)), max_size=12))
def test_changed_columns_writes_each_row_once_with_exactly_what_differs(
    pairs: list[tuple[dict, dict | None]],
) -> None:
    """Every row lands in one group, keyed by the columns that differ from its stored copy (all of
    them without one); a row equal to its stored copy is written not at all."""
    updates = [row for row, _ in pairs]
    stored = [before for _, before in pairs]
    grouped = rm.changed_columns(updates, stored, COLUMNS)
    placed = [id(row) for rows in grouped.values() for row in rows]
    assert len(placed) == len(set(placed))
    for row, before in pairs:
        expected = COLUMNS if before is None else tuple(c for c in COLUMNS if row[c] != before[c])
        if expected:
            assert any(r is row for r in grouped[expected])
        else:
            assert all(r is not row for rows in grouped.values() for r in rows)
