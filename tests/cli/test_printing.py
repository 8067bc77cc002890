"""The CLI prints what is stored, as stored, and fits the terminal (issue: the terminal and the docs).

Stored text full of rich markup (`[/x]` crashed `sql` and `history`, `[bold]` was deleted),
control characters and bytes goes through `sql`, `history`, `metrics` and the demo summary; `sql`
stops a runaway statement, checks a long one in linear time and says when the read models lag.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from sessions import Ledger
from sessions.cli.demo import DemoConfig, example_session, next_commands
from sessions.cli.errors import EXIT_BROKEN_PIPE
from sessions.cli.render import metrics_table, shown, summary_table, visible
from store.reads.console import QueryTimeout, check_read_only, run_query
from tests.cli.test_sql import calls_examples, doc_examples
from tests.cli.test_verbs import _command, cli, ok

RUN = "run[/x]"
SOURCE = "[bold]src[/bold]"
UID = "[/x]uid"
MESSAGE = "[bold]boom[/bold] [/x] [red]\x1b[31mred\x07 done\nnext line"
MARKUP = ("[/x]", "[bold]", "[/bold]", "[red]")


def runner(reward: float | None = None, fail: BaseException | None = None):  # type: ignore[no-untyped-def]
    async def run(h):  # type: ignore[no-untyped-def]
        await h.record_trajectory(prompt_ids=[1, 2, 3], response_ids=[4, 5])
        if reward is not None:
            await h.post_reward(reward)
        if fail is not None:
            raise fail

    return run


@pytest.fixture(scope="module")
def marked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite ledger whose run, uid, data source and failure message are markup and control characters."""
    import asyncio

    db = tmp_path_factory.mktemp("printing") / "marked.db"

    async def record() -> None:
        async with Ledger.open(str(db), run=RUN) as ledger:
            identity = dict(
                uid=UID, group_size=2, partition="val", global_step=0, data_source=SOURCE
            )
            await ledger.run_session(runner(1.0), f"{UID}-s0", session_index=0, **identity)
            await ledger.run_session(
                runner(fail=RuntimeError(MESSAGE)), f"{UID}-s1", session_index=1, **identity
            )
            await ledger.project()

    asyncio.run(record())
    return db


def test_sql_prints_markup_and_control_characters_verbatim(marked: Path) -> None:
    result = ok(
        cli(
            "sql",
            "SELECT run, uid, data_source, message FROM sessions WHERE state = 'failed'",
            "--db",
            str(marked),
            cwd=marked.parent,
        )
    )
    for text in (RUN, UID, SOURCE, visible(MESSAGE)):
        assert text in result.stdout, f"{text!r} not shown verbatim:\n{result.stdout}"
    assert "\\x1b[31mred\\x07" in result.stdout and "\\nnext line" in result.stdout
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert result.stderr == ""


def test_sql_prints_binary_as_length_and_hex(marked: Path) -> None:
    result = ok(
        cli(
            "sql",
            "SELECT position, payload FROM events ORDER BY position",
            "--db",
            str(marked),
            cwd=marked.parent,
        )
    )
    assert "bytes>" in result.stdout, result.stdout
    listed = json.loads(
        ok(
            cli(
                "sql",
                "SELECT payload FROM events WHERE payload IS NOT NULL",
                "--json",
                "--db",
                str(marked),
                cwd=marked.parent,
            )
        ).stdout
    )
    assert listed and all(
        len(row["payload"]["hex"]) == 2 * row["payload"]["bytes"] for row in listed
    )
    assert shown(b"\x00\x01\xff" * 10) == "<30 bytes> 0001ff0001ff0001…"


def test_sql_cuts_long_values_with_a_marker(marked: Path) -> None:
    result = ok(
        cli("sql", "SELECT '" + "x" * 5000 + "' AS long", "--db", str(marked), cwd=marked.parent)
    )
    assert "(+4800 chars)" in result.stdout
    assert "x" * 5000 not in result.stdout


def test_sql_column_names_are_not_markup(marked: Path) -> None:
    result = ok(cli("sql", 'SELECT 1 AS "[bold]n[/x]"', "--db", str(marked), cwd=marked.parent))
    assert "[bold]n[/x]" in result.stdout


def test_history_prints_stored_text_verbatim(marked: Path) -> None:
    result = ok(cli("history", f"{UID}-s1", "--db", str(marked), cwd=marked.parent))
    assert f"session {UID}-s1" in result.stdout
    for text in (RUN, UID, SOURCE):
        assert text in result.stdout, result.stdout
    assert "[bold]boom[/bold] [/x] [red]\\x1b[31mred\\x07" in result.stdout.replace("\n", ""), (
        result.stdout
    )


def test_metrics_names_the_run_and_shows_data_sources_verbatim(marked: Path) -> None:
    result = ok(cli("metrics", "--db", str(marked), cwd=marked.parent))
    assert result.stdout.startswith(f"run '{RUN}' (the most recent"), result.stdout
    assert SOURCE in result.stdout and "failed/runner_error" in result.stdout


@pytest.mark.parametrize(
    "verb", [("metrics", "--json"), ("metrics",), ("sql", "SELECT * FROM events")]
)
def test_output_into_a_closed_pipe_ends_quietly(marked: Path, verb: tuple[str, ...]) -> None:
    reader = subprocess.Popen(
        [*_command(), *verb, "--db", str(marked)],
        cwd=marked.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert reader.stdout is not None
    reader.stdout.close()  # gone before the first write: every write meets EPIPE
    _, err = reader.communicate(timeout=120)
    assert reader.returncode == EXIT_BROKEN_PIPE, (
        err
    )  # what a shell reports for a pipe closed early
    assert b"Traceback" not in err and b"Broken pipe" not in err and b"BrokenPipe" not in err, err
    args = " ".join(shlex.quote(a) for a in verb)
    piped = subprocess.run(
        f"'{_command()[0]}' {args} --db '{marked}' | head -1",
        shell=True,
        cwd=marked.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert len(piped.stdout.splitlines()) == 1 and piped.stderr == "", piped.stderr


def fits(renderable: Any, width: int = 80) -> str:
    out = Console(width=width, record=True, color_system=None)
    out.print(renderable)
    text = out.export_text()
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width, text
    return text


async def test_demo_summary_fits_80_columns_and_keeps_markup(marked: Path) -> None:
    async with Ledger.open(str(marked), run=RUN) as ledger:
        rows = await ledger.metrics()
    text = fits(summary_table(rows, f"run {RUN} — db x"))
    assert f"run {RUN}" in text and "val 0" in text and "@2 0.5" in text and "runner_error" in text


async def test_demo_summary_and_metrics_fit_80_columns_on_a_real_demo(sqlite_url: str) -> None:
    from sessions.cli.demo import run_demo

    config = DemoConfig(steps=2, prompts=6, group_size=4, fail_rate=0.4, cancel_rate=0.1, seed=3)
    async with Ledger.open(sqlite_url, run="demo-fit") as ledger:
        await run_demo(ledger, config)
        await ledger.project()
        rows = await ledger.metrics()
    text = fits(summary_table(rows, "run demo-fit — db sqlite"))
    for where in ("train 0", "train 1", "val 0", "val 1"):
        assert where in text
    for name in (
        "succeeded",
        "cancelled",
        "unsettled",
        "placeholders",
        "success_only",
        "mean@N",
        "per_uid",
    ):
        assert name in text
    listed = fits(metrics_table(rows))
    for name in {r.metric for r in rows}:
        assert name in listed, name  # full names, never cut


def test_demo_closing_lines_suggest_commands_that_run(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    result = ok(
        cli(
            "demo",
            "--db",
            str(db),
            "--steps",
            "1",
            "--prompts",
            "2",
            "--group-size",
            "2",
            "--run",
            "fit",
            cwd=tmp_path,
        )
    )
    assert "events/s" not in result.stdout and "next, try:" in result.stdout
    commands = next_commands(
        "fit", str(db), example_session("fit", DemoConfig(steps=1, prompts=2, group_size=2))
    )
    for command in commands:
        assert command in result.stdout
        assert command.startswith("rollout-ledger ")
        ran = subprocess.run(
            f"'{_command()[0]}' {command.removeprefix('rollout-ledger ')}",
            shell=True,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0 and "Traceback" not in ran.stderr, (command, ran.stderr)
    assert "fit" in ran.stdout and ran.stdout.rstrip().endswith("row(s)"), (
        ran.stdout
    )  # the sql suggestion found the run


# ------------------------------------------------------------------ sql: timeout, check, lag


async def test_sql_stops_a_runaway_statement_at_its_timeout(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        runaway = (
            "SELECT pg_sleep(20)"
            if ledger.engine.dialect.name == "postgresql"
            else "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
        )
        started = time.monotonic()
        with pytest.raises(QueryTimeout, match="0.5 s statement timeout"):
            await run_query(ledger.engine, runaway, timeout=0.5)
        assert time.monotonic() - started < 10
        # the pooled connection is usable, without a deadline, afterwards
        assert (await run_query(ledger.engine, "SELECT 1 AS one"))[1] == [(1,)]
        await ledger.run_session(
            runner(1.0),
            "after-s0",
            uid="after",
            session_index=0,
            group_size=1,
            partition="val",
            global_step=0,
        )
        assert await ledger.project() > 0


def test_cli_sql_timeout_is_one_line_naming_the_timeout(marked: Path) -> None:
    runaway = (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    )
    result = cli("sql", runaway, "--timeout", "0.5", "--db", str(marked), cwd=marked.parent)
    assert result.returncode != 0
    assert (
        len(result.stderr.strip().splitlines()) == 1 and "0.5 s statement timeout" in result.stderr
    ), result.stderr


@pytest.mark.parametrize(
    "filler",
    ["-- a comment; with /* a ' quote\n", "/* a ; b */ ", "/*", "'", "x ';' \"y;\" $t$;$t$ "],
)
def test_the_statement_check_is_linear(filler: str) -> None:
    statement = "SELECT 1 " + filler * (200_000 // len(filler))
    assert len(statement) >= 199_000
    started = time.perf_counter()
    try:
        check_read_only(statement)
    except ValueError:
        pass  # an unterminated quote is the database's to reject; only the time matters here
    assert time.perf_counter() - started < 0.5


def test_sql_notes_on_stderr_when_the_projector_is_behind(tmp_path: Path) -> None:
    import asyncio

    db = tmp_path / "behind.db"

    async def record() -> None:
        async with Ledger.open(str(db)) as ledger:
            await ledger.run_session(
                runner(1.0),
                "a-s0",
                uid="a",
                session_index=0,
                group_size=1,
                partition="val",
                global_step=0,
            )

    asyncio.run(record())
    result = ok(cli("sql", "SELECT COUNT(*) AS n FROM sessions", "--db", str(db), cwd=tmp_path))
    assert "behind the log" in result.stderr and "rollout-ledger project" in result.stderr, (
        result.stderr
    )
    ok(cli("project", "--db", str(db), cwd=tmp_path))
    assert (
        ok(cli("sql", "SELECT COUNT(*) AS n FROM sessions", "--db", str(db), cwd=tmp_path)).stderr
        == ""
    )


# ------------------------------------------------------------------ docs/sql.md against the demo


async def test_docs_examples_run_against_the_demo_as_printed(tmp_path: Path) -> None:
    """Every example runs on a fresh demo database; those about one run find the demo's (the latest)."""
    import asyncio

    db = tmp_path / "demo.db"
    await asyncio.to_thread(
        lambda: ok(
            cli(
                "demo",
                "--db",
                str(db),
                "--steps",
                "2",
                "--prompts",
                "4",
                "--seed",
                "1",
                "--fail-rate",
                "0.4",
                cwd=tmp_path,
            )
        )
    )
    over_calls = {sql for _, sql in calls_examples()}
    async with Ledger.open(str(db)) as ledger:
        for expected, sql in doc_examples():
            columns, rows = await run_query(ledger.engine, sql)
            assert [c.lower() for c in columns] == expected, sql
            if sql in over_calls:  # no call without --calls: tests/cli/test_sql_calls.py runs them
                continue
            if "run =" in sql or "session_id =" in sql or "uid =" in sql:
                assert rows, f"docs/sql.md example found nothing in the demo:\n{sql}"
