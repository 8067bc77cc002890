"""TRL's `resume_from_checkpoint` through the ledger: a training process killed in the middle of a
step's rollouts, started again from its last checkpoint, re-runs the step with new uids. The
resumed launch fails the dead one's open sessions at once (no `recover`), its reward function
never waits on them, and the re-run step's figures are its own sessions' only: what TRL logged
for the step equals the ledger's figures of the step (docs/design.md §14).

Each launch is a process of its own (`resume_job.py`), the first one ended by `os._exit` inside
a runner. Both backends.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from sessions import SyncLedger
from store import create_engine
from tests import REPO
from tests.conftest import BACKENDS
from tests.integrations.trl.test_trl import ROWS, require_trl


def _job() -> Any:
    """`resume_job`, which imports TRL at its top: imported once `require_trl()` has passed, so
    the module collects where TRL is not installed (the verl-pins environment)."""
    from tests.integrations.trl import resume_job

    return resume_job


def _launch(url: str, folder: Path, phase: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.integrations.trl.resume_job", url, str(folder), phase],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "TRL_EXPERIMENTAL_SILENCE": "1"},
    )


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_killed_trl_run_resumed_from_its_checkpoint_counts_the_re_run_step_once(
    db_url: str, tmp_path: Path
) -> None:
    require_trl()
    job = _job()
    crashed = _launch(db_url, tmp_path, "crash")
    assert crashed.returncode == job.EXIT_CODE, crashed.stderr[-3000:]
    assert (tmp_path / f"checkpoint-{job.CRASH_STEP}").is_dir()

    resumed = _launch(db_url, tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = json.loads(resumed.stdout.strip().splitlines()[-1])
    # The checkpoint brings the first launch's log entries back; the resumed launch adds its own.
    assert [entry["step"] for entry in log] == list(range(1, job.STEPS + 1))

    with SyncLedger.open(db_url, run=job.RUN, migrate=False) as ledger:
        step = {
            r.metric: r.value
            for r in ledger.metrics("train", job.CRASH_STEP)
            if r.data_source is None
        }
        # The re-run step is the resumed launch's: every row of it, none of the dead launch's.
        assert step["launch"] == 2
        assert step["sessions/total"] == ROWS and step["sessions/open"] == 0
        assert step["sessions/superseded"] >= 1  # at least the session that died with its process
        rewards = [job.reward_of(job.CRASH_STEP, row) for row in range(ROWS)]
        assert step["reward/mean"] == pytest.approx(sum(rewards) / ROWS)
        entry = log[job.CRASH_STEP]  # TRL's log of the re-run step, and the ledger's figures
        assert entry["reward"] == pytest.approx(step["reward/mean_success_only"], abs=1e-6)
        assert entry["ledger/train/all/sessions/total"] == ROWS
        assert entry["ledger/train/all/reward/mean"] == pytest.approx(step["reward/mean"])
        assert ledger.batch("train", job.CRASH_STEP, timeout=5).batch_size[0] == ROWS
    open_, superseded = asyncio.run(_counts(db_url))
    # Nothing of the dead launch is left open, and SQL shows what was superseded.
    assert open_ == 0
    assert superseded == step["sessions/superseded"]


async def _counts(url: str) -> tuple[int, int]:
    """Open sessions of the run, and superseded ones of the re-run step, read through SQL."""
    job = _job()
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            open_ = (
                await conn.execute(
                    text(
                        "SELECT COUNT(*) FROM sessions WHERE run = :run "
                        "AND state IN ('created', 'running', 'retrying')"
                    ),
                    {"run": job.RUN},
                )
            ).scalar_one()
            superseded = (
                await conn.execute(
                    text(
                        "SELECT COUNT(*) FROM session_launches WHERE run = :run "
                        "AND global_step = :step AND superseded = 1"
                    ),
                    {"run": job.RUN, "step": job.CRASH_STEP},
                )
            ).scalar_one()
    finally:
        await engine.dispose()
    return int(open_), int(superseded)
