"""TRL under `accelerate launch` with 2 CPU processes and one PostgreSQL ledger (docs/trl.md).

Each rank gets 6 of a step's 12 rows, so one group of 4 is cut between the ranks; each rank
records its own sessions. The groups settle, TRL's reward (averaged over ranks by TRL) is the
ledger's success-only mean, and every figure of every step equals a one-process run of the same
prompts and failures. The file is also the worker: `python tests/integrations/trl/test_multiprocess.py URL
RUN ROWS_PER_RANK STEPS FOLDER`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
if __name__ == "__main__":  # the worker: the repository's packages before any installed ones
    sys.path.insert(0, str(ROOT))

from sessions import RetryPolicy, SyncLedger  # noqa: E402
from sessions.integrations.trl import LedgerRollout  # noqa: E402
from tests.integrations.trl.test_trl import Plan, figures, load_example, require_trl, trainer_for  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

STEP_ROWS = 12  # 3 prompts x 4 generations a step
STEPS = 2
#: (call, row): rows 4-7 are the group the ranks share (rank 0 holds 4 and 5, rank 1 6 and 7)
FAULTS: dict[tuple[int, int], list[str | None]] = {
    (0, 5): ["error"],
    (0, 6): ["sandbox", "sandbox"],
    (0, 9): ["sandbox"],  # retried, then succeeds
    (0, 11): ["bad"],
    (1, 2): ["hang"],
    (1, 4): ["error"],  # every session of the shared group fails
    (1, 5): ["sandbox", "sandbox"],
    (1, 6): ["hang"],
    (1, 7): ["error"],
}


def worker(
    url: str, run: str, rows_per_rank: int, steps: int, folder: Path
) -> list[dict[str, Any]]:
    """Train `steps` steps recording into `run`; rank 0 writes TRL's log to `folder/run.json`."""
    example = load_example()
    plan = Plan(example.tiny_tokenizer(), FAULTS)
    with SyncLedger.open(url, run=run, retry_policy=RetryPolicy(max_attempts=2)) as ledger:
        rollout = LedgerRollout(plan.runner, ledger, timeout=3.0)
        trainer = trainer_for(
            example, rollout, folder / run, steps=steps, per_device_train_batch_size=rows_per_rank
        )
        try:
            trainer.train()
        finally:
            rollout.close()
    log = [entry for entry in trainer.state.log_history if "reward" in entry]
    if trainer.accelerator.is_main_process:
        (folder / f"{run}.json").write_text(json.dumps(log))
    return log


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_two_ranks_one_postgres_ledger_equal_one_process(pg_url: str, tmp_path: Path) -> None:
    require_trl()
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [
        str(accelerate),
        "launch",
        "--multi_gpu",  # with no GPU: gloo over CPU processes (accelerate's MULTI_CPU)
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        str(Path(__file__)),
        pg_url,
        "two",
        str(STEP_ROWS // 2),
        str(STEPS),
        str(tmp_path),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    two = json.loads((tmp_path / "two.json").read_text())
    one = worker(pg_url, "one", STEP_ROWS, STEPS, tmp_path)

    plan = Plan(None, FAULTS)
    with SyncLedger.open(pg_url, run="two") as ledger:
        for step in range(STEPS):
            split = figures(ledger, "train", step)
            alone = figures(ledger, "train", step, run="one")
            assert split == alone  # every count and mean, groups cut between ranks included
            rewards, failed = plan.expected(step, attempts=2, rows=STEP_ROWS)
            assert split["sessions/total"] == STEP_ROWS and split["groups/unsettled"] == 0
            assert split["reward/mean"] == pytest.approx(sum(rewards) / STEP_ROWS)
            assert {
                k[len("failed/") :]: v for k, v in split.items() if k.startswith("failed/")
            } == failed
            assert two[step]["reward"] == pytest.approx(split["reward/mean_success_only"], abs=1e-6)
            assert two[step]["reward"] == pytest.approx(one[step]["reward"], abs=1e-6)
            assert two[step]["ledger/train/all/reward/mean"] == pytest.approx(split["reward/mean"])
        assert figures(ledger, "train", 1)["groups/failure"] == 1  # the shared group, all failed


if __name__ == "__main__":
    url, run, rows, steps, folder = sys.argv[1:]
    worker(url, run, int(rows), int(steps), Path(folder))
