"""`demo --start-step N` grows an existing run, on SQLite and PostgreSQL: refused when
the run has steps >= N, when its demo settings differ, or when no run is named."""

from __future__ import annotations

import pytest

from sessions.cli.main import main

SMALL = ["--prompts", "2", "--group-size", "2", "--run", "g"]


def test_start_step_grows_a_run(db_url: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--db", db_url, "--steps", "2", *SMALL]) == 0
    assert main(["demo", "--db", db_url, "--steps", "2", "--start-step", "2", *SMALL]) == 0
    capsys.readouterr()
    assert main(["metrics", "--db", db_url, "--run", "g", "--json"]) == 0
    import json

    steps = {row["global_step"] for row in json.loads(capsys.readouterr().out)} - {None}
    assert steps == {0, 1, 2, 3}
    assert main(["audit", "--db", db_url]) == 0
    capsys.readouterr()
    # steps that exist already
    assert main(["demo", "--db", db_url, "--steps", "1", "--start-step", "3", *SMALL]) == 1
    assert "--start-step 4" in capsys.readouterr().err
    # another configuration of the same run
    changed = ["--prompts", "3", "--group-size", "2", "--run", "g"]
    assert main(["demo", "--db", db_url, "--steps", "1", "--start-step", "4", *changed]) == 1
    assert "another configuration" in capsys.readouterr().err


def test_start_step_needs_a_named_existing_run(db_url: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--db", db_url, "--steps", "1", "--start-step", "1"]) == 1
    assert "--run" in capsys.readouterr().err
    assert main(["demo", "--db", db_url, "--steps", "1", "--start-step", "1", *SMALL]) == 1
    assert "no steps" in capsys.readouterr().err


def test_an_outage_halts_the_demo_run_and_a_resume_goes_on(
    db_url: str, capsys: pytest.CaptureFixture
) -> None:
    """The sandbox service down from step 1: the breaker (25 infrastructure failures in a row)
    halts the run during step 1, step 2 is never started, the verb exits 1 naming the halt; a
    resume from step 2 (a new launch, the same fingerprint) records steps 2 and 3, and the log
    audits clean with the trip in it."""
    import json

    outage = ["--prompts", "8", "--group-size", "4", "--run", "o", "--seed", "3"]
    assert main(["demo", "--db", db_url, "--steps", "3", *outage, "--outage-from-step", "1"]) == 1
    error = capsys.readouterr().err
    assert "halted by its circuit breaker" in error and "sandbox_error ×25" in error
    assert main(["demo", "--db", db_url, "--steps", "2", "--start-step", "2", *outage]) == 0
    capsys.readouterr()
    assert main(["metrics", "--db", db_url, "--run", "o", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    failed = {
        r["global_step"]: r["value"]
        for r in rows
        if r["metric"] == "sessions/failed" and r["partition"] == "train" and not r["data_source"]
    }
    assert failed[1] == 32  # every train session of the outage step failed
    assert set(failed) == {0, 1, 2, 3}
    assert main(["audit", "--db", db_url]) == 0
