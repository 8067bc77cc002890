"""A verl job killed mid-step and restarted from its checkpoint (docs/design.md §14), with verl's
own classes: the first launch's ``AgentLoopWorker`` process dies in the middle of step k
(`resume_worker.py`), leaving its sessions open; the restarted job, a new launch, re-runs step k
with new uids. The trainer side then neither waits (no `StepNotSettled`: the dead launch's open
session was failed when the new launch opened, and its groups are not the step's any more) nor
mixes: the step's batch is verl's rows of the re-run, row for row, and its figures are verl's
(the count of sessions and reward/mean included). Both backends.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from sessions import Ledger
from tests import REPO
from tests.integrations.verl import llm_server as llm
from tests.integrations.verl import resume_worker as dead
from tests.integrations.verl.test_agent_loop import (
    PROMPTS,
    RUN,
    N,
    assert_metrics_agree,
    assert_same_rows,
    config,
    verl_train_metrics,
    worker,
)

pytestmark = [pytest.mark.verl_env, pytest.mark.usefixtures("verl_installed")]

STEP = 3
RESUMED = "verl-job-b"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import require_verl

    require_verl()
    return llm.build_model_folder(tmp_path_factory.mktemp("tiny-policy"))


async def test_a_killed_verl_worker_s_step_re_run_by_the_next_launch_equals_verl_s(
    model: Path, db_url: str
) -> None:
    from sessions.integrations.verl.agent_loop import close_process_ledgers

    died = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integrations.verl.resume_worker",
            db_url,
            str(model),
            str(STEP),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert died.returncode == dead.EXIT_CODE, died.stderr[-3000:]
    assert await _open_sessions(db_url) >= 1  # what the dead worker left behind

    # The restarted job: the same run, a new launch (main_ppo writes one into the config).
    cfg = config(model, db_url, f"+ledger.launch={RESUMED}")
    batch = llm.prompt_batch(PROMPTS, N, step=STEP, uid_prefix="b")
    uids = batch.non_tensor_batch["uid"].copy()
    out = await worker(cfg, model, step=STEP).generate_sequences(batch)
    out.non_tensor_batch["uid"] = uids
    await close_process_ledgers()

    # The trainer side, as `LedgerTrainerHook` opens it: the same settings, the same launch.
    pad = llm.TinyPolicyServer(model).tokenizer.pad_token_id
    async with Ledger.open(db_url, run=RUN, launch=RESUMED) as ledger:
        ours = await ledger.batch(
            "train",
            STEP,
            timeout=30,
            prompt_width=llm.PROMPT_LENGTH,
            response_width=llm.RESPONSE_LENGTH,
            pad_token_id=pad,
            reward_info=True,
        )
        figures = await ledger.metrics_dict(
            "train",
            STEP,
            timeout=30,
            max_prompt_length=llm.PROMPT_LENGTH,
            max_response_length=llm.RESPONSE_LENGTH,
        )
    assert_same_rows(out, ours)  # verl's rows of the re-run, none of the dead launch's
    theirs = verl_train_metrics(out)
    assert_metrics_agree(theirs, figures)
    assert figures["ledger/train/all/sessions/total"] == len(out) == len(PROMPTS) * N
    assert figures["ledger/train/all/reward/mean"] == pytest.approx(
        float(theirs["critic/score/mean"]), abs=1e-6
    )
    assert figures["ledger/train/all/launch"] == 2
    superseded = figures["ledger/train/all/sessions/superseded"]
    assert superseded >= 1
    assert await _open_sessions(db_url) == 0  # failed as orphans when the new launch opened
    assert await _superseded_in_sql(db_url) == superseded


async def _scalar(url: str, sql: str, **params: Any) -> int:
    from store import create_engine

    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return int((await conn.execute(text(sql), params)).scalar_one())
    finally:
        await engine.dispose()


async def _open_sessions(url: str) -> int:
    """Sessions of the run still open, as the log says (the projector may not have run)."""
    return await _scalar(
        url,
        "SELECT COUNT(*) FROM events c WHERE c.run = :run AND c.type = 'SessionCreated' AND NOT "
        "EXISTS (SELECT 1 FROM events t WHERE t.session_id = c.session_id AND t.type IN "
        "('SessionSucceeded', 'SessionFailed', 'SessionCancelled'))",
        run=RUN,
    )


async def _superseded_in_sql(url: str) -> int:
    return await _scalar(
        url,
        "SELECT COUNT(*) FROM session_launches WHERE run = :run AND global_step = :step "
        "AND superseded = 1",
        run=RUN,
        step=STEP,
    )


def test_main_ppo_names_each_start_of_the_job_unless_the_launch_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The driver writes the launch into the config every worker receives: one per start."""
    from omegaconf import OmegaConf

    from sessions.integrations.verl.agent_loop.settings import LedgerSettings
    from sessions.integrations.verl.main_ppo import with_launch

    monkeypatch.delenv("ROLLOUT_LEDGER_LAUNCH", raising=False)
    first, second, bare = (
        OmegaConf.create(
            {"ledger": {"url": "sqlite:///x.db"}, "trainer": {"experiment_name": "e"}}
        ),
        OmegaConf.create(
            {"ledger": {"url": "sqlite:///x.db"}, "trainer": {"experiment_name": "e"}}
        ),
        OmegaConf.create({"trainer": {"experiment_name": "e"}}),
    )
    for job in (first, second, bare):
        with_launch(job)
    assert first.ledger.launch.startswith("verl-") and first.ledger.launch != second.ledger.launch
    assert bare.ledger.launch.startswith("verl-")
    assert LedgerSettings.from_config(first).launch == first.ledger.launch  # what workers read
    assert LedgerSettings.from_config(first).ledger_options()["launch"] == first.ledger.launch
    given = OmegaConf.create({"ledger": {"url": "sqlite:///x.db", "launch": "mine"}})
    with_launch(given)
    assert given.ledger.launch == "mine"
    monkeypatch.setenv("ROLLOUT_LEDGER_LAUNCH", "from-the-launcher")
    left = OmegaConf.create(
        {"ledger": {"url": "sqlite:///x.db"}, "trainer": {"experiment_name": "e"}}
    )
    with_launch(left)
    assert "launch" not in left.ledger
    assert LedgerSettings.from_config(left).launch == "from-the-launcher"
