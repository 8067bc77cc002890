"""The ledger agent loop as verl deploys it: Ray actors, two workers, one PostgreSQL database.

verl's own ``AgentLoopManager`` starts two ``AgentLoopWorker`` actors (separate processes, which
see the ledger loop only through the ``agent_loop_config_path`` YAML they load themselves),
splits a step's batch between them (3 prompts x 4 runs: the second prompt's runs land 2 + 2 on
the two workers) and concatenates their outputs; verl's reward workers and the stand-in LLM
server are actors too. Each worker process opens its own ``Ledger`` on the one PostgreSQL
database: the step completes with a placeholder per failed run, and the ledger's batch, written
by both processes, equals verl's ``DataProto`` row for row.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sessions import SyncLedger
from tests import REPO
from tests.conftest import require_verl
from tests.integrations.verl import llm_server as llm

pytestmark = [pytest.mark.verl_env, pytest.mark.postgres, pytest.mark.usefixtures("verl_installed")]

ROOT = REPO
STEP = 2
PROMPTS = ["what is 1 + 1 ?", "what is 2 + 0 ?", "say 2"]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    require_verl()
    import ray

    from sessions.integrations.transferqueue.runtime import RAY_LOOPBACK_ENV

    saved = {name: os.environ.get(name) for name in RAY_LOOPBACK_ENV}
    os.environ.update(RAY_LOOPBACK_ENV)
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=8,  # logical: the actors mostly wait; the machine has what it has
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), **RAY_LOOPBACK_ENV}},
        )
    try:
        yield
    finally:
        if started:
            ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_two_ray_workers_record_one_step_into_one_postgres_database(
    ray_cluster: None, pg_url: str, tmp_path: Path
) -> None:
    import ray
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    from sessions.integrations.verl.agent_loop import AGENT_LOOP_CONFIG
    from tests.integrations.verl.test_agent_loop import RUN, assert_same_rows, placeholders

    model = llm.build_model_folder(tmp_path / "tiny-policy")
    cfg = llm.verl_config(
        model,
        [
            "actor_rollout_ref.rollout.agent.num_workers=2",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENT_LOOP_CONFIG}",
            f"+ledger.url={pg_url}",
            "+ledger.timeout=20",
        ],
    )
    server = ray.remote(llm.TinyPolicyServer).remote(str(model), {0: "crash", 7: "crash"}, STEP)
    rewards = [ray.remote(RewardLoopWorker).remote(cfg)]
    manager = AgentLoopManager.create(
        config=cfg, llm_client=llm.llm_client(cfg, server), reward_loop_worker_handles=rewards
    )
    batch = llm.prompt_batch(PROMPTS, 4, step=STEP, priority=False)
    uids = batch.non_tensor_batch["uid"].copy()
    out = manager.generate_sequences(
        batch
    )  # the manager numbers the rows (priority) and splits them
    out.non_tensor_batch["uid"] = uids
    assert len(out) == 12 and placeholders(out) == [0, 7]
    pad = llm.TinyPolicyServer(model).tokenizer.pad_token_id
    with SyncLedger.open(pg_url, run=RUN) as ledger:
        ledger_batch = ledger.batch(
            "train",
            STEP,
            timeout=30,
            prompt_width=llm.PROMPT_LENGTH,
            response_width=llm.RESPONSE_LENGTH,
            pad_token_id=pad,
            reward_info=True,
        )
        figures = ledger.metrics_dict("train", STEP, timeout=30)
    assert_same_rows(out, ledger_batch)
    assert figures["ledger/train/all/sessions/total"] == 12
    assert figures["ledger/train/all/placeholders"] == 2
    assert figures["ledger/train/all/groups/finished"] == 3
