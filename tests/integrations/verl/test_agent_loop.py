"""The ledger agent loop inside verl 0.9.1's own rollout loop (docs/design.md §13).

verl's ``AgentLoopWorker.generate_sequences`` runs in this process on CPU, with its own
``single_turn_agent`` and ``tool_agent`` loops, its reward worker running a reward function
loaded by path, and a native sandbox tool; the LLM server is the one stand-in
(``tests/integrations/verl/llm_server.py``: a tiny torch policy). Failures are injected into chosen rows
(server crashes, a dying sandbox, a crashing verifier, hangs past the timeout):

* without the ledger loop the step fails (``generate_sequences`` raises: the problem);
* with it (one config line, ``agent_loop_config_path``) the step completes with one row per
  sample, placeholders where runs failed, every column present whatever row fails (row 0 or a
  later one), the ledger's batch equal to verl's row for row, and verl's metric functions on
  verl's batch equal to the ledger's ``metrics_dict``;
* retries follow the run's ``RetryPolicy``; a cancellation is a pure abort; a group split
  between two workers still gets distinct slots; a slot recorded twice runs unrecorded.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
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
PROMPTS = ["what is 1 + 1 ?", "what is 2 + 0 ?", "say 2", "two?"]
RUN = "agent-loop-test"
TENSOR_COLUMNS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rm_scores",
    "rollout_log_probs",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_verl()  # before anything of verl's (module fixtures run before verl_installed)
    return llm.build_model_folder(tmp_path_factory.mktemp("tiny-policy"))


@pytest.fixture(autouse=True)
def fresh_process_state() -> Any:
    """Each test starts as a fresh worker process would: no reward keys remembered, no tool faults,
    verl's own agent-loop registry (a worker loading the ledger's YAML overrides two names)."""
    require_verl()
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    from sessions.integrations.verl.agent_loop import loop

    loop._REWARD_KEYS.clear()
    llm.TOOL_FAULTS.clear()
    registry = dict(_agent_loop_registry)  # a worker with agent_loop_config_path overrides names
    yield
    _agent_loop_registry.clear()
    _agent_loop_registry.update(registry)
    llm.TOOL_FAULTS.clear()


# Seconds per agent-loop attempt. The stand-in policy samples on the event loop, so 16 runs of a
# step share one thread: on a loaded 2-core CI machine (two suites side by side) a healthy step
# took over a second, and a 1-second timeout failed every run. A hang fault sleeps for an hour,
# so this only has to sit well above a healthy run; each test with a hang waits it out once.
ATTEMPT_TIMEOUT = 10.0


def config(model: Path, url: str | None, *overrides: str) -> Any:
    from sessions.integrations.verl.agent_loop import AGENT_LOOP_CONFIG

    ledger = (
        []
        if url is None
        else [
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENT_LOOP_CONFIG}",
            f"+ledger.url={url}",
            f"+ledger.timeout={ATTEMPT_TIMEOUT}",
        ]
    )
    return llm.verl_config(model, [*ledger, *overrides])


def worker(cfg: Any, model: Path, faults: dict[int, str] | None = None, step: int = 0) -> Any:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    server = llm.TinyPolicyServer(model, faults, global_step=step)
    client = llm.llm_client(cfg, llm.InProcessHandle(server))
    return AgentLoopWorker(cfg, client, reward_loop_worker_handles=llm.reward_handles(cfg))


async def generate(
    cfg: Any,
    model: Path,
    faults: dict[int, str] | None = None,
    *,
    step: int = 1,
    validate: bool = False,
    agent: str | None = None,
    ground_truth: dict[int, str] | None = None,
    prompts: Sequence[str] = PROMPTS,
) -> tuple[Any, Any]:
    """verl's generate_sequences on one step's batch; returns (input batch, output DataProto)."""
    batch = llm.prompt_batch(
        prompts, N, step=step, validate=validate, agent=agent, ground_truth=ground_truth
    )
    uids = batch.non_tensor_batch["uid"].copy()
    out = await worker(cfg, model, faults, step).generate_sequences(batch)
    out.non_tensor_batch["uid"] = uids
    return batch, out


async def ledger_view(
    url: str, partition: str, step: int, pad: int, response_width: int = llm.RESPONSE_LENGTH
) -> tuple[Any, dict]:
    from sessions.integrations.verl.agent_loop import close_process_ledgers

    await close_process_ledgers()
    async with Ledger.open(url, run=RUN) as ledger:
        batch = await ledger.batch(
            partition,
            step,
            timeout=10,
            prompt_width=llm.PROMPT_LENGTH,
            response_width=response_width,
            pad_token_id=pad,
            reward_info=True,
        )
        metrics = await ledger.metrics_dict(
            partition,
            step,
            timeout=10,
            max_prompt_length=llm.PROMPT_LENGTH,
            max_response_length=response_width,
        )
        return batch, metrics


def placeholders(out: Any) -> list[int]:
    flags = out.non_tensor_batch.get("is_placeholder", np.array([None] * len(out)))
    return [i for i, flag in enumerate(flags) if flag is True]


def ledger_rows(out: Any, batch: Any) -> list[int]:
    """For each of verl's rows, the ledger batch's row of the same (uid, rollout number)."""
    rows = {
        (uid, int(index)): i
        for i, (uid, index) in enumerate(
            zip(non_tensor(batch, "uid"), non_tensor(batch, "session_index"))
        )
    }
    return [rows[(uid, i % N)] for i, uid in enumerate(out.non_tensor_batch["uid"])]


def in_ledger_order(out: Any, batch: Any) -> Any:
    """verl's rows in the order of the ledger's batch (sessions in the order they ended)."""
    return out.select_idxs(np.argsort(ledger_rows(out, batch)))


def assert_same_rows(out: Any, batch: Any) -> None:
    """The ledger's batch holds verl's rows, matched by (uid, rollout number): every tensor column
    bit for bit, the placeholder flags, and verl's reward_extra_info columns."""
    assert batch.batch_size[0] == len(out)
    order = ledger_rows(out, batch)
    for column in TENSOR_COLUMNS:
        assert torch.equal(batch[column][order], out.batch[column]), column
    flags = [i in placeholders(out) for i in range(len(out))]
    assert batch["is_placeholder"][order].tolist() == flags
    for key in out.meta_info["reward_extra_keys"]:
        theirs = list(out.non_tensor_batch[key])
        mine = [non_tensor(batch, key)[j] for j in order]
        assert mine == pytest.approx(theirs) if key != "pred" else mine == theirs, key


def verl_train_metrics(out: Any) -> dict[str, float]:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    out.batch["token_level_scores"] = out.batch["token_level_rewards"] = out.batch["rm_scores"]
    out.batch["advantages"], out.batch["returns"] = compute_grpo_outcome_advantage(
        out.batch["rm_scores"], out.batch["response_mask"], out.non_tensor_batch["uid"]
    )
    return compute_data_metrics(out, use_critic=False)


def verl_val_metrics(out: Any, variable: str = "reward") -> dict[str, float]:
    """verl's own ``_validate`` figures for this batch (``_val_metrics_update`` on the rows), for
    the reward or one of the reward function's extra keys."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    values = (
        out.batch["rm_scores"].sum(-1).tolist()
        if variable == "reward"
        else list(out.non_tensor_batch[variable])
    )
    return RayPPOTrainer._val_metrics_update(
        None,
        np.asarray(["toy"] * len(out), dtype=object),
        list(out.non_tensor_batch["uid"]),
        {variable: values},
        [out.non_tensor_batch["__num_turns__"]],
    )


def assert_metrics_agree(theirs: dict[str, Any], mine: dict[str, float]) -> None:
    shared = sorted(k for k in mine if k in theirs)
    assert len(shared) >= 8, sorted(mine)
    for key in shared:
        value = float(theirs[key])
        if math.isnan(value):
            assert math.isnan(mine[key]), key
        else:
            assert mine[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


# ------------------------------------------------------------------------------ the problem
async def test_without_the_ledger_loop_one_crash_fails_the_whole_step(model: Path) -> None:
    cfg = config(model, None)
    with pytest.raises(RuntimeError, match="injected: the LLM server crashed"):
        await generate(cfg, model, {5: "crash"})


# ------------------------------------------------------------------------------ with it
@pytest.mark.parametrize(
    "faults",
    [
        pytest.param({0: "crash", 9: "hang"}, id="row0-crash-row9-timeout"),
        pytest.param({6: "crash", 13: "crash"}, id="later-rows"),
    ],
)
async def test_a_failed_run_is_a_placeholder_row_and_the_step_completes(
    model: Path, db_url: str, faults: dict[int, str]
) -> None:
    cfg = config(model, db_url)
    pad = llm.TinyPolicyServer(model).tokenizer.pad_token_id
    _, out = await generate(cfg, model, faults, step=1)
    assert len(out) == len(PROMPTS) * N
    assert placeholders(out) == sorted(faults)
    reasons = {i: out.non_tensor_batch["failure_reason"][i] for i in placeholders(out)}
    assert reasons == {
        i: {"crash": "runner_error", "hang": "timeout"}[k] for i, k in faults.items()
    }
    # every column of the schema, whichever row failed (verl takes it from row 0)
    assert {"rollout_log_probs", "rm_scores"} <= set(out.batch.keys())
    assert out.meta_info["reward_extra_keys"] == ["score", "acc", "pred"]
    for i in placeholders(out):
        assert out.batch["response_mask"][i].sum() == 0
        assert out.batch["rm_scores"][i].sum() == 0
        assert out.non_tensor_batch["acc"][i] == 0.0 and out.non_tensor_batch["pred"][i] == ""
    assert out.batch["prompts"].shape[1] == llm.PROMPT_LENGTH
    assert out.batch["responses"].shape[1] == llm.RESPONSE_LENGTH

    batch, metrics = await ledger_view(db_url, "train", 1, pad)
    assert_same_rows(out, batch)
    assert_metrics_agree(verl_train_metrics(out), metrics)
    assert metrics["ledger/train/all/sessions/failed"] == len(faults)
    assert metrics["ledger/train/all/placeholders"] == len(faults)


async def test_validation_figures_count_failures_as_zeros_in_verls_names(
    model: Path, sqlite_url: str
) -> None:
    cfg = config(model, sqlite_url)
    pad = llm.TinyPolicyServer(model).tokenizer.pad_token_id
    _, out = await generate(cfg, model, {0: "crash", 5: "crash"}, step=2, validate=True)
    assert placeholders(out) == [0, 5]
    batch, metrics = await ledger_view(sqlite_url, "val", 2, pad)
    assert_same_rows(out, batch)
    # verl's figures on the same rows; the bootstrapped best@n / worst@n resample each uid's
    # values by position, so they are compared in the ledger's row order (mean@n, std@n and
    # every train figure do not depend on it)
    assert_metrics_agree(verl_val_metrics(in_ledger_order(out, batch)), metrics)
    verl_order = verl_val_metrics(out)
    for key in ("val-core/toy/reward/mean@4", "val-aux/toy/reward/std@4"):
        assert metrics[key] == pytest.approx(verl_order[key], abs=1e-6)
    assert "val-core/toy/reward/mean@4" in metrics  # every uid kept its 4 rows
    # verl's own acc figure counts the failures as zeros too (the placeholder's acc is 0.0)
    accs = out.non_tensor_batch["acc"].astype(float)
    acc = verl_val_metrics(out, "acc")["val-core/toy/acc/mean@4"]
    assert acc == pytest.approx(accs.reshape(-1, N).mean(1).mean())
    assert acc == pytest.approx(metrics["val-core/toy/reward/mean@4"])  # acc is the score here


async def test_the_tool_agent_loop_with_a_dying_and_a_hanging_sandbox(
    model: Path, sqlite_url: str
) -> None:
    cfg = config(model, sqlite_url, "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent")
    pad = llm.TinyPolicyServer(model).tokenizer.pad_token_id
    llm.TOOL_FAULTS.update({1: "sandbox", 10: "sandbox_hang"})
    faults = {i: "tool" for i in (1, 2, 3, 10, 11)}
    _, out = await generate(cfg, model, faults, step=3)
    assert len(out) == 16 and placeholders(out) == [1, 10]
    reasons = [out.non_tensor_batch["failure_reason"][i] for i in (1, 10)]
    assert reasons == ["sandbox_error", "timeout"]
    turns = out.non_tensor_batch["__num_turns__"]
    assert all(turns[i] > 2 for i in (2, 3, 11))  # the tool was called and answered
    batch, metrics = await ledger_view(sqlite_url, "train", 3, pad)
    assert_same_rows(out, batch)
    assert_metrics_agree(verl_train_metrics(out), metrics)
    assert metrics["ledger/train/all/failed/sandbox_error"] == 1


async def test_a_crashing_verifier_fails_its_runs_and_row_zero_still_has_the_reward_keys(
    model: Path, sqlite_url: str
) -> None:
    """The first prompt's verifier raises on all of its runs (rows 0-3): nothing of this process
    has been scored yet when they fail, so the placeholder learns the reward keys itself."""
    cfg = config(model, sqlite_url)
    pad = llm.TinyPolicyServer(model).tokenizer.pad_token_id
    _, out = await generate(cfg, model, step=4, ground_truth={0: "crash"})
    assert placeholders(out) == [0, 1, 2, 3]
    assert out.meta_info["reward_extra_keys"] == ["score", "acc", "pred"]
    batch, metrics = await ledger_view(sqlite_url, "train", 4, pad)
    assert_same_rows(out, batch)
    assert metrics["ledger/train/all/groups/failure"] == 1


async def test_retries_follow_the_run_retry_policy(model: Path, sqlite_url: str) -> None:
    """`+ledger.max_attempts=2` alone retries a dropped connection to the LLM server (an infra
    failure, `connection_error`), not the server's own crash (`runner_error`, policy)."""
    cfg = config(model, sqlite_url, "+ledger.max_attempts=2")
    _, out = await generate(cfg, model, {2: "flaky", 7: "crash"}, step=5)
    assert placeholders(out) == [7]  # the flaky row's second attempt succeeded
    assert out.non_tensor_batch["failure_reason"][7] == "runner_error"
    _, metrics = await ledger_view(sqlite_url, "train", 5, 0)
    assert metrics["ledger/train/all/sessions/succeeded"] == 15
    assert metrics["ledger/train/all/retries/connection_error"] == 1
    assert metrics["ledger/train/all/attempts/total"] == 17


async def until_recorded(
    url: str,
    partition: str,
    step: int,
    *,
    succeeded: int,
    task: asyncio.Future,
    within: float = 120,
) -> None:
    """Wait until `succeeded` sessions of the step are recorded as succeeded (projected from the
    log), while `task` is still running; fail after `within` seconds."""
    deadline = asyncio.get_running_loop().time() + within
    async with Ledger.open(url, run=RUN) as ledger:
        while asyncio.get_running_loop().time() < deadline:
            assert not task.done(), "the step ended before it could be cancelled"
            await ledger.project()
            rows = {
                r.metric: r.value
                for r in await ledger.metrics(partition, step)
                if r.data_source is None
            }
            if rows.get("sessions/succeeded", 0) >= succeeded:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"{succeeded} sessions were not recorded as succeeded in {within} s")


async def test_cancellation_is_a_pure_abort(model: Path, sqlite_url: str) -> None:
    from sessions.integrations.verl.agent_loop import close_process_ledgers

    cfg = config(model, sqlite_url, "ledger.timeout=null")
    task = asyncio.ensure_future(generate(cfg, model, {3: "hang", 12: "hang"}, step=6))
    # Cancel once the 14 healthy runs are recorded, however long a loaded machine takes for them
    # (a fixed sleep of 1.5 s cancelled all 16 in CI, where the two suites share 2 cores).
    await until_recorded(sqlite_url, "train", 6, succeeded=14, task=task)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await close_process_ledgers()
    async with Ledger.open(sqlite_url, run=RUN) as ledger:
        await ledger.project()
        rows = {
            r.metric: r.value for r in await ledger.metrics("train", 6) if r.data_source is None
        }
    assert rows["sessions/cancelled"] == 2
    assert rows["sessions/succeeded"] == 14
    assert rows.get("placeholders", 0) == 0


async def test_a_group_split_between_two_workers_keeps_distinct_slots(
    model: Path, sqlite_url: str
) -> None:
    """3 prompts x 4 runs over two workers: AgentLoopManager's chunks of 6 split the second
    prompt's runs 2 + 2, and verl's per-chunk rollout_n would number both halves 0, 1."""
    cfg = config(model, sqlite_url)
    batch = llm.prompt_batch(PROMPTS[:3], N, step=7)
    chunks = batch.chunk(2)
    outs = await asyncio.gather(*(worker(cfg, model, step=7).generate_sequences(c) for c in chunks))
    assert [len(o) for o in outs] == [6, 6]
    from sessions.integrations.verl.agent_loop import close_process_ledgers

    await close_process_ledgers()
    async with Ledger.open(sqlite_url, run=RUN) as ledger:
        ledger_batch = await ledger.batch("train", 7, timeout=10)
    slots = sorted(zip(non_tensor(ledger_batch, "uid"), non_tensor(ledger_batch, "session_index")))
    assert slots == sorted((f"p7u{i}", j) for i in range(3) for j in range(N))


async def test_a_slot_recorded_twice_runs_unrecorded(model: Path, sqlite_url: str) -> None:
    """verl's validation pads its batch with copies of its first rows (pad_dataproto_to_divisor):
    the copies get verl's rows, the ledger keeps one session per slot."""
    from verl.protocol import pad_dataproto_to_divisor

    cfg = config(model, sqlite_url)
    batch = llm.prompt_batch(PROMPTS[:3], N, step=8, validate=True, priority=False)
    padded, pad_size = pad_dataproto_to_divisor(batch, 5)
    padded.non_tensor_batch["priority"] = np.arange(len(padded), dtype=np.int64)
    out = await worker(cfg, model, {12: "crash"}, step=8).generate_sequences(padded)
    assert pad_size == 3 and len(out) == 15
    assert placeholders(out) == [12]  # the copy of row 0 that failed: a placeholder, unrecorded
    _, metrics = await ledger_view(sqlite_url, "val", 8, 0)
    assert metrics["ledger/val/all/sessions/total"] == 12
    assert metrics["ledger/val/all/sessions/failed"] == 0


def test_ledger_errors_name_the_setting(model: Path) -> None:
    from sessions.errors import ConfigError
    from sessions.integrations.verl.agent_loop import LedgerSettings

    cfg = llm.verl_config(model, ["+ledger.timeout=soon"])
    with pytest.raises(ConfigError, match="ledger.url"):
        LedgerSettings.from_config(cfg, environ={})
    with pytest.raises(ConfigError, match="ledger.timeout"):
        LedgerSettings.from_config(cfg, environ={"ROLLOUT_LEDGER_DB": "x.db"})
    cfg = llm.verl_config(model, ["+ledger.urll=x.db"])
    with pytest.raises(ConfigError, match="urll"):
        LedgerSettings.from_config(cfg, environ={})
    settings = LedgerSettings.from_config(
        llm.verl_config(model), pad_token_id=7, environ={"ROLLOUT_LEDGER_DB": "x.db"}
    )
    assert (settings.run, settings.placeholder_token_id, settings.url) == (RUN, 7, "x.db")
