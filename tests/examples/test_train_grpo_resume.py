"""examples/train_grpo.py killed mid-step and started again with `--resume` (docs/design.md §14).

The first launch trains with a checkpoint after every step and dies (`os._exit`) inside step
`CRASH`'s rollouts, some of its sessions open. The second, `--resume`, goes on from the
checkpoint as a new launch and re-runs that step with new uids. The ledger failed the dead
launch's open sessions when the new one opened, the re-run step counts the new launch's sessions
only, the resumed run's own checks hold (verl's figures equal the ledger's at every step it ran,
audit and replay reproduce every figure it logged), and nothing is left open.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sessions import Ledger
from tests import REPO

pytestmark = [pytest.mark.verl_env, pytest.mark.usefixtures("verl_installed")]

RUN, STEPS, CRASH, EXIT_CODE = "grpo-resume", 4, 2, 17
SHAPE = "steps=4, prompts=4, group_size=4, val_prompts=4, val_every=2, seed=3, quiet=True"
#: The first launch: the rollouts of step CRASH end the process after a few generations.
FIRST = f"""
import os, sys
sys.path.insert(0, "examples")
import asyncio, train_grpo as t
real = t.rollouts
async def rollouts(ledger, sampler, faults, clock, batch, partition, step, group_size):
    if partition == "train" and step == {CRASH}:
        generate, calls = sampler.generate, []
        async def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) > 5:
                os._exit({EXIT_CODE})  # killed mid-step: sessions of this step stay open
            return await generate(*args, **kwargs)
        sampler.generate = dying
    return await real(ledger, sampler, faults, clock, batch, partition, step, group_size)
t.rollouts = rollouts
asyncio.run(t.train(t.Settings({SHAPE}, db=sys.argv[1], checkpoint=sys.argv[2], run="{RUN}")))
"""
#: The second launch: the example as it is, with --resume.
SECOND = f"""
import sys
sys.path.insert(0, "examples")
import asyncio, train_grpo as t
result = asyncio.run(t.train(t.Settings({SHAPE}, db=sys.argv[1], checkpoint=sys.argv[2], resume=True)))
assert [r.step for r in result.records] == list(range({CRASH}, {STEPS}))
assert not any(r.verl.differ for r in result.records), [r.verl.differ for r in result.records]
assert result.evidence.audit_ok and not result.evidence.differ, result.evidence
"""


def _launch(code: str, db: Path, checkpoint: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, str(db), str(checkpoint)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_a_killed_run_resumed_from_its_checkpoint_counts_the_re_run_step_once(
    tmp_path: Path,
) -> None:
    db, checkpoint = tmp_path / "train.db", tmp_path / "train.ckpt"
    first = _launch(FIRST, db, checkpoint)
    assert first.returncode == EXIT_CODE, first.stderr[-3000:]
    second = _launch(SECOND, db, checkpoint)
    assert second.returncode == 0, second.stderr[-3000:]

    async def figures() -> tuple[dict[str, float], dict[str, float]]:
        async with Ledger.open(f"sqlite+aiosqlite:///{db}", run=RUN, migrate=False) as ledger:

            def scope(step: int) -> dict[str, float]:
                return {r.metric: r.value for r in rows if r.global_step == step}

            rows = [r for r in await ledger.metrics("train") if r.data_source is None]
            return scope(CRASH), scope(CRASH - 1)

    re_run, before = asyncio.run(figures())
    assert re_run["launch"] == 2 and re_run["sessions/superseded"] >= 1
    assert re_run["sessions/total"] == 4 * 4 and re_run["sessions/open"] == 0
    assert "launch" not in before or before["launch"] == 1  # a step it did not re-run
    assert "sessions/superseded" not in before
