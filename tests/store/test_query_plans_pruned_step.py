"""The append's closed-step check (issue 40) reads only prune records, never a step's events.

Every commit batch with a creation asks whether its steps were pruned. It must search the
partial index `ix_events_pruned_step` (prune records only, a handful per run), not
`ix_events_run_partition_global_step`, which holds every event of the step: that would make each
creation cost its step's size. Planned as `tests/store/test_query_plans.py` plans (SQLite: SEARCH
with the keys; PostgreSQL: no sequential scan, and the partial index's literal condition spelt).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from store.log.append_sql import _closed_steps
from tests.store.test_query_plans import _SETTINGS, _check, _creation, _plans, _run, migrated

__all__ = ["migrated"]  # the module fixture, shared


@_SETTINGS
@given(
    groups=st.lists(
        st.tuples(st.sampled_from(["train", "val"]), st.integers(0, 10_000), st.integers(1, 600)),
        min_size=1,
        max_size=3,
        unique=True,
    )
)
def test_the_closed_step_check_searches_only_prune_records(
    migrated: str, groups: list[tuple[str, int, int]]
) -> None:
    batch = [
        _creation("r", partition, step, f"u{g}", g % 4)
        for partition, step, uids in groups
        for g in range(uids)
    ]
    plans = _run(_plans(migrated, lambda conn: _closed_steps(conn, batch), "events"))
    assert len(plans) >= len({partition for partition, _step, _uids in groups})
    _check(
        migrated,
        plans,
        "events",
        "ix_events_pruned_step",
        ["run", "partition"],
        ["events.type = 'PayloadsPruned'"],
    )
