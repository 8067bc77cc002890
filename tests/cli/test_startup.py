"""The command line starts without what it does not need.

Each verb runs in a fresh interpreter, which then prints which of the watched libraries it
imported. Only the verbs in `NEEDS_HEAVY` may import one of torch, tensordict, pandas, matplotlib
and pyarrow, and only the one named. `--help` (the top level's and every verb's) and an argument
error import none of them and none of the database and array stack either (SQLAlchemy, Alembic,
the drivers, numpy, transitions, orjson): `sessions` and `store` load each name on first use, and
each verb imports its modules when it runs. The verb list is read from the parser, so a new verb
fails here until it has sample arguments below (and is either light or declared heavy).

Measure start-up by hand (median of 10 runs each):

    python -c "import statistics,subprocess,sys,time; t=[]; [
        (s:=time.perf_counter(), subprocess.run([sys.executable,'-m','sessions.cli','--help'],
        stdout=subprocess.DEVNULL), t.append(time.perf_counter()-s)) for _ in range(10)];
        print(statistics.median(t))"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "tensordict", "pandas", "matplotlib", "pyarrow")
#: What a command that opens no database does not need: ~1 s of imports on 2 cores.
STACK = ("sqlalchemy", "alembic", "aiosqlite", "asyncpg", "numpy", "transitions", "orjson")

#: The ledger's own engine, which a verb that only looks at a run does not start.
LEDGER_PARTS = ("sessions.ledger", "sessions.recorder", "sessions.projection.projector", "numpy")
#: The verbs a user types to look at a run: with the projector at the log's end they read the
#: tables (or fold one session's events) and start none of `LEDGER_PARTS`.
READ_VERBS = ("history", "metrics", "sql")
#: PostgreSQL's dialect modules, which `sql` on a SQLite file does not load: the package alone
#: is ~30-70 ms of a read verb's start on 2 cores.
POSTGRES_PARTS = ("sqlalchemy.dialects.postgresql", "store.dialects.postgresql")

#: The one declaration of which verbs legitimately need a heavy library, and which.
NEEDS_HEAVY = {
    "export": {"torch", "tensordict"},  # a batch written with torch.save
    "export-dataset": {"pyarrow"},  # Parquet
    "report": {"matplotlib"},  # the figures
}

_PROBE = """
import contextlib, io, json, sys
from sessions.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exit:
        code = exit.code
loaded = {{m.split('.')[0] for m in sys.modules}}
print(json.dumps({{"code": code, "heavy": sorted(loaded & set({HEAVY!r})),
                  "stack": sorted(loaded & set({STACK!r})),
                  "parts": sorted(set(sys.modules) & set({PARTS!r})),
                  "postgres": sorted(set(sys.modules) & set({POSTGRES!r})), "out": out.getvalue()}}))
""".format(HEAVY=HEAVY, STACK=STACK, PARTS=LEDGER_PARTS, POSTGRES=POSTGRES_PARTS)


def _verbs() -> list[str]:
    from sessions.cli.main import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(sub.choices)


def _probe(*argv: str, cwd: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _sample_arguments(db: str) -> dict[str, list[str]]:
    """A real run of every light verb against a small ledger (the verb list comes from the parser)."""
    return {
        "audit": ["audit", "--db", db],
        # serves until stopped: its sample is the refusal of a bad upstream, after the check
        # has imported the gateway extra's libraries
        "gateway": ["gateway", "--db", db, "--upstream", "not-a-url"],
        "backup": ["backup", "--db", db, "--out", str(Path(db).with_name("copy.db"))],
        "demo": ["demo", "--db", db, "--steps", "1", "--prompts", "1", "--group-size", "1"],
        "diagram": ["diagram"],
        "export-otel": [
            "export-otel",
            "--db",
            db,
            "--endpoint",
            "http://127.0.0.1:9/v1/traces",  # nothing answers: the export fails after its imports
            "--timeout",
            "1",
        ],
        "history": ["history", "no-such-session", "--db", db],
        "metrics": ["metrics", "--db", db],
        "migrate": ["migrate", "--db", db],
        "project": ["project", "--db", db],
        "prune": ["prune", "--db", db, "--keep-last", "5", "--dry-run"],
        "recover": ["recover", "--older-than", "1h", "--db", db],
        "replay": ["replay", "--db", db, "--into", str(Path(db).with_name("replayed.db"))],
        "sql": ["sql", "SELECT 1 AS one", "--db", db],
    }


@pytest.fixture(scope="module")
def small_ledger(tmp_path_factory: pytest.TempPathFactory) -> str:
    db = str(tmp_path_factory.mktemp("startup") / "ledger.db")
    result = _probe(
        "demo",
        "--db",
        db,
        "--steps",
        "1",
        "--prompts",
        "2",
        "--group-size",
        "2",
        "--run",
        "r",
        cwd=Path(db).parent,
    )
    assert result["code"] == 0
    return db


def test_help_imports_no_heavy_library_and_no_database_stack(tmp_path: Path) -> None:
    result = _probe("--help", cwd=tmp_path)
    assert (result["code"], result["heavy"], result["stack"], result["parts"]) == (0, [], [], [])


def test_an_argument_error_loads_no_database_stack(tmp_path: Path) -> None:
    result = _probe("report", "--dpi", "100000", cwd=tmp_path)
    assert (result["code"], result["heavy"], result["stack"], result["parts"]) == (2, [], [], [])


def test_every_verb_declared() -> None:
    samples = _sample_arguments("x.db")
    light = [verb for verb in _verbs() if verb not in NEEDS_HEAVY]
    assert sorted(samples) == light, "give each new verb sample arguments (or declare it heavy)"
    assert set(NEEDS_HEAVY) <= set(_verbs())


@pytest.mark.parametrize("verb", _verbs())
def test_verb_help_imports_no_heavy_library(verb: str, tmp_path: Path) -> None:
    result = _probe(verb, "--help", cwd=tmp_path)
    assert (result["code"], result["heavy"], result["stack"], result["parts"]) == (0, [], [], [])


@pytest.mark.parametrize("verb", [v for v in _verbs() if v not in NEEDS_HEAVY])
def test_light_verb_imports_no_heavy_library(verb: str, small_ledger: str) -> None:
    argv = _sample_arguments(small_ledger)[verb]
    result = _probe(*argv, cwd=Path(small_ledger).parent)
    assert result["heavy"] == [], f"{verb} imported {result['heavy']}"


@pytest.mark.parametrize("verb", READ_VERBS)
def test_a_read_verb_starts_no_ledger_engine(verb: str, small_ledger: str) -> None:
    argv = _sample_arguments(small_ledger)[verb]
    result = _probe(*argv, cwd=Path(small_ledger).parent)
    assert result["parts"] == [], f"{verb} started {result['parts']}"


def test_sql_on_a_sqlite_file_loads_no_postgresql_dialect(small_ledger: str) -> None:
    """`sql` touches no table definition, so nothing of PostgreSQL's is needed. (`metrics` and
    `history` import the schema, whose partial indexes name `postgresql_where`, and SQLAlchemy
    loads the PostgreSQL dialect package to check that argument.)"""
    argv = _sample_arguments(small_ledger)["sql"]
    result = _probe(*argv, cwd=Path(small_ledger).parent)
    assert result["code"] == 0 and result["postgres"] == [], result["postgres"]


def test_metrics_behind_the_log_projects_first_and_prints_what_the_fast_path_reads(
    tmp_path: Path,
) -> None:
    """Behind the log, `metrics` opens a Ledger and projects; at its end it reads the table
    straight: the two must print the same rows."""
    from tests.cli.test_errors import _recorded_db

    db = str(_recorded_db(tmp_path / "ledger.db", 9, 12, project=False))
    behind = _probe("metrics", "--db", db, "--json", cwd=tmp_path)
    current = _probe("metrics", "--db", db, "--json", cwd=tmp_path)
    assert behind["code"] == current["code"] == 0
    assert "sessions.projection.projector" in behind["parts"]
    assert current["parts"] == []
    rows = json.loads(behind["out"])
    assert rows and json.loads(current["out"]) == rows
    assert {"metric": "sessions/total", "value": 9} in [
        {"metric": r["metric"], "value": r["value"]}
        for r in rows
        if r["data_source"] is None and r["partition"] == "val"
    ]
