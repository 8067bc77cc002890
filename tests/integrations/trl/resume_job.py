"""One launch of a TRL job for the resume test (`test_trl_resume.py`), as its own process.

`crash`: trains with a checkpoint after every step and dies (`os._exit`) inside a runner of the
third step's rollouts (TRL's `global_step` 2), the other sessions of the step in whatever state
they reached: the process is gone, its open sessions with it. `resume`: the same job started again
with `resume_from_checkpoint=True`, which re-runs that step from checkpoint-2 with new uids. Prints
TRL's log (the entries with a reward) as one JSON line.

    python -m tests.integrations.trl.resume_job URL FOLDER crash|resume
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from sessions import SyncLedger
from sessions.integrations.trl import LedgerGRPOTrainer, LedgerRollout, RolloutContext
from tests.integrations.trl.test_trl import PROMPTS, ROWS, load_example, reward_of

RUN = "trl-resume"
#: TRL's global step whose rollouts the first launch dies in, and the row whose runner kills it.
CRASH_STEP, CRASH_ROW = 2, 5
STEPS = 4
EXIT_CODE = 17


def main(url: str, folder: str, phase: str) -> None:
    example = load_example()
    tokenizer = example.tiny_tokenizer()

    async def runner(prompt: str, context: RolloutContext) -> dict[str, Any]:
        if phase == "crash" and context.global_step == CRASH_STEP and context.row == CRASH_ROW:
            os._exit(EXIT_CODE)  # the worker is killed mid-step: no session of it ends
        return {
            "prompt_ids": tokenizer(prompt)["input_ids"],
            "completion_ids": [3 + (context.row * 7 + context.call) % 60, 1],
            "reward": reward_of(context.global_step, context.row),
        }

    with SyncLedger.open(url, run=RUN) as ledger:
        rollout = LedgerRollout(runner, ledger, timeout=30.0)
        trainer = LedgerGRPOTrainer(
            model=example.tiny_model(0),
            reward_funcs=rollout.reward,
            args=example.grpo_config(
                folder,
                STEPS,
                per_device_train_batch_size=ROWS,
                learning_rate=1e-3,
                loss_type="grpo",
                save_strategy="steps",
                save_steps=1,
            ),
            train_dataset=example.prompt_dataset(PROMPTS),
            processing_class=tokenizer,
            rollout_func=rollout,
        )
        try:
            trainer.train(resume_from_checkpoint=True if phase == "resume" else None)
        finally:
            rollout.close()
    print(json.dumps([entry for entry in trainer.state.log_history if "reward" in entry]))


if __name__ == "__main__":
    main(*sys.argv[1:4])
