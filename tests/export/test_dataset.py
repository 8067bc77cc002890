"""`export_dataset` and `rollout-ledger export-dataset`: every terminal session exactly
once, its tokens as recorded, read back by DuckDB and Hugging Face `datasets`; and the bad inputs
(an unknown or empty run, failures only, a run still being written, a path that cannot be
written, pyarrow missing) each give a documented result or one clear line.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import Ledger
from sessions.export import ExportError, export_dataset
from sessions.export.schema import COLUMNS, OPTIONAL_SESSION_COLUMNS, TEXT_COLUMNS, columns_for
from tests import REPO

REPO = REPO
PREFIX = "rollout-ledger: error: "

Trajectory = tuple[list[int], list[int], list[int], "list[float] | None"]


@dataclass
class Plan:
    """One session to record: how it ends, what it recorded."""

    sid: str
    outcome: str  # succeeded | failed | cancelled | open
    trajectories: list[Trajectory] = field(default_factory=list)
    partition: str = "val"
    step: int | None = 0
    reward: float | None = None


async def record(ledger: Ledger, plans: list[Plan], *, run: str | None = None) -> None:
    for p in plans:
        handle = await ledger.create_session(
            p.sid,
            uid=f"u{p.sid}",
            session_index=0,
            group_size=1,
            partition=p.partition,
            global_step=p.step,
            run=run,
        )
        for prompt, response, mask, logprobs in p.trajectories:
            await handle.record_trajectory(
                prompt_ids=prompt,
                response_ids=response,
                response_mask=mask,
                response_logprobs=logprobs,
            )
        if p.reward is not None:
            await handle.post_reward(p.reward, judge="x")
        if p.outcome == "succeeded":
            await handle.complete()
        elif p.outcome == "failed":
            await handle.fail("sandbox_error", message="sandbox died", error_type="SandboxError")
        elif p.outcome == "cancelled":
            await handle.cancel("stopped")


def rows_of(path: Path, order: str = "session_id, trajectory_index") -> list[dict[str, Any]]:
    """The file read back with DuckDB's own reader (SQL over the file), as dicts."""
    reader = f"read_json_auto('{path}')" if path.suffix == ".jsonl" else f"'{path}'"
    relation = duckdb.sql(f"SELECT * FROM {reader} ORDER BY {order}")
    return [dict(zip(relation.columns, row)) for row in relation.fetchall()]


def file_columns(*, text: bool = False) -> list[str]:
    """The columns an export of a database at this checkout's head holds (the optional session
    columns included once `store.tables` declares them)."""
    from store.schema.tables import sessions

    return [c.name for c in columns_for([col.name for col in sessions.columns], text=text)]


def expected_trajectory(p: Plan, per: str) -> list[Trajectory | None]:
    """What the docs promise: per session the last recorded trajectory (a succeeded session
    selects them all, so its last selected is its last), or none; per trajectory each one."""
    if per == "trajectory":
        return list(p.trajectories) or [None]
    return [p.trajectories[-1] if p.trajectories else None]


def assert_tokens(row: dict[str, Any], want: Trajectory | None) -> None:
    if want is None:
        assert (
            row["prompt_ids"] is None
            and row["response_ids"] is None
            and row["trajectory_index"] is None
        )
        return
    prompt, response, mask, logprobs = want
    assert list(row["prompt_ids"]) == prompt and list(row["response_ids"]) == response
    assert list(row["response_mask"]) == mask
    assert row["prompt_len"] == len(prompt) and row["response_len"] == len(response)
    assert row["trainable_tokens"] == sum(1 for m in mask if m == 1)
    if logprobs is None:
        assert row["response_logprobs"] is None
    else:
        assert list(row["response_logprobs"]) == pytest.approx(
            logprobs, abs=1e-6
        )  # stored as float32


# ------------------------------------------------------------------ property: exactly once, tokens as recorded
def _trajectory() -> st.SearchStrategy[Trajectory]:
    def build(draw: Any) -> Trajectory:
        n = draw(st.integers(1, 5))
        prompt = draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5))
        response = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
        mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        logprobs = draw(st.none() | st.lists(st.floats(-20, 0, width=32), min_size=n, max_size=n))
        return prompt, response, mask, logprobs

    return st.composite(lambda draw: build(draw))()


@st.composite
def plans(draw: Any) -> list[Plan]:
    out = []
    for i in range(draw(st.integers(1, 7))):
        outcome = draw(st.sampled_from(["succeeded", "failed", "cancelled", "open"]))
        low = (
            1 if outcome == "succeeded" else 0
        )  # complete() without a trajectory fails (empty_output)
        trajectories = draw(st.lists(_trajectory(), min_size=low, max_size=2))
        out.append(
            Plan(
                f"s{i}",
                outcome,
                trajectories,
                reward=draw(st.none() | st.sampled_from([0.0, 0.5, 1.0])),
            )
        )
    return out


_files = itertools.count()


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    plan=plans(),
    per=st.sampled_from(["session", "trajectory"]),
    fmt=st.sampled_from(["parquet", "jsonl"]),
)
def test_every_terminal_session_is_exported_once_with_its_recorded_tokens(
    tmp_path: Path, plan: list[Plan], per: str, fmt: str
) -> None:
    n = next(_files)
    out = tmp_path / f"out{n}.{fmt}"

    async def go() -> Any:
        async with Ledger.open(f"sqlite+aiosqlite:///{tmp_path / f'p{n}.db'}") as ledger:
            await record(ledger, plan)
            await ledger.project()
            return await export_dataset(ledger, out, format=fmt, per=per, row_group_size=2)

    summary = asyncio.run(go())
    terminal = [p for p in plan if p.outcome != "open"]
    assert summary.open_sessions == len(plan) - len(terminal)
    assert summary.sessions == len(terminal) and summary.behind == 0 and summary.undecodable == 0
    rows = rows_of(out) if terminal else []
    assert summary.rows == len(rows) == sum(len(expected_trajectory(p, per)) for p in terminal)
    by_session: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_session.setdefault(row["session_id"], []).append(row)
    assert sorted(by_session) == sorted(
        p.sid for p in terminal
    )  # exactly the terminal ones (open left out)
    for p in terminal:
        got = by_session[p.sid]
        want = expected_trajectory(p, per)
        assert len(got) == len(want)
        for row, trajectory in zip(got, want):
            assert row["state"] == p.outcome
            assert row["num_trajectories"] == len(p.trajectories)
            assert row["failure_reason"] == ("sandbox_error" if p.outcome == "failed" else None)
            assert row["selected"] == (None if trajectory is None else p.outcome == "succeeded")
            assert_tokens(row, trajectory)
            info = json.loads(row["reward_info"])
            assert info.get("judge") == ("x" if p.reward is not None else None)


# ------------------------------------------------------------------ both backends: columns, filters, readers
MIXED = [
    Plan("a", "succeeded", [([1, 2, 3], [4, 5], [1, 0], [-0.5, -1.5])], step=1, reward=1.0),
    Plan("b", "failed", [([1, 2], [9], [1], None)], step=1),
    Plan("c", "cancelled", [], step=2),
    Plan(
        "d",
        "succeeded",
        [([7], [8], [1], None), ([7, 7], [8, 8, 8], [1, 1, 0], None)],
        partition="train",
        step=3,
        reward=0.0,
    ),
    Plan("e", "failed", [], step=None),
]


async def test_an_export_on_each_backend_holds_every_column_and_honours_the_filters(
    db_url: str, tmp_path: Path
) -> None:
    async with Ledger.open(db_url, run="r1") as ledger:
        await record(ledger, MIXED)
        await ledger.project()
        progress: list[tuple[int, int]] = []
        everything = await export_dataset(
            ledger,
            tmp_path / "all.parquet",
            row_group_size=2,
            on_progress=lambda done, total: progress.append((done, total)),
        )
        val_steps = await export_dataset(
            ledger, tmp_path / "val.parquet", partition="val", steps="1:2"
        )
        wins = await export_dataset(
            ledger, tmp_path / "wins.parquet", include_failed=False, per="trajectory"
        )

    assert (
        everything.states == {"succeeded": 2, "failed": 2, "cancelled": 1} and everything.rows == 5
    )
    assert progress == [
        (2, 5),
        (4, 5),
        (5, 5),
    ]  # pages of 2 sessions, keyed on (uid, session_id), none twice
    import pyarrow.parquet as pq

    assert (
        pq.ParquetFile(tmp_path / "all.parquet").metadata.num_row_groups == 3
    )  # one row group per page
    rows = {r["session_id"]: r for r in rows_of(tmp_path / "all.parquet")}
    assert list(rows_of(tmp_path / "all.parquet")[0]) == file_columns()
    a, b, c, d, e = (rows[k] for k in "abcde")
    assert (
        a["run"],
        a["uid"],
        a["partition"],
        a["global_step"],
        a["group_size"],
        a["session_index"],
    ) == ("r1", "ua", "val", 1, 1, 0)
    assert (
        a["reward"] == 1.0
        and a["score_source"] == "reward_info"
        and json.loads(a["reward_info"]) == {"judge": "x", "reward": 1.0}
    )
    assert_tokens(a, MIXED[0].trajectories[0])
    assert (
        b["state"] == "failed"
        and b["error_type"] == "SandboxError"
        and b["message"] == "sandbox died"
        and b["placeholder"]
    )
    assert_tokens(b, MIXED[1].trajectories[0])  # a failure's last recorded trajectory
    assert c["state"] == "cancelled" and c["message"] == "stopped" and c["prompt_ids"] is None
    assert_tokens(d, MIXED[3].trajectories[1])  # succeeded with 'all': the last selected
    assert d["selected_rows"] == 2 and d["trajectory_index"] == 1
    assert e["global_step"] is None and e["prompt_ids"] is None
    assert a["created_at"].tzinfo is not None and a["terminal_at"] >= a["created_at"]
    assert a["created_position"] < a["terminal_position"]

    assert sorted(r["session_id"] for r in rows_of(tmp_path / "val.parquet")) == ["a", "b", "c"]
    assert val_steps.states == {"succeeded": 1, "failed": 1, "cancelled": 1}
    won = rows_of(tmp_path / "wins.parquet")
    assert [(r["session_id"], r["trajectory_index"]) for r in won] == [("a", 0), ("d", 0), ("d", 1)]
    assert wins.excluded_failures == 3 and all(r["selected"] for r in won)
    assert_tokens(won[1], MIXED[3].trajectories[0])


@pytest.fixture
def mixed_db(tmp_path: Path) -> Path:
    path = tmp_path / "mixed.db"

    async def go() -> None:
        async with Ledger.open(str(path), run="r1") as ledger:
            await record(ledger, MIXED)
            await ledger.project()

    asyncio.run(go())
    return path


def test_jsonl_and_parquet_hold_the_same_rows_and_datasets_reads_the_parquet(
    mixed_db: Path, tmp_path: Path
) -> None:
    class Chars:
        def decode(self, ids: list[int]) -> str:
            return " ".join(f"t{i}" for i in ids)

    async def go() -> None:
        for fmt in ("parquet", "jsonl"):
            await export_dataset(
                str(mixed_db), tmp_path / f"out.{fmt}", format=fmt, tokenizer=Chars()
            )

    asyncio.run(go())
    parquet, jsonl = rows_of(tmp_path / "out.parquet"), rows_of(tmp_path / "out.jsonl")
    assert list(parquet[0]) == file_columns(text=True)
    for p, j in zip(parquet, jsonl):
        for name in (
            "session_id",
            "state",
            "prompt_ids",
            "response_ids",
            "response_mask",
            "reward",
            "reward_info",
            "prompt_text",
        ):
            assert (list(p[name]) if isinstance(p[name], list) else p[name]) == (
                list(j[name]) if isinstance(j[name], list) else j[name]
            ), name
    a = next(r for r in parquet if r["session_id"] == "a")
    assert a["prompt_text"] == "t1 t2 t3" and a["response_text"] == "t4 t5"
    line = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+\+00:00$", line["created_at"])

    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset(
        "parquet",
        data_files=str(tmp_path / "out.parquet"),
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    assert loaded.num_rows == 5
    assert str(loaded.features["prompt_ids"].feature.dtype) == "int32"
    first = loaded.filter(lambda r: r["session_id"] == "a")[0]
    assert (
        first["prompt_ids"] == [1, 2, 3]
        and first["response_mask"] == [1, 0]
        and first["state"] == "succeeded"
    )
    from_jsonl = datasets.load_dataset(
        "json",
        data_files=str(tmp_path / "out.jsonl"),
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    assert from_jsonl.num_rows == 5 and sorted(from_jsonl["session_id"]) == list("abcde")


# ------------------------------------------------------------------ bad input
def test_an_unknown_run_is_refused_naming_the_runs_and_a_selection_of_nothing_is_an_empty_file(
    mixed_db: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        ExportError, match=r"run 'nope' has no sessions in this database \(runs here: 'r1'\)"
    ):
        asyncio.run(export_dataset(str(mixed_db), tmp_path / "x.parquet", run="nope"))
    assert not (tmp_path / "x.parquet").exists()
    summary = asyncio.run(export_dataset(str(mixed_db), tmp_path / "none.parquet", steps=(50, 60)))
    assert summary.rows == 0 and "the export is empty" in summary.lines()[1]
    relation = duckdb.sql(f"SELECT * FROM '{tmp_path / 'none.parquet'}'")
    assert relation.fetchall() == [] and relation.columns == file_columns()


def test_a_database_without_events_is_refused(tmp_path: Path) -> None:
    async def go() -> None:
        async with Ledger.open(str(tmp_path / "empty.db")) as ledger:
            await export_dataset(ledger.engine, tmp_path / "x.parquet")

    with pytest.raises(ExportError, match="no events yet"):
        asyncio.run(go())


def test_a_run_of_failures_only_exports_them_and_successes_only_is_empty(tmp_path: Path) -> None:
    plan = [
        Plan("f1", "failed", [([1], [2, 3], [1, 1], None)]),
        Plan("f2", "failed"),
        Plan("f3", "cancelled"),
    ]

    async def go() -> tuple[Any, Any]:
        async with Ledger.open(str(tmp_path / "f.db")) as ledger:
            await record(ledger, plan)
            await ledger.project()
            return (
                await export_dataset(ledger, tmp_path / "all.parquet"),
                await export_dataset(ledger, tmp_path / "ok.parquet", include_failed=False),
            )

    everything, successes = asyncio.run(go())
    assert everything.states == {"succeeded": 0, "failed": 2, "cancelled": 1}
    assert [(r["session_id"], r["state"]) for r in rows_of(tmp_path / "all.parquet")] == [
        ("f1", "failed"),
        ("f2", "failed"),
        ("f3", "cancelled"),
    ]
    assert successes.rows == 0 and successes.excluded_failures == 3
    assert any("left out 3 failed or cancelled" in line for line in successes.lines())
    assert duckdb.sql(f"SELECT count(*) FROM '{tmp_path / 'ok.parquet'}'").fetchall() == [(0,)]


def test_a_run_still_being_written_is_exported_up_to_the_checkpoint_and_says_so(
    tmp_path: Path,
) -> None:
    async def go() -> Any:
        async with Ledger.open(str(tmp_path / "live.db")) as ledger:
            await record(
                ledger,
                [
                    Plan("old", "succeeded", [([1], [2], [1], None)]),
                    Plan("running", "open", [([1], [2], [1], None)]),
                ],
            )
            await ledger.project()
            await record(
                ledger, [Plan("new", "succeeded", [([3], [4], [1], None)])]
            )  # not projected yet
            handle = await ledger.load_session("running")
            await handle.complete()  # its end is past the checkpoint too
            return await export_dataset(ledger, tmp_path / "live.parquet")

    summary = asyncio.run(go())
    assert [r["session_id"] for r in rows_of(tmp_path / "live.parquet")] == ["old"]
    assert (
        summary.open_sessions == 1
        and summary.behind > 0
        and summary.log_end == summary.checkpoint + summary.behind
    )
    text = "\n".join(summary.lines())
    assert f"as of the projector's checkpoint (position {summary.checkpoint})" in text
    assert "left out 1 session(s) not terminal" in text and "rollout-ledger project" in text


def test_a_projector_moving_on_during_the_export_does_not_change_what_it_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cut is the checkpoint when the export began: a session whose end the projector
    projects meanwhile is left out (and counted), not half in."""
    from store import export_reads

    async def go() -> Any:
        async with Ledger.open(str(tmp_path / "moving.db")) as ledger:
            await record(ledger, [Plan("early", "succeeded", [([1], [2], [1], None)])])
            await ledger.project()
            async with ledger.engine.connect() as conn:
                began = await export_reads.snapshot(conn)
            await record(ledger, [Plan("late", "failed", [([5], [6], [1], None)])])
            await ledger.project()  # the projector moves on "during" the export

            async def at_start(conn: Any) -> tuple[int, int]:
                return began

            monkeypatch.setattr(export_reads, "snapshot", at_start)
            return await export_dataset(ledger, tmp_path / "cut.parquet")

    summary = asyncio.run(go())
    assert [r["session_id"] for r in rows_of(tmp_path / "cut.parquet")] == ["early"]
    assert (
        summary.states == {"succeeded": 1, "failed": 0, "cancelled": 0}
        and summary.open_sessions == 0
    )


def test_a_path_that_cannot_be_written_is_refused_and_a_failed_write_leaves_nothing(
    mixed_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ExportError, match=r"folder .*missing does not exist"):
        asyncio.run(export_dataset(str(mixed_db), tmp_path / "missing" / "x.parquet"))
    with pytest.raises(ExportError, match="is a directory"):
        asyncio.run(export_dataset(str(mixed_db), tmp_path))
    not_a_folder = tmp_path / "file.txt"
    not_a_folder.write_text("x")
    with pytest.raises(ExportError, match="does not exist"):
        asyncio.run(export_dataset(str(mixed_db), not_a_folder / "x.parquet"))

    target = tmp_path / "keep.parquet"
    target.write_bytes(b"the previous export")
    from sessions.export import writers

    def full_disk(self: Any, page: Any, rows: int) -> None:
        raise writers._wrap_os_error(self.target.path, OSError(28, "No space left on device"))

    for cls, fmt in ((writers.ParquetWriter, "parquet"), (writers.JsonlWriter, "jsonl")):
        with monkeypatch.context() as patch:
            patch.setattr(cls, "write", full_disk)
            with pytest.raises(
                ExportError,
                match=f"cannot write the export to {re.escape(str(target))}: No space left",
            ):
                asyncio.run(export_dataset(str(mixed_db), target, format=fmt))
        assert target.read_bytes() == b"the previous export"
        assert (
            sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
        )  # no temporary file left


def test_without_pyarrow_parquet_names_the_extra_and_jsonl_still_works(
    mixed_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(ExportError, match=re.escape("pip install -e '.[export]'")):
        asyncio.run(export_dataset(str(mixed_db), tmp_path / "x.parquet"))
    summary = asyncio.run(export_dataset(str(mixed_db), tmp_path / "x.jsonl", format="jsonl"))
    assert summary.rows == 5 and len((tmp_path / "x.jsonl").read_text().splitlines()) == 5


def test_bad_options_are_refused_before_reading(mixed_db: Path, tmp_path: Path) -> None:
    for kwargs, message in (
        ({"format": "csv"}, "format must be one of parquet, jsonl"),
        ({"per": "group"}, "per must be 'session'"),
        ({"partition": "test"}, "partition: 'test' is not a partition; use 'train' or 'val'"),
        ({"run": ""}, "run: must be a non-empty string"),
        ({"steps": "3:1"}, "the first step 3 is after the last 1"),
        ({"steps": "a:b"}, "expected A:B"),
        ({"row_group_size": 0}, "row_group_size must be an integer >= 1"),
    ):
        with pytest.raises(
            ExportError if {"format", "per", "row_group_size"} & set(kwargs) else ValueError,
            match=re.escape(message),
        ):
            asyncio.run(export_dataset(str(mixed_db), tmp_path / "x.parquet", **kwargs))


def test_columns_a_newer_revision_adds_are_exported_where_the_table_has_them(
    mixed_db: Path, tmp_path: Path
) -> None:
    """`attempts` and `failure_origin` are read from the database's own table: the same code
    exports a database with them (added here if this checkout's schema lacks them) and one
    without them (dropped here if it has them)."""
    import sqlite3

    conn = sqlite3.connect(mixed_db)
    present = {row[1] for row in conn.execute("PRAGMA table_info(sessions)")}
    if "attempts" not in present:
        conn.execute("ALTER TABLE sessions ADD COLUMN attempts INTEGER")
        conn.execute("ALTER TABLE sessions ADD COLUMN failure_origin VARCHAR(16)")
    conn.execute(
        "UPDATE sessions SET attempts = 2, failure_origin = CASE WHEN state = 'failed' THEN 'infra' END"
    )
    conn.commit()
    asyncio.run(export_dataset(str(mixed_db), tmp_path / "new.parquet"))
    rows = {r["session_id"]: r for r in rows_of(tmp_path / "new.parquet")}
    names = list(rows["a"])
    assert (
        names.index("attempts") == names.index("message") + 1
        and names.index("failure_origin") == names.index("attempts") + 1
    )
    assert (rows["a"]["attempts"], rows["a"]["failure_origin"]) == (2, None)
    assert (rows["b"]["attempts"], rows["b"]["failure_origin"]) == (2, "infra")
    assert {c.name for c in OPTIONAL_SESSION_COLUMNS} <= set(names)

    for (view,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'view'").fetchall():
        conn.execute(f"DROP VIEW {view}")  # SQLite refuses to drop a column a view names
    conn.execute("ALTER TABLE sessions DROP COLUMN attempts")
    conn.execute("ALTER TABLE sessions DROP COLUMN failure_origin")
    conn.commit()
    conn.close()
    asyncio.run(export_dataset(str(mixed_db), tmp_path / "old.parquet"))
    old = rows_of(tmp_path / "old.parquet")
    assert list(old[0]) == [c.name for c in COLUMNS] and len(old) == 5


# ------------------------------------------------------------------ the CLI verb
def cli(*args: str) -> int:
    from sessions.cli.main import main

    return main(list(args))


def test_the_cli_verb_writes_the_file_and_reports_what_it_left_out(
    mixed_db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli.jsonl"
    assert (
        cli(
            "export-dataset",
            "--db",
            str(mixed_db),
            "--out",
            str(out),
            "--steps",
            "1:3",
            "--successes-only",
            "--per",
            "trajectory",
        )
        == 0
    )
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(
        f"wrote 3 row(s), one per trajectory (2 succeeded), of run 'r1' to {out} (jsonl,"
    )
    assert printed[1] == "note: left out 2 failed or cancelled session(s) (successes only)"
    assert [json.loads(line)["session_id"] for line in out.read_text().splitlines()] == [
        "a",
        "d",
        "d",
    ]
    assert (
        cli(
            "export-dataset",
            "--db",
            str(mixed_db),
            "--out",
            str(tmp_path / "p.parquet"),
            "--partition",
            "train",
        )
        == 0
    )
    assert duckdb.sql(
        f"SELECT session_id, response_ids FROM '{tmp_path / 'p.parquet'}'"
    ).fetchall() == [("d", [8, 8, 8])]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--out", "{tmp}/missing/x.parquet"],
            "cannot write --out {tmp}/missing/x.parquet: folder {tmp}/missing does not exist",
        ),
        (["--out", "{tmp}"], "cannot write --out {tmp}: it is a directory"),
        (["--out", "{tmp}/x.parquet", "--steps", "5:2"], "the first step 5 is after the last 2"),
        (["--out", "{tmp}/x.parquet", "--steps", "x"], "expected A:B"),
        (
            ["--out", "{tmp}/x.jsonl", "--format", "parquet"],
            "--format parquet contradicts --out {tmp}/x.jsonl",
        ),
        (
            ["--out", "{tmp}/x.parquet", "--run", "zzz"],
            "run 'zzz' has no sessions in this database (runs here: 'r1')",
        ),
    ],
)
def test_the_cli_verb_refuses_bad_input_in_one_line(
    mixed_db: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    filled = [a.format(tmp=tmp_path) for a in args]
    assert cli("export-dataset", "--db", str(mixed_db), *filled) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(PREFIX), err
    assert message.format(tmp=tmp_path) in err[0]
    assert not (tmp_path / "x.parquet").exists() and not (tmp_path / "x.jsonl").exists()


# ------------------------------------------------------------------ docs/export.md stays the code's
EXPORT_DOC = REPO / "docs" / "export.md"


def test_the_page_documents_every_column_the_code_writes_with_its_type() -> None:
    section = EXPORT_DOC.read_text(encoding="utf-8").split("## Columns", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, re.MULTILINE)
    code = [*COLUMNS, *OPTIONAL_SESSION_COLUMNS, *TEXT_COLUMNS]
    assert sorted(name for name, _ in documented) == sorted(c.name for c in code)
    types = dict(documented)
    for c in code:
        kind = "timestamp" if c.type == "timestamp" else c.type
        assert types[c.name].strip().startswith(kind), (c.name, types[c.name])
        assert types[c.name].strip().endswith("null") == c.nullable, (c.name, types[c.name])


def test_the_pages_sql_runs_on_exports_named_as_there(
    mixed_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    asyncio.run(export_dataset(str(mixed_db), "rollouts.parquet"))
    asyncio.run(
        export_dataset(
            str(mixed_db), "val.jsonl", format="jsonl", partition="val", include_failed=False
        )
    )
    block = re.search(
        r"^```sql\n(.*?)^```$", EXPORT_DOC.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL
    )
    assert block
    statements = [s.strip() for s in block.group(1).split(";") if s.strip()]
    results = [duckdb.sql(s).fetchall() for s in statements]
    assert all(results), "every documented query returns rows on the mixed run"
    assert sum(n for _, _, n in results[0]) == 5
    by_step = {(p, s): (honest, survivors) for p, s, honest, survivors in results[1]}
    assert by_step[("val", 1)] == (
        pytest.approx(0.5),
        pytest.approx(1.0),
    )  # a: 1.0, b failed: 0 -> 0.5; survivors 1.0
