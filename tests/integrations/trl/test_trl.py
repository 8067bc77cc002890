"""The TRL adapter (docs/trl.md): the ledger behind TRL's GRPOTrainer, run for real on CPU.

The first tests need no TRL (group identity, the runner's output, the placeholder rows, the loss
factor). The rest run TRL 1.16's own `GRPOTrainer.train()` on a 2-layer model and a word-level
tokenizer built here (nothing downloaded), with failures injected by a plan: runner errors,
timeouts, a sandbox that fails to start (once: retried; twice: failed), invalid output. They skip
without TRL, unless ROLLOUT_LEDGER_REQUIRE_TRL=1 (then they fail). docs/design.md §5 and §13.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sessions import RetryPolicy, SandboxError, SyncLedger
from sessions.integrations.trl import (
    FAILURE,
    REWARD,
    ROW_MEAN_LOSS_TYPES,
    Completion,
    LedgerRollout,
    RolloutContext,
    RunnerOutputError,
    TRLSetupError,
    prompt_key,
)
from sessions.integrations.trl.completion import parse_completion, trl_output
from sessions.integrations.trl.identity import slots
from sessions.integrations.trl.loss_types import step_scale
from tests import REPO
from tests.conftest import BACKENDS, fresh_database, run_script

ROOT = REPO
TRL_REQUIRED = os.environ.get("ROLLOUT_LEDGER_REQUIRE_TRL", "").lower() in ("1", "true", "yes")
GROUP = 4
PROMPTS = 8
ROWS = PROMPTS * GROUP  # sessions per step


# ================================================================= without TRL: the pieces
def test_prompt_key_is_stable_and_tells_prompts_apart() -> None:
    chat = [{"role": "user", "content": "w1 w2"}]
    assert prompt_key("w1 w2") == prompt_key("w1 w2")
    assert prompt_key(chat) == prompt_key([{"content": "w1 w2", "role": "user"}])
    assert len({prompt_key("w1 w2"), prompt_key("w1 w3"), prompt_key(chat)}) == 3
    assert len(prompt_key("w1")) == 12 and "_" not in prompt_key("w1")


def test_groups_split_across_ranks_get_one_uid_and_every_index_once() -> None:
    """TRL's sampler puts each prompt num_generations times in a row over the global batch; a
    rank's slice may cut a group. Both ranks must name the group alike, as TRL's baseline does."""
    prompts = [f"p{g}" for g in range(6) for _ in range(GROUP)]  # 24 rows in 6 groups

    def layout(ranks: int) -> list[Any]:
        per = len(prompts) // ranks
        return [
            slot
            for rank in range(ranks)
            for slot in slots(
                prompts[rank * per : (rank + 1) * per],
                process_index=rank,
                group_size=GROUP,
                token="t0",
                call=7,
            )
        ]

    everything = layout(2)  # 12 rows a rank: groups end where ranks do
    by_uid: dict[str, list[int]] = {}
    for slot in everything:
        by_uid.setdefault(slot.uid, []).append(slot.session_index)
        assert "_" not in slot.uid and slot.uid.startswith(slot.key)
    assert sorted(map(sorted, by_uid.values())) == [list(range(GROUP))] * 6
    assert len({s.session_id for s in everything}) == len(prompts)
    assert [s.row for s in everything] == list(range(len(prompts)))
    # 4 ranks of 6 rows: groups 1 and 4 straddle two ranks, and are named alike on both
    assert [(s.uid, s.session_index) for s in layout(4)] == [
        (s.uid, s.session_index) for s in everything
    ]
    # the same prompts at the next call are new groups
    again = slots(prompts[:4], process_index=0, group_size=GROUP, token="t0", call=8)
    assert again[0].uid != everything[0].uid and again[0].key == everything[0].key


def test_a_group_of_mixed_prompts_is_refused() -> None:
    with pytest.raises(TRLSetupError, match="RepeatSampler"):
        slots(["a", "a", "b", "b"], process_index=0, group_size=GROUP, token="t", call=0)


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        ([1, 2], "returned list"),
        ({"prompt_ids": [1], "completion_ids": [2]}, "lacks reward"),
        ({"prompt_ids": [], "completion_ids": [2], "reward": 1.0}, "non-empty"),
        ({"prompt_ids": [1], "completion_ids": [2.5], "reward": 1.0}, "not a non-negative integer"),
        ({"prompt_ids": [1], "completion_ids": [2], "reward": float("nan")}, "finite"),
        ({"prompt_ids": [1], "completion_ids": [2], "reward": True}, "finite"),
        (
            {"prompt_ids": [1], "completion_ids": [2, 3], "reward": 1, "logprobs": [0.0]},
            "one number per",
        ),
        ({"prompt_ids": [1], "completion_ids": [2], "reward": 1, "env_mask": [2]}, "use only"),
        (
            {"prompt_ids": [1], "completion_ids": [2], "reward": 1, "env_mask": [1, 1]},
            "2 entries for 1",
        ),
        ({"prompt_ids": [1], "completion_ids": [2], "reward": 1, "completions": 3}, "rename"),
    ],
)
def test_a_bad_runner_result_fails_its_session_as_invalid_output(result: Any, problem: str) -> None:
    with pytest.raises(RunnerOutputError, match=problem) as caught:
        parse_completion(result)
    assert caught.value.reason == "invalid_output"


def test_the_output_has_a_masked_unscored_placeholder_for_each_failure() -> None:
    ok = parse_completion(
        {
            "prompt_ids": [5, 6],
            "completion_ids": [7, 1],
            "reward": 0.5,
            "logprobs": [-1.0, -2.0],
            "answer": "w7",
        }
    )
    tool = Completion([5], [8, 9, 1], 1.0, [-0.5] * 3, env_mask=[1, 0, 1], extra={})
    out = trl_output(
        [ok, None, tool], [None, "timeout", None], ["a", "b", "c"], placeholder_token_id=0
    )
    assert out["prompt_ids"] == [[5, 6], [0], [5]]
    assert out["completion_ids"] == [[7, 1], [0], [8, 9, 1]]
    assert out["env_mask"] == [[1, 1], [0], [1, 0, 1]]
    assert out["logprobs"] == [[-1.0, -2.0], [0.0], [-0.5] * 3]
    assert out[REWARD] == [0.5, None, 1.0] and out[FAILURE] == [None, "timeout", None]
    assert out["answer"] == ["w7", None, None]
    everything_failed = trl_output([None, None], ["timeout", "sandbox_error"], ["a", "b"], 3)
    assert everything_failed["logprobs"] is None and everything_failed[REWARD] == [None, None]
    with pytest.raises(TRLSetupError, match="logprobs for every row or for none"):
        trl_output([ok, Completion([5], [7], 0.0)], [None, None], ["a", "b"], 0)


def test_the_loss_factor_is_rows_over_trainable_rows_of_the_optimizer_step() -> None:
    counts = [[3, 4], [4, 4], [2, 4], [0, 4]]  # (trainable, rows) of 4 micro-batches
    every = dict(steps_per_generation=4, generate_every=4)
    assert step_scale(counts, range(0, 2), **every) == 8 / 7
    assert step_scale(counts, range(2, 4), **every) == 8 / 2
    assert step_scale(counts, range(4, 8), **every) == 16 / 9  # the next generation's micro-batches
    assert step_scale([[0, 4]], range(0, 1), steps_per_generation=1, generate_every=1) == 1.0
    # a step that spans two generations takes the current one as a whole
    assert step_scale(counts, range(3, 5), **every) == 16 / 9
    assert ROW_MEAN_LOSS_TYPES == {"grpo", "sapo", "luspo", "dr_grpo"}


def test_the_package_imports_without_trl() -> None:
    code = (
        "import sys; sys.modules['trl'] = None; sys.modules['transformers'] = None\n"
        "import sessions.integrations.trl as t\n"
        "try:\n    t.LedgerGRPOTrainer\nexcept ImportError as e:\n    print('refused:', e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "pip install -e '.[trl]'" in done.stdout


# ================================================================== with TRL: real training
def require_trl() -> None:
    try:
        import trl  # noqa: F401
    except ImportError as error:
        if TRL_REQUIRED:
            pytest.fail(f"trl is not installed ({error}) and ROLLOUT_LEDGER_REQUIRE_TRL is set")
        pytest.skip(f"trl is not installed ({error}); pip install -e '.[trl]'")


def load_example() -> Any:
    """examples/trl_grpo.py as a module: its tiny tokenizer, model, dataset and config."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    spec = importlib.util.spec_from_file_location(
        "trl_grpo_example", ROOT / "examples" / "trl_grpo.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import logging

    logging.getLogger("trl").setLevel(logging.ERROR)  # one warning per batch with a placeholder
    return module


@pytest.fixture(scope="module")
def example() -> Any:
    require_trl()
    return load_example()


def reward_of(call: int, row: int) -> float:
    """The reward of a successful session: varies within each group, so advantages are not 0."""
    return ((3 * row + call) % 5) / 4


class Plan:
    """Faults by (generation call, row) and attempt: `error` (the runner raises), `sandbox` (its
    sandbox fails to start), `hang` (past the timeout), `bad` (invalid output); else it succeeds."""

    def __init__(self, tokenizer: Any, faults: dict[tuple[int, int], list[str | None]]) -> None:
        self.tokenizer = tokenizer
        self.faults = faults
        self.attempts: Counter[str] = Counter()
        self.release = threading.Event()

    def fault(self, context: RolloutContext) -> str | None:
        attempt = self.attempts[context.session_id]
        self.attempts[context.session_id] += 1
        planned = self.faults.get((context.call, context.row), [])
        return planned[attempt] if attempt < len(planned) else None

    def result(self, prompt: str, context: RolloutContext) -> dict[str, Any]:
        return {
            "prompt_ids": self.tokenizer(prompt)["input_ids"],
            "completion_ids": [3 + (context.row * 7 + context.call) % 60, 1],
            "reward": reward_of(context.call, context.row),
        }

    async def runner(self, prompt: str, context: RolloutContext) -> dict[str, Any]:
        fault = self.fault(context)
        if fault == "sandbox":
            raise SandboxError("the sandbox failed to start")
        if fault == "error":
            raise RuntimeError("malformed tool call")
        if fault == "hang":
            await asyncio.sleep(60)
        if fault == "bad":
            return {"prompt_ids": [], "completion_ids": [1], "reward": 0.0}
        return self.result(prompt, context)

    def sync_runner(self, prompt: str, context: RolloutContext) -> dict[str, Any]:
        fault = self.fault(context)
        if fault == "hang":
            self.release.wait(60)
        if fault == "error":
            raise RuntimeError("malformed tool call")
        return self.result(prompt, context)

    def expected(
        self, call: int, attempts: int = 1, rows: int = ROWS
    ) -> tuple[list[float], Counter[str]]:
        """The successes' rewards and the failures by reason, from the plan alone: only the
        sandbox (an infrastructure failure) is retried, up to `attempts` in all."""
        reasons = {
            "error": "runner_error",
            "sandbox": "sandbox_error",
            "hang": "timeout",
            "bad": "invalid_output",
        }
        rewards: list[float] = []
        failed: Counter[str] = Counter()
        for row in range(rows):
            planned = self.faults.get((call, row), [])
            if planned[:1] == ["sandbox"]:
                tries = planned[:attempts]
                fault = "sandbox" if len(tries) == attempts and set(tries) == {"sandbox"} else None
            else:
                fault = planned[0] if planned else None
            if fault is None:
                rewards.append(reward_of(call, row))
            else:
                failed[reasons[fault]] += 1
        return rewards, failed


def figures(
    ledger: SyncLedger, partition: str, step: int, run: str | None = None
) -> dict[str, float]:
    """A step's metric counts over all data sources, by name."""
    return {
        r.metric: r.value for r in ledger.metrics(partition, step, run=run) if r.data_source is None
    }


def trainer_for(
    example: Any, rollout: Any, folder: Path, *, cls: Any = None, steps: int = 3, **config: Any
) -> Any:
    from sessions.integrations.trl import LedgerGRPOTrainer

    options = dict(per_device_train_batch_size=ROWS, learning_rate=1e-3, loss_type="grpo")
    options.update(config)
    return (cls or LedgerGRPOTrainer)(
        model=example.tiny_model(0),
        reward_funcs=rollout.reward if isinstance(rollout, LedgerRollout) else rollout[1],
        args=example.grpo_config(str(folder), steps, **options),
        train_dataset=example.prompt_dataset(PROMPTS),
        eval_dataset=example.prompt_dataset(PROMPTS),
        processing_class=example.tiny_tokenizer(),
        rollout_func=rollout if isinstance(rollout, LedgerRollout) else rollout[0],
    )


FAULTS: dict[tuple[int, int], list[str | None]] = {
    (0, 1): ["error"],
    (0, 6): ["sandbox", "sandbox"],  # fails to start twice: failed
    (0, 9): ["sandbox"],  # once: the retry succeeds
    (0, 14): ["hang"],
    (0, 20): ["bad"],
    (1, 0): ["error"],  # every session of a group fails
    (1, 1): ["hang"],
    (1, 2): ["sandbox", "sandbox"],
    (1, 3): ["error"],
    (1, 17): ["hang"],
    (2, 5): ["sandbox", "sandbox"],
    (2, 30): ["error"],
}


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_three_steps_with_failures_train_and_trl_reward_is_the_success_only_mean(
    example: Any, db_url: str, tmp_path: Path
) -> None:
    plan = Plan(example.tiny_tokenizer(), FAULTS)
    with SyncLedger.open(db_url, run="trl", retry_policy=RetryPolicy(max_attempts=2)) as ledger:
        rollout = LedgerRollout(plan.runner, ledger, timeout=1.5)
        trainer = trainer_for(example, rollout, tmp_path)
        try:
            trainer.train()
        finally:
            rollout.close()
        log = [entry for entry in trainer.state.log_history if "reward" in entry]
        assert [entry["step"] for entry in log] == [1, 2, 3]
        for step, entry in enumerate(log):
            rewards, failed = plan.expected(step, attempts=2)
            ours = figures(ledger, "train", step)
            success_only = sum(rewards) / len(rewards)
            honest = sum(rewards) / ROWS  # failures as zeros
            assert entry["reward"] == pytest.approx(ours["reward/mean_success_only"], abs=1e-6)
            assert ours["reward/mean_success_only"] == pytest.approx(success_only)
            assert ours["reward/mean"] == pytest.approx(honest)
            assert entry["reward"] > honest + 0.01  # TRL's figure is the survivors' mean
            assert {
                k[len("failed/") :]: v for k, v in ours.items() if k.startswith("failed/")
            } == failed
            assert ours["sessions/total"] == ROWS and ours["placeholders"] == sum(failed.values())
            # the ledger's own figures, logged through TRL beside its reward
            assert entry["ledger/train/all/reward/mean"] == pytest.approx(honest)
            assert entry["ledger/train/all/reward/mean_success_only"] == pytest.approx(success_only)
        assert (
            figures(ledger, "train", 0)["sessions/retried"] == 2
        )  # the two sandboxes that failed once
        assert figures(ledger, "train", 1)["groups/failure"] == 1  # group 0: every session failed
        batch = ledger.batch("train", 0)
        assert (
            int(batch["is_placeholder"].sum()) == 4
            and int(batch["response_mask"][batch["is_placeholder"]].sum()) == 0
        )


@pytest.mark.parametrize("fault", ["error", "sandbox"])
def test_without_the_wrapper_the_same_failure_ends_train(
    example: Any, fault: str, tmp_path: Path
) -> None:
    """TRL calls rollout_func with no try around it: one raising rollout crashes the step."""
    from trl import GRPOTrainer

    plan = Plan(example.tiny_tokenizer(), {(0, 3): [fault]})

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, Any]:
        rows = [
            asyncio.run(plan.runner(p, RolloutContext(trainer, f"s{i}", "u", 0, "train", 0, i, 0)))
            for i, p in enumerate(prompts)
        ]
        keys = ("prompt_ids", "completion_ids")
        return {
            **{k: [r[k] for r in rows] for k in keys},
            "logprobs": None,
            "score": [r["reward"] for r in rows],
        }

    def score(completions: Any, score: list[float], **_: Any) -> list[float]:
        return score

    trainer = trainer_for(example, (rollout_func, score), tmp_path, cls=GRPOTrainer, steps=1)
    with pytest.raises(Exception, match="malformed tool call|failed to start") as raised:
        trainer.train()
    assert isinstance(raised.value, RuntimeError if fault == "error" else SandboxError)


def test_a_step_where_every_session_fails_completes(
    example: Any, sqlite_url: str, tmp_path: Path
) -> None:
    plan = Plan(example.tiny_tokenizer(), {(0, i): ["error"] for i in range(ROWS)})
    with SyncLedger.open(sqlite_url) as ledger:
        rollout = LedgerRollout(plan.runner, ledger)
        trainer = trainer_for(example, rollout, tmp_path, steps=1)
        trainer.train()
        rollout.close()
        ours = figures(ledger, "train", 0)
    entry = next(e for e in trainer.state.log_history if "ledger/train/all/reward/mean" in e)
    assert entry["reward"] is None  # TRL has no scored row to average
    assert entry["ledger/train/all/reward/mean"] == 0.0 and ours["coverage"] == 0.0
    assert ours["groups/failure"] == PROMPTS and ours["failed/runner_error"] == ROWS


def test_a_hung_synchronous_runner_times_out_and_the_others_go_on(
    example: Any, sqlite_url: str, tmp_path: Path
) -> None:
    plan = Plan(example.tiny_tokenizer(), {(0, 2): ["hang"], (0, 5): ["hang"], (0, 11): ["error"]})
    with SyncLedger.open(sqlite_url) as ledger:
        rollout = LedgerRollout(plan.sync_runner, ledger, timeout=1.0)  # one session at a time
        assert rollout.concurrency == 1
        trainer = trainer_for(example, rollout, tmp_path, steps=1)
        try:
            trainer.train()
        finally:
            rollout.close()
            plan.release.set()
        ours = figures(ledger, "train", 0)
    rewards, failed = plan.expected(0)
    assert failed == {"timeout": 2, "runner_error": 1}
    assert ours["failed/timeout"] == 2 and ours["reward/mean"] == pytest.approx(sum(rewards) / ROWS)
    entry = next(e for e in trainer.state.log_history if "reward" in e)
    assert entry["reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)


def test_an_evaluation_is_one_val_step_and_its_figures_are_returned_and_logged(
    example: Any, sqlite_url: str, tmp_path: Path
) -> None:
    """Two eval batches (generation calls 0 and 1) at step 0: one val step in the ledger."""
    plan = Plan(example.tiny_tokenizer(), {(0, 0): ["error"], (0, 7): ["hang"], (1, 12): ["error"]})
    with SyncLedger.open(sqlite_url) as ledger:
        rollout = LedgerRollout(plan.runner, ledger, timeout=2.0)
        trainer = trainer_for(example, rollout, tmp_path, per_device_eval_batch_size=ROWS // 2)
        try:
            metrics = trainer.evaluate()
        finally:
            rollout.close()
        ours = figures(ledger, "val", 0)
    successes = [
        reward_of(c, i) for c in (0, 1) for i in range(ROWS // 2) if (c, i) not in plan.faults
    ]
    assert ours["sessions/total"] == ROWS and ours["sessions/failed"] == 3
    assert ours["reward/mean"] == pytest.approx(sum(successes) / ROWS)
    assert metrics["eval_ledger/val/all/reward/mean"] == pytest.approx(ours["reward/mean"])
    logged = [e for e in trainer.state.log_history if "eval_ledger/val/all/reward/mean" in e]
    assert len(logged) == 1
    assert not any(k.startswith("ledger/") or k.startswith("eval_ledger/train") for k in metrics)


LOSS_TYPES = [
    ("grpo", {}),
    ("sapo", {}),
    ("dr_grpo", {}),
    ("luspo", {"importance_sampling_level": "sequence"}),
    ("dapo", {}),  # the token-normalised ones are honest already
    ("bnpo", {}),
    ("cispo", {}),
]
PLACEHOLDER_ROWS = (0, 7, 8, 21, 30)  # failed sessions in a step of 32


def grads(trainer: Any, compute: Any, inputs: dict[str, Any]) -> Any:
    import torch

    trainer.model.zero_grad()
    compute(trainer.model, inputs).backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def trainable_only(inputs: dict[str, Any]) -> dict[str, Any]:
    """The micro-batch without its placeholder rows, as if they had never been there."""
    keep = (inputs["completion_mask"] * inputs["tool_mask"]).sum(-1) > 0
    rows = len(keep)
    return {
        k: v[keep] if hasattr(v, "dim") and v.dim() and v.shape[0] == rows else v
        for k, v in inputs.items()
    }


@pytest.fixture(scope="module")
def generated(example: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A LedgerGRPOTrainer after one step: its buffered micro-batch of 32 rows, 5 placeholders."""
    faults = {(0, i): ["error"] for i in PLACEHOLDER_ROWS}
    folder = tmp_path_factory.mktemp("generated")
    with fresh_database("sqlite", folder) as url, SyncLedger.open(url) as ledger:
        rollout = LedgerRollout(Plan(example.tiny_tokenizer(), faults).runner, ledger)
        trainer = trainer_for(example, rollout, folder, steps=1)
        trainer.train()  # generates, buffers the micro-batch and counts its trainable rows
        rollout.close()
    assert trainer._ledger_counts == [[ROWS - len(PLACEHOLDER_ROWS), ROWS]]
    return trainer


@pytest.mark.parametrize(("loss_type", "config"), LOSS_TYPES)
def test_the_row_mean_losses_average_over_trainable_rows_only(
    generated: Any, loss_type: str, config: dict[str, Any]
) -> None:
    """On a generated micro-batch of 32 rows, 5 of them placeholders: LedgerGRPOTrainer's gradient
    equals stock TRL's on the 27 trainable rows alone, for every loss type; stock TRL on all 32
    rows is R/G = 27/32 of it for the row-mean types (the placeholders count as rows)."""
    from trl import GRPOTrainer

    trainer = generated
    trainer.loss_type = loss_type  # what `_compute_loss` reads; the batch is the same for all
    trainer.importance_sampling_level = config.get("importance_sampling_level", "token")
    (inputs,) = trainer._buffered_inputs
    trainer.model.train()
    ours = grads(trainer, trainer._compute_loss, inputs)
    alone = grads(
        trainer, lambda m, x: GRPOTrainer._compute_loss(trainer, m, x), trainable_only(inputs)
    )
    stock = grads(trainer, lambda m, x: GRPOTrainer._compute_loss(trainer, m, x), inputs)
    assert float(ours.norm()) > 0
    assert float((ours - alone).norm() / ours.norm()) < 1e-5  # float32 rounding only
    factor = (ROWS - len(PLACEHOLDER_ROWS)) / ROWS if loss_type in ROW_MEAN_LOSS_TYPES else 1.0
    assert float(stock.norm() / ours.norm()) == pytest.approx(factor, rel=2e-3)


def test_the_factor_holds_across_accumulated_micro_batches_end_to_end(
    example: Any, sqlite_url: str, tmp_path: Path
) -> None:
    """The same rollouts through stock GRPOTrainer and LedgerGRPOTrainer, one optimizer step of
    two micro-batches (TRL's shuffle and split in between): the logged gradient norms differ by
    G/R = 32/27 (up to the rounding of a gradient whose group-centred terms nearly cancel)."""
    from trl import GRPOTrainer

    faults = {(0, i): ["error"] for i in PLACEHOLDER_ROWS}
    norms = {}
    with SyncLedger.open(sqlite_url) as ledger:
        for name, cls in (("stock", GRPOTrainer), ("ledger", None)):
            rollout = LedgerRollout(Plan(example.tiny_tokenizer(), faults).runner, ledger)
            options = dict(per_device_train_batch_size=ROWS // 2, gradient_accumulation_steps=2)
            trainer = trainer_for(example, rollout, tmp_path / name, cls=cls, steps=1, **options)
            if cls is GRPOTrainer:  # stock TRL with loss_type grpo: the wrapper says what it costs
                with pytest.warns(UserWarning, match="LedgerGRPOTrainer"):
                    trainer.train()
            else:
                trainer.train()
            rollout.close()
            norms[name] = next(
                e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e
            )
    assert trainer._ledger_counts[0][1] == trainer._ledger_counts[1][1] == ROWS // 2
    assert sum(c[0] for c in trainer._ledger_counts) == ROWS - len(PLACEHOLDER_ROWS)
    assert norms["ledger"] / norms["stock"] == pytest.approx(
        ROWS / (ROWS - len(PLACEHOLDER_ROWS)), rel=2e-3
    )


def test_a_trainer_without_the_companion_or_with_several_generations_a_step_is_refused(
    example: Any, sqlite_url: str, tmp_path: Path
) -> None:
    """LedgerGRPOTrainer refuses a wrong setup when it is built, before any rollout; TRL's own
    GRPOTrainer refuses it at the first rollout, before any session is recorded."""
    from trl import GRPOTrainer

    plan = Plan(example.tiny_tokenizer(), {})
    with SyncLedger.open(sqlite_url) as ledger:
        rollout = LedgerRollout(plan.runner, ledger)
        other = LedgerRollout(plan.runner, ledger)
        with pytest.raises(TRLSetupError, match="reward_funcs lack this rollout's companion"):
            trainer_for(example, (rollout, other.reward), tmp_path / "a", steps=1)
        trainer = trainer_for(
            example, (rollout, other.reward), tmp_path / "a", cls=GRPOTrainer, steps=1
        )
        with pytest.raises(TRLSetupError, match="reward_funcs lack this rollout's companion"):
            trainer.train()
        assert ledger.metrics("train", 0) == []  # nothing recorded
        rollout = LedgerRollout(plan.runner, ledger)
        options = dict(
            per_device_train_batch_size=ROWS // 4,
            gradient_accumulation_steps=4,
            steps_per_generation=1,
        )
        with pytest.raises(TRLSetupError, match="several\\s+times per optimizer step"):
            trainer_for(example, rollout, tmp_path / "b", steps=1, **options)
        rollout.close()
        other.close()


def test_the_example_trains_and_shows_the_crash_without_the_ledger(example: Any) -> None:
    done, took = run_script(ROOT / "examples" / "trl_grpo.py", "--steps", "2", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    rows = [line.split() for line in lines if line[:4].strip().isdigit()]
    assert len(rows) == 2
    for _, trl_reward, honest, success_only, failed in rows:
        assert (
            trl_reward == success_only and float(honest) < float(trl_reward) and float(failed) > 0
        )
    assert any(line.startswith("without the ledger: train() raised") for line in lines), done.stdout


def test_a_sandbox_service_that_is_down_halts_train_before_it_trains_on_zeros(
    example: Any, sqlite_url: str, tmp_path: Path
) -> None:
    """Every sandbox of step 0 fails to start (`sandbox_error`, an infrastructure failure): its
    sessions all settle, and `train()` stops with the breaker's `RunHalted` (naming the cause
    and how to resume, docs/failures.md) before an optimizer step trains on the zeros."""
    from sessions import CircuitBreaker, RunHalted

    plan = Plan(example.tiny_tokenizer(), {(0, i): ["sandbox"] for i in range(ROWS)})
    breaker = CircuitBreaker(consecutive=4, window=None)
    with SyncLedger.open(sqlite_url, circuit_breaker=breaker) as ledger:
        rollout = LedgerRollout(plan.runner, ledger)
        trainer = trainer_for(example, rollout, tmp_path, steps=2)
        with pytest.raises(RunHalted, match=r"sandbox_error ×\d+.*new launch"):
            trainer.train()
        rollout.close()
        ours = figures(ledger, "train", 0)
    assert ours["failed/sandbox_error"] == ROWS  # step 0 settled whole before the halt
    assert trainer.state.global_step == 0  # no optimizer step on the step that saw the outage
