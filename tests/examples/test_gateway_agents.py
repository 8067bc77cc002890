"""examples/gateway_agents.py, run as a user runs it: its printed step is the ledger's.

The script runs once (a subprocess, from the repository root) into a SQLite file of the test's;
the test then opens that ledger and holds the script to it: each session failed exactly as the
script's seed planned (crash → `runner_error`, hang → `timeout`) with its first call kept, the
batch has one placeholder row per failed session and none else, the printed figures are the
ledger's, and the honest mean is below the success-only one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import REPO
from tests.conftest import run_script

pytest.importorskip("agents", reason="the example's agent is an OpenAI Agents SDK agent")
pytest.importorskip("starlette", reason="the gateway extra")

EXAMPLE = REPO / "examples" / "gateway_agents.py"
#: Only keeps a hang from stalling CI: the script's own hang is cut by its 8 s agent timeout.
TIMEOUT = 300
SCOPE = "ledger/train/all/"
#: the script's step: its run, 8 groups of 4 sessions
RUN, GROUPS, GROUP_SIZE = "gateway-example", 8, 4


def printed(output: str, pattern: str) -> re.Match[str]:
    found = re.search(pattern, output, re.MULTILINE)
    assert found, f"{pattern!r} not printed:\n{output}"
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    db = tmp_path_factory.mktemp("gateway-example") / "step.db"
    done, _ = run_script(EXAMPLE, "--db", str(db), timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, db


async def test_the_printed_step_is_the_ledgers(run: tuple[str, Path]) -> None:
    from sessions import Ledger

    output, db = run
    expected_reason = {"crash": "runner_error", "hang": "timeout"}
    injected = {}  # what the script says its seed chose
    for fault in expected_reason:
        chosen = printed(output, rf"^injected \(seed 0\): {fault} (.*)$").group(1).split(", ")
        injected.update(dict.fromkeys(chosen, fault))
    assert list(injected.values()).count("crash") == 3 and len(injected) == 5  # the defaults
    async with Ledger.open(str(db), run=RUN) as ledger:
        failed = {}
        for group in range(GROUPS):
            for index in range(GROUP_SIZE):
                session_id = f"q{group}-{index}"
                handle = await ledger.load_session(session_id)
                calls = len(handle.view.recorded_calls())
                if handle.state == "failed":
                    failed[session_id] = handle.view.failure_reason
                    assert calls == 1  # the tool call the agent made before it died, kept
                else:
                    assert handle.state == "succeeded" and calls == 2, session_id
        batch = await ledger.batch("train", 0, timeout=60)
        figures = await ledger.metrics_dict("train", 0, timeout=60)

    # the failures are exactly the injected ones, each with its reason
    assert failed == {sid: expected_reason[fault] for sid, fault in injected.items()}
    # one row per session; a placeholder row for each failed session and no other
    rows = list(batch["session_id"])
    placeholders = {rows[n] for n in range(len(rows)) if bool(batch["is_placeholder"][n])}
    assert len(rows) == GROUPS * GROUP_SIZE and placeholders == set(failed)
    assert sorted(batch["failure_reason"][rows.index(sid)] for sid in failed) == sorted(
        failed.values()
    )

    # what the script printed is the ledger's
    total, succeeded, failures = map(
        int, printed(output, r"^sessions: (\d+) \((\d+) succeeded, (\d+) failed\)$").groups()
    )
    assert (total, succeeded, failures) == (len(rows), len(rows) - len(failed), len(failed))
    by_reason = printed(output, r"^failures by reason: (.*)$").group(1)
    assert by_reason == "runner_error 3, timeout 2"
    assert figures[SCOPE + "failed/runner_error"] == 3 and figures[SCOPE + "failed/timeout"] == 2
    shape = printed(output, r"^batch: (\d+) rows, input_ids \((\d+), (\d+)\), (\d+) placeholder")
    assert int(shape.group(1)) == len(rows) and int(shape.group(4)) == len(failed)
    assert int(shape.group(3)) == batch["input_ids"].shape[1]
    means = {}
    for name in ("reward/mean", "reward/mean_success_only"):
        value = float(printed(output, rf"^\s+{re.escape(SCOPE + name)} = (-?[0-9.]+)").group(1))
        assert value == pytest.approx(figures[SCOPE + name], abs=5e-5)
        means[name] = figures[SCOPE + name]
    # failures count as zeros: the honest mean is below what dropping them would report
    assert 0 < means["reward/mean"] < means["reward/mean_success_only"]
    assert means["reward/mean"] == pytest.approx(
        means["reward/mean_success_only"] * succeeded / total, abs=1e-6
    )
