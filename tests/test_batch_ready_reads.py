"""Issue 18, batch ready when the step ends: the read-model writes and reads the last pages and
`ledger.batch` pay for stay indexed and linear in what they touch."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sqlalchemy.dialects import sqlite

from store import create_engine
from store import read_models as rm
from store.migrate import upgrade


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
        plan = db.execute(f"EXPLAIN QUERY PLAN {sql}", [params[name] for name in compiled.positiontup]).fetchall()
    details = " ".join(row[-1] for row in plan)
    assert "uq_groups_key" in details, details
    assert "uid=?" in details, details  # the whole key, not a prefix of it
