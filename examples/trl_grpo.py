"""Train a tiny policy with TRL's GRPOTrainer on CPU, the ledger behind its rollouts.

Each completion is a ledger session: a runner samples from the policy in a toy sandbox, and some
fail on purpose: the sandbox fails to start (infrastructure, retried once), the runner raises (a
malformed tool call), or it hangs past its timeout. TRL trains on through every step; failed
sessions reach it as masked placeholder rows with no reward. Prints, per step, TRL's logged
`reward` (the mean over scored rows: the survivors) beside the ledger's `reward/mean` (failures
as zeros) and `reward/mean_success_only`, then the same run without the wrapper, which crashes.

    python examples/trl_grpo.py [--steps 3] [--db NEW.db] [--seed 0]

Needs `pip install -e '.[trl]'`; nothing is downloaded (the model and tokenizer are built here).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    PrinterCallback,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from sessions import RetryPolicy, SandboxError, SyncLedger  # noqa: E402
from sessions.integrations.trl import LedgerGRPOTrainer, LedgerRollout, RolloutContext  # noqa: E402

WORDS = 61  # tokens w0 … w60, after <pad>, <eos> and <bos>
PAD, EOS, BOS = 0, 1, 2
GROUP = 4  # completions per prompt (TRL's num_generations)
PROMPTS = 16  # prompts per step: 64 sessions a step
TIMEOUT = 2.0  # seconds per attempt of a session
CONCURRENCY = 4  # sessions at once (each synchronous runner call on a thread of its own)


# --------------------------------------------------------------------- a policy built locally
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `w0 … w60`, left-padding as TRL requires."""
    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, **{f"w{i}": i + 3 for i in range(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights (a few thousand parameters)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=WORDS + 3,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )
    return LlamaForCausalLM(config)


def prompt_dataset(n: int = PROMPTS) -> Dataset:
    """Counting prompts, `w3 w4 w5`: the task is to go on with larger words."""
    return Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(n)]})


def count_reward(prompt: str, completion_ids: list[int]) -> float:
    """The share of completion tokens that are words larger than the prompt's last one."""
    last = int(prompt.split()[-1][1:]) + 3
    return sum(t > last for t in completion_ids) / len(completion_ids)


# ----------------------------------------------------------------- a sandbox that can fail
class Faults:
    """Which runner calls fail, and how: drawn from (seed, step, row, attempt), so a run repeats
    whatever order the concurrent sessions start in."""

    def __init__(
        self, seed: int, sandbox: float = 0.10, error: float = 0.08, hang: float = 0.03
    ) -> None:
        self.seed = seed
        self.sandbox, self.error, self.hang = sandbox, sandbox + error, sandbox + error + hang
        self.release = threading.Event()  # set at the end: hung runner threads return
        self._attempts: dict[str, int] = {}
        self._lock = threading.Lock()

    def draw(self, context: RolloutContext) -> str | None:
        with self._lock:
            attempt = self._attempts[context.session_id] = (
                self._attempts.get(context.session_id, 0) + 1
            )
        u = random.Random(f"{self.seed}-{context.global_step}-{context.row}-{attempt}").random()
        if u < self.sandbox:
            return "sandbox"
        if u < self.error:
            return "error"
        if u < self.hang:
            return "hang"
        return None


class Sandbox:
    """The environment a rollout runs in; `reset` is where a real one starts a container."""

    def __init__(self, fault: str | None, release: threading.Event) -> None:
        self.fault, self.release = fault, release

    def reset(self) -> None:
        if self.fault == "sandbox":
            raise SandboxError("the sandbox failed to start")

    def step(self) -> None:
        if self.fault == "error":
            raise RuntimeError("malformed tool call")
        if self.fault == "hang":
            self.release.wait(60)  # a hung tool call: the session's timeout ends the session


def make_runner(tokenizer: PreTrainedTokenizerFast, faults: Faults, max_new_tokens: int = 6) -> Any:
    """A synchronous runner: start the sandbox, sample a completion from the policy, score it."""

    def runner(prompt: str, context: RolloutContext) -> dict[str, Any]:
        sandbox = Sandbox(faults.draw(context), faults.release)
        sandbox.reset()
        prompt_ids = tokenizer(prompt)["input_ids"]
        model = context.trainer.accelerator.unwrap_model(context.trainer.model)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=True,
                pad_token_id=PAD,
                eos_token_id=EOS,
            )
        completion_ids = out[0, len(prompt_ids) :].tolist()
        sandbox.step()
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "reward": count_reward(prompt, completion_ids),
        }

    return runner


def grpo_config(output_dir: str, steps: int, **overrides: Any) -> Any:
    from trl import GRPOConfig

    options: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=PROMPTS * GROUP,  # one optimizer step = one generation
        num_generations=GROUP,
        max_steps=steps,
        max_completion_length=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    options.update(overrides)
    return GRPOConfig(**options)


# ------------------------------------------------------------------------------- the runs
def with_ledger(url: str, steps: int, seed: int, folder: str) -> list[dict[str, Any]]:
    """Train through the ledger; TRL's log, one entry per step."""
    tokenizer = tiny_tokenizer()
    faults = Faults(seed)
    retry = RetryPolicy(max_attempts=2)  # infrastructure failures (the sandbox) get a second try
    with SyncLedger.open(url, run=f"trl-example-{seed}", retry_policy=retry) as ledger:
        rollout = LedgerRollout(
            make_runner(tokenizer, faults), ledger, timeout=TIMEOUT, concurrency=CONCURRENCY
        )
        trainer = LedgerGRPOTrainer(
            model=tiny_model(seed),
            reward_funcs=rollout.reward,
            args=grpo_config(folder, steps, loss_type="grpo"),
            train_dataset=prompt_dataset(),
            processing_class=tokenizer,
            rollout_func=rollout,
        )
        trainer.remove_callback(PrinterCallback)  # the table below says what matters
        try:
            trainer.train()
        finally:
            rollout.close()  # first: a hung call that returns now finds nobody waiting
            faults.release.set()
    return [entry for entry in trainer.state.log_history if "reward" in entry]


def without_ledger(steps: int, seed: int, folder: str) -> BaseException | None:
    """The same runner and failures as a plain rollout_func: the first failure ends train()."""
    from trl import GRPOTrainer

    tokenizer = tiny_tokenizer()
    faults = Faults(seed)
    runner = make_runner(tokenizer, faults)

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, Any]:
        step = trainer.state.global_step
        rows = [
            runner(
                p, RolloutContext(trainer, f"plain-{step}-{i}", "plain", 0, "train", step, i, step)
            )
            for i, p in enumerate(prompts)
        ]
        return {
            "prompt_ids": [r["prompt_ids"] for r in rows],
            "completion_ids": [r["completion_ids"] for r in rows],
            "logprobs": None,
            "score": [r["reward"] for r in rows],
        }

    def score(completions: Any, score: list[float], **_: Any) -> list[float]:
        return score

    trainer = GRPOTrainer(
        model=tiny_model(seed),
        reward_funcs=score,
        args=grpo_config(folder, steps),
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
    except Exception as error:  # noqa: BLE001 - what the example shows
        return error
    finally:
        faults.release.set()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--db", help="a new SQLite file (default: one in a temporary folder)")
    args = parser.parse_args(argv)
    hf_logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(
        logging.ERROR
    )  # TRL warns per batch: a placeholder has no reward
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as folder:
        db = Path(args.db) if args.db else Path(folder) / "ledger.db"
        if db.exists():
            sys.exit(f"{db} exists; give the example a new file")
        started = time.monotonic()
        log = with_ledger(f"sqlite+aiosqlite:///{db}", args.steps, args.seed, folder)
        took = time.monotonic() - started
        print(f"with the ledger: {len(log)} steps in {took:.1f} s")
        print("step  TRL reward  ledger reward/mean  ledger reward/mean_success_only  failed")
        for entry in log:
            figures = {k.split("/all/", 1)[-1]: v for k, v in entry.items() if "/all/" in k}
            print(
                f"{entry['step'] - 1:>4}  {entry['reward']:>10.4f}  {figures['reward/mean']:>18.4f}"
                f"  {figures['reward/mean_success_only']:>31.4f}  {figures['sessions/failed']:>6g}"
            )
        started = time.monotonic()
        error = without_ledger(args.steps, args.seed, folder)
        took = time.monotonic() - started
        if error is None:
            print(f"without the ledger: train() finished in {took:.1f} s (no failure was drawn)")
        else:
            print(
                f"without the ledger: train() raised {type(error).__name__} after {took:.1f} s: {error}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
