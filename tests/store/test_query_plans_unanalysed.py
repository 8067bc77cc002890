"""On PostgreSQL: the step- and session-bounded reads keep their index on large tables
the planner has no statistics for.

`tests/store/test_query_plans.py` holds the statement shapes on small tables, where PostgreSQL may take
any index. What went wrong at scale needs size: with autovacuum off (or a log loaded faster than
its next pass) PostgreSQL plans from defaults, and at 10^5-10^6 events it took `ix_events_type`
for a page of sessions' trajectories and `ix_groups_run_partition_global_step` on (run, partition)
alone for a step's groups — both a walk over the whole run. Revision 0007 dropped those two
indexes. Here one database is filled, by SQL and never analysed, with 100,000 events and 50,000
groups, and every plan of the store's own reads must name the intended index with the key in its
condition. Which step and how many sessions or uids are generated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from store import create_engine, upgrade
from store import read_models as rm
from store.read_models import queries
from store.reads import export_reads
from tests.conftest import fresh_database
from tests.store.test_query_plans import _plans

pytestmark = pytest.mark.postgres

SESSIONS = 20_000  # five events each
SESSIONS_PER_STEP = 256
GROUPS = 50_000
GROUPS_PER_STEP = 64
OPEN_EVERY = 499  # odd, so both runs have open sessions

_SETTINGS = settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

_FILL = [
    f"""INSERT INTO events (event_id, session_id, version, type, schema_version, run, uid,
           partition, global_step, data, payload, recorded_at, session_index, group_size)
       SELECT 'e' || s || '-' || v, 's' || s, v,
              (ARRAY['SessionCreated', 'SessionStarted', 'TrajectoryRecorded', 'RewardPosted',
                     'SessionSucceeded'])[v],
              1, 'r', 'u' || (s / 4), 'train', s / {SESSIONS_PER_STEP}, '{{}}', NULL, now(),
              CASE WHEN v = 1 THEN s % 4 END, CASE WHEN v = 1 THEN 4 END
       FROM generate_series(0, {SESSIONS - 1}) s, generate_series(1, 5) v
       ORDER BY s, v""",
    f"""INSERT INTO groups (run, uid, partition, global_step, data_source, group_size,
           sessions_seen, terminal, succeeded, failed, cancelled, reward_sum, reward_count,
           status, settled_position, members, valid_rows, min_valid)
       SELECT 'r', 'g' || g, 'train', g / {GROUPS_PER_STEP}, NULL, 4, 4, g % 2, 0, 0, 0, 0.0, 0,
              CASE WHEN g % 2 = 0 THEN 'pending' ELSE 'finished' END, NULL, '[0, 1, 2, 3]', 4, 2
       FROM generate_series(0, {GROUPS - 1}) g""",
    # every session of the events above, one in OPEN_EVERY still running (what `recover` sweeps)
    f"""INSERT INTO sessions (session_id, run, uid, session_index, group_size, partition,
           global_step, state, version, num_trajectories, selected_rows, reward_info, placeholder,
           created_position, created_at)
       SELECT 's' || s, 'r' || (s % 2), 'u' || (s / 4), s % 4, 4, 'train', s / {SESSIONS_PER_STEP},
              CASE WHEN s % {OPEN_EVERY} = 0 THEN 'running' ELSE 'succeeded' END, 5, 1, 1, '{{}}',
              false, s * 5 + 1, now()
       FROM generate_series(0, {SESSIONS - 1}) s""",
]


@pytest.fixture(scope="module")
def unanalysed() -> Iterator[str]:
    with fresh_database("postgres") as url:

        async def fill() -> None:
            engine = create_engine(url)
            try:
                await upgrade(engine)
                async with engine.begin() as conn:
                    for statement in _FILL:
                        await conn.execute(text(statement))
                    analysed = await conn.execute(
                        text(
                            "SELECT count(*) FROM pg_stats "
                            "WHERE tablename IN ('events', 'groups', 'sessions')"
                        )
                    )
                    assert analysed.scalar() == 0, "the tables must have no statistics"
            finally:
                await engine.dispose()

        asyncio.run(fill())
        yield url


def _index_scans(plans: list[tuple[str, str]]) -> list[str]:
    return [scan for _, plan in plans for scan in plan.split(" | ") if "Index" in scan]


def _assert_index(plans: list[tuple[str, str]], allowed: tuple[str, ...], key: str) -> None:
    scans = _index_scans(plans)
    where = "\n".join(f"{statement}\nplan: {plan}" for statement, plan in plans)
    assert scans, where
    for scan in scans:
        assert any(f" {name}:" in scan for name in allowed), where
        assert key in scan, where


_step_sessions = st.tuples(
    st.integers(0, SESSIONS // SESSIONS_PER_STEP - 1), st.integers(1, SESSIONS_PER_STEP)
).map(lambda p: [f"s{p[0] * SESSIONS_PER_STEP + i}" for i in range(p[1])])

#: Indexes that find events by session: what a page of sessions' trajectories may read.
_BY_SESSION = ("ix_events_session_id_type", "uq_events_session_id_version")


@_SETTINGS
@given(session_ids=_step_sessions)
def test_a_page_of_trajectories_is_read_by_session(unanalysed: str, session_ids: list[str]) -> None:
    up_to = SESSIONS * 5
    for read in (export_reads.trajectory_events, rm.trajectory_events):
        plans = asyncio.run(
            _plans(unanalysed, lambda conn, r=read: r(conn, session_ids, up_to), "events")
        )
        _assert_index(plans, _BY_SESSION, "session_id")


_steps = st.integers(0, GROUPS // GROUPS_PER_STEP - 1)


@_SETTINGS
@given(step=_steps, count=st.integers(1, GROUPS_PER_STEP))
def test_a_steps_groups_are_read_by_the_natural_key(unanalysed: str, step: int, count: int) -> None:
    keys = [("r", "train", step, f"g{step * GROUPS_PER_STEP + i}") for i in range(count)]
    reads = (
        lambda conn: rm.load_groups(conn, keys),
        lambda conn: queries.group_status(conn, "r", "train", step),
        lambda conn: queries.pending_uids(conn, "r", "train", step),
    )
    for read in reads:
        plans = asyncio.run(_plans(unanalysed, read, "groups"))
        _assert_index(plans, ("uq_groups_key",), "COALESCE(global_step")


@_SETTINGS
@given(run=st.sampled_from([None, "r0", "r1"]))
def test_the_open_sessions_are_found_by_state_and_their_events_by_session(
    unanalysed: str, run: str | None
) -> None:
    """`recover`'s sweep reads the few open sessions and each one's own events, never a run's
    sessions or the whole log (a join had PostgreSQL hash a scan of every event)."""
    found: list[tuple[str, object]] = []

    async def sweep(conn: object) -> None:
        found.extend(await queries.open_sessions_last_event(conn, run=run))

    plans = asyncio.run(_plans(unanalysed, sweep, "sessions"))
    scans = _index_scans(plans)
    where = "\n".join(f"{statement}\nplan: {plan}" for statement, plan in plans)
    assert any(" ix_sessions_state:" in scan for scan in scans), where
    for scan in scans:
        assert " ix_sessions_state:" in scan or (
            any(f" {name}:" in scan for name in _BY_SESSION) and "session_id" in scan
        ), where
    expected = {f"s{i}" for i in range(0, SESSIONS, OPEN_EVERY) if run in (None, f"r{i % 2}")}
    assert {session_id for session_id, _ in found} == expected
