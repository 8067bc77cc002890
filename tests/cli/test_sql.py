"""The SQL surface (issue "Replay, audit and the SQL surface", item 5): the views Alembic creates,
docs/sql.md, and `rollout-ledger sql`, on SQLite and PostgreSQL.

The docs cannot rot: every example query in docs/sql.md is run and must return exactly the
columns its `<!-- columns: … -->` line names (and rows, on the database built here); every column
of every table and view in a migrated database must be documented, and nothing else; the views'
numbers must agree with `ledger.metrics()`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from sessions import Ledger, PlaceholderPolicy, SandboxError
from sessions.cli.sql import WriteRefused, run_query
from store import create_engine, current_revision, head_revision
from store import queue_claims as qc
from store.schema.tables import metadata
from store.schema.views import VIEWS
from tests import REPO
from tests.store.test_migrations import _compare as compare_expression_aware
from tests.store.test_migrations import alembic as run_alembic

ROOT = REPO
DOC = ROOT / "docs" / "sql.md"
RUN = "default"

EXAMPLE = re.compile(
    r"^<!-- columns: (?P<columns>[^>]*?) -->\n```sql\n(?P<sql>.*?)\n```", re.MULTILINE | re.DOTALL
)


# ------------------------------------------------------------------------------------------
# docs/sql.md
# ------------------------------------------------------------------------------------------


def doc_examples() -> list[tuple[list[str], str]]:
    text = DOC.read_text(encoding="utf-8")
    found = [
        ([c.strip() for c in m["columns"].split(",")], m["sql"]) for m in EXAMPLE.finditer(text)
    ]
    # no SQL block escapes the check: each one carries its columns line
    assert len(found) == text.count("```sql"), (
        "every ```sql block in docs/sql.md needs a <!-- columns: … --> line right above it"
    )
    return found


#: The examples over model calls: they need a run that recorded calls (`demo --calls N`), which
#: `tests/cli/test_sql_calls.py` runs them on and checks; here they run and give their columns.
CALLS_SECTION = "### Model calls\n"


def calls_examples() -> list[tuple[list[str], str]]:
    """The examples of docs/sql.md's "Model calls" section, in order."""
    text = DOC.read_text(encoding="utf-8")
    assert text.count(CALLS_SECTION) == 1, f"docs/sql.md needs one {CALLS_SECTION.strip()!r}"
    section = text.split(CALLS_SECTION, 1)[1].split("\n## ", 1)[0]
    return [
        ([c.strip() for c in m["columns"].split(",")], m["sql"]) for m in EXAMPLE.finditer(section)
    ]


def documented_columns() -> dict[str, list[str]]:
    """`### \\`name\\`` section -> the backticked names in the first column of its table."""
    out: dict[str, list[str]] = {}
    for section in re.split(r"^### ", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]:
        heading, _, body = section.partition("\n")
        named = re.fullmatch(r"`(\w+)`", heading.strip())
        if named:
            out[named[1]] = re.findall(r"^\| `(\w+)` \|", body, flags=re.MULTILINE)
    return out


def test_docs_parse() -> None:
    examples = doc_examples()
    assert len(examples) >= 10
    for columns, sql in examples:
        assert columns and all(re.fullmatch(r"[a-z_][a-z0-9_]*", c) for c in columns), columns
        assert ";" not in sql
    documented = documented_columns()
    for name, columns in documented.items():
        assert columns, f"docs/sql.md: section {name} lists no columns"
        assert len(columns) == len(set(columns)), f"docs/sql.md: {name} lists a column twice"
    assert set(VIEWS) <= documented.keys()


# ------------------------------------------------------------------------------------------
# a database with something of everything
# ------------------------------------------------------------------------------------------


def runner(
    reward: float | None = None, *, fail: BaseException | None = None, trajectories: int = 1
):  # type: ignore[no-untyped-def]
    async def run(h):  # type: ignore[no-untyped-def]
        for i in range(trajectories):
            await h.record_trajectory(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6][: 2 + i])
        if reward is not None:
            await h.post_reward(reward)
        if fail is not None:
            raise fail

    return run


async def populate(ledger: Ledger) -> None:
    """Two steps (train 1, val 2), two data sources, successes (one of two rows, one with no
    reward posted), failures with and without a placeholder, a cancel, an open session (so one
    group stays pending), mixed group sizes, and durable-queue claims (one acked)."""

    async def run(uid: str, i: int, size: int, partition: str, step: int, source: str, r) -> None:  # type: ignore[no-untyped-def]
        await ledger.run_session(
            r,
            f"{uid}-s{i}",
            uid=uid,
            session_index=i,
            group_size=size,
            partition=partition,
            global_step=step,
            data_source=source,
        )

    await run("step1-math-0", 0, 2, "train", 1, "math", runner(1.0))
    await run("step1-math-0", 1, 2, "train", 1, "math", runner(0.5, trajectories=2))
    await run("step1-math-1", 0, 2, "train", 1, "math", runner(1.0))
    await run("step1-math-1", 1, 2, "train", 1, "math", runner(1.0, fail=RuntimeError("boom")))
    await run(
        "step1-code-0", 0, 2, "train", 1, "code", runner(fail=SandboxError("sandbox died"))
    )  # dropped in train
    cancelled = await ledger.create_session(
        "step1-code-0-s1",
        uid="step1-code-0",
        session_index=1,
        group_size=2,
        partition="train",
        global_step=1,
        data_source="code",
    )
    await cancelled.cancel("preempted")
    await run("step1-code-1", 0, 2, "train", 1, "code", runner(fail=TimeoutError("too slow")))
    await run("step1-code-1", 1, 2, "train", 1, "code", runner(None))  # succeeded, reward absent
    await run("step2-math-0", 0, 2, "val", 2, "math", runner(1.0))
    await run("step2-math-0", 1, 2, "val", 2, "math", runner(fail=RuntimeError("tool crashed")))
    await run("step2-math-1", 0, 2, "val", 2, "math", runner(1.0))
    await run("step2-math-1", 1, 2, "val", 2, "math", runner(0.0))
    await run("step2-code-0", 0, 2, "val", 2, "code", runner(1.0))
    await ledger.create_session(  # left open: its group stays pending
        "step2-code-0-s1",
        uid="step2-code-0",
        session_index=1,
        group_size=2,
        partition="val",
        global_step=2,
        data_source="code",
    )
    await run("step2-code-1", 0, 1, "val", 2, "code", runner(0.25))  # a group of one
    await ledger.project()
    claimed = await qc.claim(
        ledger.engine, "trainer-0", run=RUN, partition="train", limit=3, global_step=1
    )
    assert len(claimed) == 3
    assert await qc.ack(ledger.engine, "trainer-0", [claimed[0]["id"]]) == 1


def open_ledger(url: str):  # type: ignore[no-untyped-def]
    return Ledger.open(
        url,
        run=RUN,
        placeholder_policy=PlaceholderPolicy(rules={"train": {"sandbox_error": "drop"}}),
    )


async def rows_of(engine: Any, sql: str) -> list[dict[str, Any]]:
    columns, rows = await run_query(engine, sql)
    return [dict(zip(columns, row)) for row in rows]


def _schema(sync_conn) -> tuple[dict[str, list[str]], dict[str, list[str]]]:  # type: ignore[no-untyped-def]
    insp = inspect(sync_conn)
    tables = {name: [c["name"] for c in insp.get_columns(name)] for name in insp.get_table_names()}
    views = {name: [c["name"] for c in insp.get_columns(name)] for name in insp.get_view_names()}
    return tables, views


def _drift(sync_conn) -> list:  # type: ignore[no-untyped-def]
    # test_migrations' compare: SQLite cannot reflect the expression indexes (checked there on both backends)
    return compare_expression_aware(
        MigrationContext.configure(sync_conn, opts={"compare_type": True}), metadata
    )


async def schema(engine: Any) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    async with engine.connect() as conn:
        return await conn.run_sync(_schema)


# ------------------------------------------------------------------------------------------
# the docs against a real database
# ------------------------------------------------------------------------------------------


async def test_every_example_query_runs_and_returns_its_documented_columns(db_url: str) -> None:
    over_calls = {sql for _, sql in calls_examples()}
    async with open_ledger(db_url) as ledger:
        await populate(ledger)
        for expected, sql in doc_examples():
            try:
                columns, rows = await run_query(ledger.engine, sql)
            except ValueError as error:
                pytest.fail(
                    f"docs/sql.md example failed on {ledger.engine.dialect.name}: {error}\n{sql}"
                )
            assert [c.lower() for c in columns] == expected, sql
            if sql in over_calls:
                continue  # no call recorded here: test_sql_calls.py wants their rows
            assert rows, f"docs/sql.md example returned no rows on a populated database:\n{sql}"


async def test_every_table_and_view_column_is_documented(db_url: str) -> None:
    async with open_ledger(db_url) as ledger:
        tables, views = await schema(ledger.engine)
    documented = documented_columns()
    assert set(views) == set(VIEWS), "store.views.VIEWS must list exactly the views in the database"
    assert {"alembic_version", *metadata.tables} == set(tables)
    for name, columns in {**tables, **views}.items():
        assert name in documented, f"docs/sql.md has no section `### \\`{name}\\``"
        assert set(documented[name]) == set(columns), (
            f"docs/sql.md and the database disagree on {name}: "
            f"undocumented {sorted(set(columns) - set(documented[name]))}, "
            f"not in the database {sorted(set(documented[name]) - set(columns))}"
        )
    for name in VIEWS:  # views: documented in their column order
        assert documented[name] == views[name], name
    assert set(documented) == set(tables) | set(views), (
        "docs/sql.md documents a table or view that does not exist"
    )


# ------------------------------------------------------------------------------------------
# the views against ledger.metrics()
# ------------------------------------------------------------------------------------------


async def test_views_agree_with_the_metrics(db_url: str) -> None:
    async with open_ledger(db_url) as ledger:
        await populate(ledger)
        engine = ledger.engine
        metrics: dict[tuple, dict[str, float]] = defaultdict(dict)
        for row in await ledger.metrics():
            metrics[(row.run, row.partition, row.global_step, row.data_source)][row.metric] = (
                row.value
            )

        # reward_by_step: one row per metric scope, values exactly the stored metrics
        by_step = await rows_of(engine, "SELECT * FROM reward_by_step")
        assert {
            (r["run"], r["partition"], r["global_step"], r["data_source"]) for r in by_step
        } == set(metrics)
        for r in by_step:
            m = metrics[(r["run"], r["partition"], r["global_step"], r["data_source"])]
            assert r["reward_mean"] == m.get("reward/mean")
            assert r["reward_mean_success_only"] == m.get("reward/mean_success_only")
            sizes = [int(name.split("@")[1]) for name in m if name.startswith("reward/mean@")]
            assert r["n"] == (max(sizes) if sizes else None)
            assert r["reward_mean_at_n"] == (m[f"reward/mean@{max(sizes)}"] if sizes else None)
            assert r["sessions_total"] == m["sessions/total"]
            assert r["sessions_succeeded"] == m["sessions/succeeded"]
            assert r["sessions_failed"] == m["sessions/failed"]
            assert r["sessions_cancelled"] == m["sessions/cancelled"]
            assert r["placeholders"] == m["placeholders"]
            assert r["coverage"] == m.get("coverage")
        # hand-computed: train step 1 rows are 1.0, 0.5, 0.5, 1.0, 0 (placeholder), 0 (placeholder), 0.0 (absent)
        train = next(r for r in by_step if r["partition"] == "train" and r["data_source"] is None)
        assert math.isclose(train["reward_mean"], 3 / 7) and math.isclose(
            train["reward_mean_success_only"], 3 / 5
        )
        assert (
            train["sessions_total"],
            train["sessions_failed"],
            train["sessions_cancelled"],
            train["placeholders"],
        ) == (8, 3, 1, 2)
        val = next(r for r in by_step if r["partition"] == "val" and r["data_source"] is None)
        # step2-math-0 and -1 have 2 rows each (mean 0.5); step2-code-0 is pending (not counted); the group of one is @1
        assert val["n"] == 2 and math.isclose(val["reward_mean_at_n"], (0.5 + 0.5) / 2)

        # failure_breakdown: failed/<reason> of the all-sources scopes, and placeholders
        breakdown = await rows_of(engine, "SELECT * FROM failure_breakdown")
        expected = {
            (scope, name.split("/", 1)[1]): value
            for scope, m in metrics.items()
            if scope[3] is None
            for name, value in m.items()
            if name.startswith("failed/") and value
        }
        assert {
            ((r["run"], r["partition"], r["global_step"], None), r["failure_reason"]): r["sessions"]
            for r in breakdown
        } == expected
        placeholders: dict[tuple, int] = defaultdict(int)
        for r in breakdown:
            placeholders[(r["run"], r["partition"], r["global_step"], None)] += r["placeholders"]
        for scope, m in metrics.items():
            if scope[3] is None:
                assert placeholders.get(scope, 0) == m["placeholders"], scope
        assert {
            (r["partition"], r["failure_reason"], r["sessions"], r["placeholders"])
            for r in breakdown
        } == {
            ("train", "runner_error", 1, 1),
            ("train", "sandbox_error", 1, 0),
            ("train", "timeout", 1, 1),
            ("val", "runner_error", 1, 1),
        }

        # group_status: the groups table, and reward/mean@k as the mean of mean_reward over the settled
        # uids with k batch rows (groups.reward_count)
        groups = await rows_of(engine, "SELECT * FROM group_status")
        assert len(groups) == 8
        row_counts = {
            (r["run"], r["partition"], r["global_step"], r["uid"]): r["reward_count"]
            for r in await rows_of(
                engine, "SELECT run, partition, global_step, uid, reward_count FROM groups"
            )
        }
        macro: dict[tuple, list[float]] = defaultdict(list)
        for g in groups:
            assert g["terminal"] == g["succeeded"] + g["failed"] + g["cancelled"]
            assert (g["status"] == "pending") == (g["terminal"] < g["group_size"])
            if g["mean_reward"] is not None and g["status"] != "pending":
                k = row_counts[(g["run"], g["partition"], g["global_step"], g["uid"])]
                for source in (g["data_source"], None):
                    macro[(g["run"], g["partition"], g["global_step"], source, k)].append(
                        g["mean_reward"]
                    )
        assert {g["uid"]: g["status"] for g in groups if g["status"] != "finished"} == {
            "step1-code-0": "failure",
            "step2-code-0": "pending",
        }
        assert (
            next(g for g in groups if g["uid"] == "step1-code-0")["mean_reward"] is None
        )  # dropped + cancelled: no row
        for (run, partition, step, source, n), means in macro.items():
            assert math.isclose(
                sum(means) / len(means), metrics[(run, partition, step, source)][f"reward/mean@{n}"]
            )
        for scope, m in metrics.items():
            for name in m:
                if name.startswith("reward/mean@"):
                    assert (*scope, int(name.split("@")[1])) in macro

        # session_timeline: every event once, with the session's current state
        timeline = await rows_of(engine, "SELECT * FROM session_timeline ORDER BY position")
        events = await rows_of(
            engine,
            "SELECT position, session_id, version, type FROM events "
            "WHERE type <> 'RunConfigured' ORDER BY position",
        )  # runs' streams are no sessions
        assert [(t["position"], t["session_id"], t["version"], t["type"]) for t in timeline] == [
            (e["position"], e["session_id"], e["version"], e["type"]) for e in events
        ]
        states = {
            r["session_id"]: r["state"]
            for r in await rows_of(engine, "SELECT session_id, state FROM sessions")
        }
        assert all(t["state"] == states[t["session_id"]] for t in timeline)
        assert {t["state"] for t in timeline} == {"succeeded", "failed", "cancelled", "running"}


async def test_timeline_shows_events_the_projector_has_not_reached(db_url: str) -> None:
    async with open_ledger(db_url) as ledger:
        await ledger.run_session(
            runner(1.0),
            "late-s0",
            uid="late",
            session_index=0,
            group_size=1,
            partition="val",
            global_step=0,
        )
        before = await rows_of(
            ledger.engine, "SELECT type, state FROM session_timeline ORDER BY position"
        )
        assert [r["state"] for r in before] == [None] * 5
        assert await rows_of(ledger.engine, "SELECT * FROM reward_by_step") == []
        await ledger.project()
        after = await rows_of(
            ledger.engine, "SELECT type, state FROM session_timeline ORDER BY position"
        )
        assert [r["state"] for r in after] == ["succeeded"] * 5


# ------------------------------------------------------------------------------------------
# `rollout-ledger sql`
# ------------------------------------------------------------------------------------------


def _cli_command() -> list[str]:
    script = Path(sys.executable).with_name("rollout-ledger")
    return [str(script)] if script.exists() else [sys.executable, "-m", "sessions.cli.main"]


async def cli(*args: str, cwd: Path) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    env["COLUMNS"] = "200"
    process = await asyncio.create_subprocess_exec(
        *_cli_command(),
        *args,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


WRITES = [
    "DELETE FROM events",
    "UPDATE sessions SET state = 'failed'",
    "DROP TABLE events",
    "DROP VIEW reward_by_step",
    "INSERT INTO checkpoints (name, position, updated_at) VALUES ('x', 0, CURRENT_TIMESTAMP)",
    "WITH x AS (SELECT 1) DELETE FROM events",  # past the prefix check: the database must refuse it
]
PG_WRITES = [
    "WITH x AS (DELETE FROM events RETURNING 1) SELECT * FROM x",
    "EXPLAIN ANALYZE DELETE FROM events",
    "SELECT * FROM sessions FOR UPDATE",
]


async def snapshot(engine: Any) -> dict[str, Any]:
    return {
        "events": await rows_of(
            engine,
            "SELECT position, event_id, session_id, version, type FROM events ORDER BY position",
        ),
        "sessions": await rows_of(
            engine, "SELECT session_id, state, version FROM sessions ORDER BY session_id"
        ),
        "checkpoints": await rows_of(
            engine, "SELECT name, position FROM checkpoints ORDER BY name"
        ),
        "reward_by_step": await rows_of(
            engine, "SELECT * FROM reward_by_step ORDER BY partition, data_source"
        ),
    }


async def test_cli_sql_refuses_writes_and_leaves_the_data_untouched(
    db_url: str, tmp_path: Path
) -> None:
    async with open_ledger(db_url) as ledger:
        await populate(ledger)
        before = await snapshot(ledger.engine)
    # a write hidden in a CTE: PostgreSQL allows DML in a WITH clause, SQLite a WITH before DML
    hidden = PG_WRITES[0] if db_url.startswith("postgresql") else WRITES[-1]
    statements = [
        "DELETE FROM events",
        "UPDATE sessions SET state = 'failed'",
        "DROP TABLE events",
        hidden,
    ]
    gate = asyncio.Semaphore(2)  # each process imports the library: keep a small machine responsive

    async def refused(statement: str) -> tuple[int, str, str]:
        async with gate:
            return await cli("sql", statement, "--db", db_url, cwd=tmp_path)

    results = await asyncio.gather(*(refused(statement) for statement in statements))
    for statement, (code, out, err) in zip(statements, results):
        assert code != 0, f"`rollout-ledger sql {statement!r}` succeeded:\n{out}"
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith("rollout-ledger: error: refused"), f"{statement!r}: {err}"
        assert out == ""
    # and a read still works, through a view
    code, out, err = await cli(
        "sql", "SELECT COUNT(*) AS n FROM session_timeline", "--json", "--db", db_url, cwd=tmp_path
    )
    assert code == 0, err
    assert json.loads(out) == [{"n": sum(e["type"] != "RunConfigured" for e in before["events"])}]
    async with open_ledger(db_url) as ledger:
        assert await snapshot(ledger.engine) == before


async def test_run_query_refuses_writes(db_url: str) -> None:
    async with open_ledger(db_url) as ledger:
        await populate(ledger)
        before = await snapshot(ledger.engine)
        for statement in WRITES + (PG_WRITES if ledger.engine.dialect.name == "postgresql" else []):
            with pytest.raises(WriteRefused, match="refused"):
                await run_query(ledger.engine, statement)
        assert await snapshot(ledger.engine) == before
        # the connection handed back to the pool is writable again
        await ledger.run_session(
            runner(1.0),
            "after-s0",
            uid="after",
            session_index=0,
            group_size=1,
            partition="val",
            global_step=9,
        )
        assert await ledger.project() > 0


async def test_run_query_sends_literals_as_written(db_url: str) -> None:
    """Regression: a ` :word` inside a string literal was taken for a bind parameter (text()),
    so a read-only query failed with an uncaught StatementError (a traceback from the CLI)."""
    async with open_ledger(db_url) as ledger:
        await populate(ledger)
        columns, rows = await run_query(ledger.engine, "SELECT ' :x' AS t, 'a%b' AS u, '?' AS v")
        assert (columns, rows) == (["t", "u", "v"], [(" :x", "a%b", "?")])
        _, rows = await run_query(
            ledger.engine,
            "SELECT COUNT(*) AS n FROM sessions WHERE message = 'too slow' OR uid = ' :uid'",
        )
        assert rows == [(1,)]
        with pytest.raises(ValueError, match="query failed"):
            await run_query(ledger.engine, "SELECT * FROM no_such_view")


async def test_run_query_takes_a_semicolon_in_a_literal_but_not_a_second_statement(
    db_url: str,
) -> None:
    async with open_ledger(db_url) as ledger:
        await populate(ledger)
        before = await snapshot(ledger.engine)
        _, rows = await run_query(
            ledger.engine,
            "SELECT 'a;b' AS t, COUNT(*) FROM sessions WHERE message <> 'x;y' -- ; trailing\n",
        )
        assert rows[0][0] == "a;b"
        for statement in (
            "SELECT 1; DELETE FROM events",
            "SELECT ';' AS t; DROP TABLE events",
            "SELECT 1 /* ; */; DELETE FROM events",
        ):
            with pytest.raises(WriteRefused, match="one statement at a time"):
                await run_query(ledger.engine, statement)
        assert await snapshot(ledger.engine) == before


# ------------------------------------------------------------------------------------------
# Alembic: the views come and go with revision 0002
# ------------------------------------------------------------------------------------------


async def tables_of_revision(revision: str, folder: Path) -> set[str]:
    """The tables a fresh database has at `revision` (migrated there by Alembic itself)."""
    folder.mkdir()
    url = f"sqlite+aiosqlite:///{folder / 'reference.db'}"
    await asyncio.to_thread(run_alembic, url, "upgrade", revision)
    engine = create_engine(url)
    try:
        tables, views = await schema(engine)
        assert views == {}
        return set(tables)
    finally:
        await engine.dispose()


async def test_downgrade_removes_the_views_and_upgrade_restores_them(
    db_url: str, tmp_path: Path
) -> None:
    at_0001 = await tables_of_revision("0001", tmp_path / "reference")
    later = {
        "alembic_version",
        *metadata.tables,
    } - at_0001  # tables a later revision adds (projection_errors, 0004)
    assert at_0001 <= {"alembic_version", *metadata.tables}
    async with open_ledger(db_url) as ledger:
        await populate(ledger)
        views_before = {name: await unordered_rows_of(ledger.engine, name) for name in VIEWS}
        tables_before = await snapshot_tables(ledger.engine)
    # a downgrade drops the later tables with their rows: only empty ones can come back as they were
    assert all(tables_before[name] == 0 for name in later), tables_before
    await asyncio.to_thread(run_alembic, db_url, "downgrade", "0001")
    engine = create_engine(db_url)
    try:
        assert await current_revision(engine) == "0001"
        tables, views = await schema(engine)
        assert views == {}
        assert set(tables) == at_0001
        kept = {name: count for name, count in tables_before.items() if name in at_0001}
        assert (
            await snapshot_tables(engine, kept) == kept
        )  # only the views (and the later tables) went
        with pytest.raises(ValueError, match="query failed"):
            await run_query(engine, "SELECT * FROM reward_by_step")
    finally:
        await engine.dispose()

    await asyncio.to_thread(run_alembic, db_url, "upgrade", "head")
    async with open_ledger(db_url) as ledger:
        assert await current_revision(ledger.engine) == head_revision()
        assert (
            await snapshot_tables(ledger.engine) == tables_before
        )  # the later revisions kept every row
        _, views = await schema(ledger.engine)
        assert set(views) == set(VIEWS)
        for name in VIEWS:
            assert await unordered_rows_of(ledger.engine, name) == views_before[name], name
        async with ledger.engine.connect() as conn:
            assert await conn.run_sync(_drift) == [], "views must not show up as schema drift"


async def unordered_rows_of(engine: Any, view: str) -> list[dict[str, Any]]:
    """A view's rows as a sorted multiset: a view without ORDER BY has no defined row order (on
    PostgreSQL a migration's UPDATE moves rows, and `SELECT *` returns them in another order)."""
    rows = await rows_of(engine, f"SELECT * FROM {view}")
    return sorted(rows, key=lambda row: json.dumps(row, sort_keys=True, default=str))


async def snapshot_tables(engine: Any, names: Any = None) -> dict[str, int]:
    counts = {}
    for name in metadata.tables if names is None else names:
        _, rows = await run_query(engine, f"SELECT COUNT(*) FROM {name}")
        counts[name] = rows[0][0]
    return counts
