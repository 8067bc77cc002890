"""The examples run as a user runs them (a subprocess, from the repository root) and say what they did."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests import REPO
from tests.conftest import run_script

pytestmark = [pytest.mark.verl_env, pytest.mark.usefixtures("verl_installed")]

REPO = REPO
#: The example must finish well inside a minute on CPU; this bound only keeps a hang from stalling CI.
TIMEOUT = 120


def run_example(name: str) -> tuple[subprocess.CompletedProcess[str], float]:
    return run_script(REPO / "examples" / name, timeout=TIMEOUT)


def metric(output: str, name: str) -> float:
    found = re.search(rf"^\s+{re.escape(name)} = (-?[0-9.]+)$", output, re.MULTILINE)
    assert found, f"{name} not printed:\n{output}"
    return float(found.group(1))


def test_verl_grpo_step_trains_one_step_on_ledger_batches_with_verls_own_functions() -> None:
    done, seconds = run_example("verl_grpo_step.py")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert seconds < 60, f"the example took {seconds:.1f}s"
    # its plan: 4 prompts x 4 sessions, 3 failed (placeholders), 2 cancelled (no row)
    assert out.count(": failed (") == 3 and out.count(": cancelled") == 2, out
    assert "batch: 14 rows (3 placeholders)" in out
    ledger = "ledger/train/all/"
    assert [
        metric(out, ledger + name)
        for name in ("sessions/total", "sessions/failed", "sessions/cancelled")
    ] == [16, 3, 2]
    assert metric(out, "critic/score/mean") == pytest.approx(
        metric(out, ledger + "reward/mean"), abs=1e-6
    )
    shared = re.search(
        r"^verl's compute_data_metrics equals the ledger's metrics_dict on all (\d+) names",
        out,
        re.MULTILINE,
    )
    assert shared and int(shared.group(1)) >= 10, (
        out
    )  # critic/score/*, response_length/*, num_turns/*, ...
    assert "verl critic/score/mean equals the ledger's reward/mean" in out
    assert re.search(r"^loss = -?[0-9.]+ .*grad norm [0-9.]*[1-9]", out, re.MULTILINE), (
        out
    )  # a non-zero gradient
    assert "placeholder rows: 3, their gradients are exactly 0" in out
    assert out.rstrip().endswith("optimizer step done")
