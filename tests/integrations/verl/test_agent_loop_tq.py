"""The ledger agent loop under verl 0.9.1's V1 rollout worker, ``AgentLoopWorkerTQ``.

V1 (the default trainer) runs a prompt's n agent loops in ``_run_prompt``, puts each output into
TransferQueue, and when one raises marks the prompt's group ``failure`` with the failed run's
row missing: failed groups stay sampleable and the replay buffer pads them downstream. With the
ledger loop (the same one config line as V0) the failed run becomes a recorded placeholder row
and the group is ``finished`` with all n rows. Run in this process against a real local
TransferQueue on Ray, with verl's own worker class, agent loop, reward worker and the stand-in
LLM server of ``tests/integrations/verl/llm_server.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sessions import Ledger
from sessions.batches import non_tensor
from tests.conftest import require_verl
from tests.integrations.verl import llm_server as llm

pytestmark = [pytest.mark.verl_env, pytest.mark.usefixtures("verl_installed")]

N = 4
STEP = 3
RUN = "agent-loop-test"
PROMPTS = ["what is 1 + 1 ?", "what is 2 + 0 ? [crash_once]", "say 2 [crash]"]


@pytest.fixture(scope="module")
def tq() -> Iterator[Any]:
    require_verl()
    from sessions.integrations.transferqueue import start_transferqueue

    handle = start_transferqueue(timeout_s=150)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture(autouse=True)
def verl_registry() -> Iterator[None]:
    """verl's agent-loop registry as a fresh process has it (a worker that loaded the ledger's
    YAML, in this process, overrides two of its names)."""
    require_verl()
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    registry = dict(_agent_loop_registry)
    yield
    _agent_loop_registry.clear()
    _agent_loop_registry.update(registry)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_verl()
    return llm.build_model_folder(tmp_path_factory.mktemp("tiny-policy"))


async def run_v1_step(model: Path, url: str | None, prefix: str) -> dict[str, Any]:
    """verl's V1 rollout of one step: prompts registered as V1's trainer registers them, then
    ``AgentLoopWorkerTQ.generate_sequences`` and its background prompt tasks to the end."""
    import transfer_queue as tq
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.utils import tensordict_utils as tu

    from sessions.integrations.verl.agent_loop import AGENT_LOOP_CONFIG, close_process_ledgers

    overrides = (
        []
        if url is None
        else [
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENT_LOOP_CONFIG}",
            f"+ledger.url={url}",
            "+ledger.timeout=60",  # no hangs here: only a bound on healthy runs
        ]
    )
    cfg = llm.verl_config(model, overrides)
    server = llm.TinyPolicyServer(model, global_step=STEP)
    worker_cls = AgentLoopWorkerTQ.__ray_metadata__.modified_class  # the class under ray.remote
    worker = worker_cls(
        cfg,
        llm.llm_client(cfg, llm.InProcessHandle(server)),
        reward_loop_worker_handles=llm.reward_handles(cfg),
    )
    uids = [f"{prefix}s{STEP}u{i}" for i in range(len(PROMPTS))]

    def column(values: list[Any]) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    batch = tu.get_tensordict(
        {
            "raw_prompt": column([[{"role": "user", "content": p}] for p in PROMPTS]),
            "uid": column(uids),
            "index": np.arange(len(PROMPTS)),
            "data_source": column(["toy"] * len(PROMPTS)),
            "reward_model": column([{"ground_truth": "2"} for _ in PROMPTS]),
            "extra_info": column([{} for _ in PROMPTS]),
        }
    )
    tu.assign_non_tensor_data(batch, "global_steps", STEP)
    tags = [{"is_prompt": True, "status": "pending", "global_steps": STEP} for _ in uids]
    tq.kv_batch_put(keys=uids, partition_id="train", tags=tags)
    await worker.generate_sequences(batch)
    await asyncio.gather(*list(worker.background_tasks))
    await close_process_ledgers()
    listing = tq.kv_list(partition_id="train").get("train", {})
    return {
        "status": {uid: listing[uid]["status"] for uid in uids},
        "rows": {
            uid: sorted(
                k for k in listing if k.startswith(f"{uid}_") and not listing[k].get("is_prompt")
            )
            for uid in uids
        },
    }


async def test_without_the_ledger_loop_a_failed_run_leaves_a_failure_group_short_of_rows(
    tq: Any, model: Path
) -> None:
    step = await run_v1_step(model, None, "plain")
    status, rows = step["status"], step["rows"]
    assert list(status.values()) == ["finished", "failure", "failure"]
    assert [len(r) for r in rows.values()] == [N, N - 1, 0]


async def test_with_it_every_group_is_finished_with_placeholder_rows_recorded(
    tq: Any, model: Path, sqlite_url: str
) -> None:
    import transfer_queue

    step = await run_v1_step(model, sqlite_url, "led")
    status, rows = step["status"], step["rows"]
    assert list(status.values()) == ["finished"] * len(PROMPTS)
    assert [len(r) for r in rows.values()] == [N] * len(PROMPTS)
    keys = [key for uid_rows in rows.values() for key in uid_rows]
    raw = transfer_queue.kv_batch_get(keys=keys, partition_id="train")
    got = non_tensor(raw, "key") if "key" in raw.keys() else keys
    extra = dict(zip(got, non_tensor(raw, "extra_fields")))
    flags = {key: bool(extra[key].get("is_placeholder")) for key in keys}
    per_uid = [sum(flags[k] for k in uid_rows) for uid_rows in rows.values()]
    assert per_uid == [0, 1, N]  # crash_once: one run of four; crash: all four
    # every row carries the batch's schema, the placeholders too
    assert {"rollout_log_probs", "rm_scores", "response_mask"} <= set(raw.keys())
    for i, key in enumerate(got):
        if flags[key]:
            assert raw["response_mask"][i].sum() == 0 and raw["rm_scores"][i].sum() == 0
            assert extra[key]["failure_reason"] == "runner_error"
            assert set(extra[key]["reward_extra_info"]) == {"score", "acc", "pred"}

    async with Ledger.open(sqlite_url, run=RUN) as ledger:
        batch = await ledger.batch("train", STEP, timeout=10)
        metrics = await ledger.metrics_dict("train", STEP, timeout=10)
    assert batch.batch_size[0] == len(keys)
    ledger_flags = {
        f"{uid}_{index}_0": bool(p)
        for uid, index, p in zip(
            non_tensor(batch, "uid"),
            non_tensor(batch, "session_index"),
            batch["is_placeholder"].tolist(),
        )
    }
    assert ledger_flags == flags  # the same runs failed, slot for slot
    for i, key in enumerate(got):  # and the rows hold the same tokens
        j = list(ledger_flags).index(key)
        response = int(batch["response_length"][j])
        assert torch.equal(batch["responses"][j, :response], raw["responses"][i].to(torch.int64)), (
            key
        )
    assert metrics["ledger/train/all/groups/finished"] == 2
    assert metrics["ledger/train/all/groups/failure"] == 1  # no run of it succeeded
