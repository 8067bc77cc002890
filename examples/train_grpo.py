"""Train a small policy with GRPO, every rollout a ledger session, and show what the run reports.

A causal transformer of about 0.1M parameters learns the toy task of `toy_rl.py` (the largest
of 1-4 digits, exact match of the final answer) on CPU. Each step samples a group of responses
per prompt; each response is an agent run recorded through `Ledger.run_session`, and agent runs
fail as they do in practice: sandboxes crash (infra: retried), tool calls hang past their
timeout (a real asyncio timeout), agent code raises, and the rollout engine preempts sessions
(a real task cancellation). Harder prompts fail more, so the success-only reward drifts above
the honest one (failures counted as zeros) as the policy learns. The step's batch comes back
from the ledger, goes to verl with `to_data_proto`, and verl's own `compute_advantage` (GRPO),
policy loss (`get_policy_loss_fn`) and `agg_loss` update the policy; a validation step every few
steps reports verl's `val-core/maxdigit/reward/mean@4`. Each step prints a row of a table,
with the ledger's cost per session recorded and the share of the step's wall time spent in
the ledger. The cost per session is the figure to read: the share is that cost against the
policy's own time, so it is largest beside this tiny policy and falls as the policy grows.

At the end the run is its own evidence: `rollout-ledger audit` checks the log and the stored
read models, `rollout-ledger replay` rebuilds them into a fresh database, and every figure the
run logged is computed again from the replay and compared. `docs/training.md` walks through it.

    pip install -e '.[verl]'                    # from a clone (verl 0.9.1 and its pins)
    python examples/train_grpo.py               # about two minutes on 2 CPU cores
    python examples/train_grpo.py --resume      # after a crash: on from train_grpo.ckpt
    rollout-ledger report --db train_grpo.db --out report/
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # toy_rl, beside this file

from toy_rl import (  # noqa: E402
    DATA_SOURCE,
    LEVEL_WEIGHT,
    MAX_NEW_TOKENS,
    MAX_PROMPT,
    Faults,
    Policy,
    Problem,
    Sampler,
    problems,
    response_logits,
)

from sessions import Ledger, RetryPolicy, SandboxError, to_data_proto  # noqa: E402

with warnings.catch_warnings():  # verl warns about engines it has no package for (megatron, ...)
    warnings.simplefilter("ignore")
    from verl import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator, agg_loss, get_policy_loss_fn
    from verl.trainer.ppo.metric_utils import compute_data_metrics
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.trainer.ppo.reward import extract_reward
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
    from verl.workers.config import ActorConfig

#: Seconds a tool call may take before it is a timeout; a hung call waits that long (asyncio).
TOOL_TIMEOUT = 0.05
#: A session's own deadline (generous: nothing here should reach it).
SESSION_TIMEOUT = 60.0
#: verl's max_prompt_length / max_response_length: every step's batch has these widths.
WIDTHS = dict(max_prompt_length=MAX_PROMPT, max_response_length=MAX_NEW_TOKENS)
REASONS = ("runner_error", "timeout", "sandbox_error")


@dataclass
class Settings:
    """What a run is. The command line sets the first group; `docs/training.md` says what each
    changes. The whole object but its paths is the run's fingerprint in the ledger."""

    steps: int = 250
    fail_rate: float = 0.2
    cancel_rate: float = 0.02
    seed: int = 0
    db: str = "train_grpo.db"
    run: str | None = None
    val_every: int = 10
    max_attempts: int = 3
    tensorboard: str | None = None
    evidence: bool = True
    quiet: bool = False
    #: where the trainer's state goes after every step, and whether to start from it
    checkpoint: str = "train_grpo.ckpt"
    resume: bool = False
    # the shape of a step and of the update
    prompts: int = 16
    group_size: int = 8
    val_prompts: int = 32
    val_n: int = 4
    lr: float = 3e-3
    width: int = 64
    ppo_epochs: int = 2
    mini_batches: int = 2
    entropy_coeff: float = 0.001

    def fingerprint(self) -> dict[str, Any]:
        paths = ("db", "run", "tensorboard", "evidence", "quiet", "checkpoint", "resume")
        return {k: v for k, v in vars(self).items() if k not in paths}


# ------------------------------------------------------------------------------ the loop
async def train(settings: Settings) -> RunResult:
    """The whole run: every step's record and, with `settings.evidence`, audit and replay."""
    # Each start of the script is a launch of its run (docs/design.md §14): a resumed one re-runs
    # the step the last launch died in with new uids, and the ledger counts that step on the
    # new launch's sessions only, having failed the dead launch's open ones at once.
    launch = f"train-grpo-{uuid.uuid4().hex[:12]}"
    trainer = Trainer(settings, tag=f"r{launch[-6:]}" if settings.resume else "")
    start, run = 0, settings.run or f"grpo-s{settings.seed}-{uuid.uuid4().hex[:6]}"
    if settings.resume:
        start, run = trainer.restore(Path(settings.checkpoint))
    url = settings.db if "://" in settings.db else f"sqlite+aiosqlite:///{settings.db}"
    records: list[StepRecord] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # matrices this small gain nothing from threads; SQLite's writer has the other core
    try:
        async with Ledger.open(
            url,
            run=run,
            retry_policy=RetryPolicy(max_attempts=settings.max_attempts, on=("infra",)),
            config=settings.fingerprint(),
            launch=launch,
        ) as ledger:
            print_header(settings, run, url, trainer.parameters)
            trainer.clock.take()
            for step in range(start, settings.steps):
                record = await trainer.step(ledger, step)
                records.append(record)
                trainer.save(Path(settings.checkpoint), run, step + 1)
                if not settings.quiet:
                    print(table_row(record), flush=True)
    finally:
        torch.set_num_threads(threads)
        trainer.close()
    evidence = await check_evidence(url, run, records) if settings.evidence else None
    result = RunResult(settings, run, url, trainer.parameters, records, evidence)
    if not settings.quiet:
        print_summary(result)
    return result


class Trainer:
    """The policy, its optimizer and what a step uses around them."""

    def __init__(self, settings: Settings, tag: str = "") -> None:
        self.settings = settings
        #: a resumed launch's mark in its prompts' uids (and so its session ids): new uids for
        #: the step it re-runs, as verl's trainer draws new ones
        self.tag = tag
        torch.manual_seed(settings.seed)
        self.policy = Policy(width=settings.width)
        self.parameters = sum(p.numel() for p in self.policy.parameters())
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=settings.lr)
        # the learning rate falls linearly to a tenth over the run: late steps refine, not jump
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: 1 - 0.9 * step / settings.steps
        )
        self.clock = Clock()
        self.sampler = Sampler(self.policy, timer=self.clock.policy)
        self.faults = Faults(settings.fail_rate, settings.cancel_rate, settings.seed)
        self.actor = ActorConfig(
            strategy="fsdp",
            rollout_n=settings.group_size,
            ppo_mini_batch_size=settings.prompts // settings.mini_batches,  # in prompts, as verl's
            ppo_micro_batch_size_per_gpu=settings.prompts * settings.group_size,
            ppo_epochs=settings.ppo_epochs,
            entropy_coeff=settings.entropy_coeff,
            loss_agg_mode="token-mean",
        )
        self.rng = random.Random(settings.seed)
        self.val_set = problems(random.Random(settings.seed + 1), settings.val_prompts, f"v{tag}")
        self.board = None
        if settings.tensorboard:
            from sessions.trackers import TensorBoardTracker

            self.board = TensorBoardTracker(settings.tensorboard)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()

    def save(self, path: Path, run: str, next_step: int) -> None:
        """The trainer's state after a step, written beside `path` and renamed into place (a
        kill while writing leaves the previous checkpoint)."""
        state = {
            "run": run,
            "next_step": next_step,
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "rng": self.rng.getstate(),
            "torch_rng": torch.get_rng_state(),
        }
        partial = path.with_name(path.name + ".partial")
        torch.save(state, partial)
        partial.replace(path)

    def restore(self, path: Path) -> tuple[int, str]:
        """Load a checkpoint `save` wrote; returns the step to go on from and the run."""
        if not path.is_file():
            raise SystemExit(f"--resume: no checkpoint at {path}; run without --resume first")
        state = torch.load(path, weights_only=False)  # our own file: rng states are tuples
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        return int(state["next_step"]), str(state["run"])

    async def step(self, ledger: Ledger, step: int) -> StepRecord:
        """A training step, a validation step when one is due, and what they logged."""
        s = self.settings
        train, actor, verl = await self.train_step(ledger, step)
        val = val_rows = None
        if step % s.val_every == 0 or step == s.steps - 1:
            val, val_rows, val_verl = await self.validate(ledger, step)
            verl = verl.merged(val_verl)
        if self.board is not None:
            await self.log_to_board(ledger, step, val is not None)
        record = StepRecord(step, train, val, val_rows, actor, self.clock.take(), verl)
        if self.board is not None:
            log_own_scalars(self.board, record)
        return record

    async def train_step(
        self, ledger: Ledger, step: int
    ) -> tuple[dict[str, float], dict[str, float], Agreement]:
        s, clock = self.settings, self.clock
        # 1. rollouts: every sample an agent run, recorded as a session as it runs
        batch_problems = problems(self.rng, s.prompts, f"t{step}{self.tag}")
        await rollouts(
            ledger, self.sampler, self.faults, clock, batch_problems, "train", step, s.group_size
        )
        # 2. the step from the ledger: its batch (verl's columns; a failure is a masked
        #    reward-0 placeholder row, a cancellation no row) and the figures to log
        with clock.ledger("projection"):
            await ledger.project()
        with clock.ledger("batch"):
            batch = await ledger.batch(
                "train", step, prompt_width=MAX_PROMPT, response_width=MAX_NEW_TOKENS
            )
            data = sorted_by_group(to_data_proto(batch))  # each placeholder a group of its own
        with clock.ledger("metrics"):
            figures = await ledger.metrics_dict("train", step, **WIDTHS)
        # 3. verl from here on: the reward, the GRPO advantage, the actor's update
        with clock.policy("update"):
            reward, _ = extract_reward(data)
            data.batch["token_level_scores"] = data.batch["token_level_rewards"] = reward
            data = compute_advantage(data, adv_estimator=AdvantageEstimator.GRPO)
        actor = ppo_update(self.policy, self.optimizer, data, self.actor, clock)
        self.schedule.step()
        # 4. verl's own figures on the batch it trained on are the ledger's
        verl = Agreement.of(figures, compute_data_metrics(batch=data, use_critic=False))
        return figures, actor, verl

    async def validate(
        self, ledger: Ledger, step: int
    ) -> tuple[dict[str, float], dict[str, list[Any]], Agreement]:
        s, clock = self.settings, self.clock
        await rollouts(ledger, self.sampler, self.faults, clock, self.val_set, "val", step, s.val_n)
        with clock.ledger("projection"):
            await ledger.project()
        with clock.ledger("batch"):
            data = to_data_proto(await ledger.batch("val", step))  # val: uids kept as they are
        with clock.ledger("metrics"):
            figures = await ledger.metrics_dict("val", step)
        verl = Agreement.of(figures, verl_val_metrics(data), complete=True)
        rows = {
            "data_sources": list(data.non_tensor_batch["data_source"]),
            "uids": list(data.non_tensor_batch["uid"]),
            "scores": data.batch["rm_scores"].sum(-1).tolist(),
            "turns": [int(t) for t in data.non_tensor_batch["__num_turns__"]],
        }
        return figures, rows, verl

    async def log_to_board(self, ledger: Ledger, step: int, validated: bool) -> None:
        """The same scalars into TensorBoard, through the ledger's own sink."""
        from sessions.trackers import log_step

        with self.clock.ledger("trackers"):
            for partition in ("train", "val") if validated else ("train",):
                await log_step(ledger, partition, step, trackers=[self.board], **WIDTHS)


# ------------------------------------------------------------------------------ rollouts
async def tool_call(fate: str, session_task: asyncio.Task[Any]) -> None:
    """The agent's tool run, as the fault plan has it go."""
    if fate == "sandbox_error":
        raise SandboxError("the sandbox crashed during the tool call")
    if fate == "runner_error":
        raise RuntimeError("the agent's tool call did not parse")
    if fate == "timeout":  # the tool hangs; asyncio's timeout ends the wait (TimeoutError)
        await asyncio.wait_for(asyncio.Event().wait(), TOOL_TIMEOUT)
    if fate == "preempted":  # the rollout engine takes the slot back: a real task cancellation
        asyncio.get_running_loop().call_soon(session_task.cancel)
        await asyncio.Event().wait()


async def rollouts(
    ledger: Ledger,
    sampler: Sampler,
    faults: Faults,
    clock: Clock,
    batch: list[Problem],
    partition: str,
    step: int,
    group_size: int,
) -> None:
    """Every (problem, sample) an agent run recorded as a session, all at once."""
    tasks: dict[str, asyncio.Task[Any]] = {}

    def agent(problem: Problem, key: str):  # noqa: ANN202 - a runner
        async def runner(session) -> None:  # noqa: ANN001 - a SessionHandle
            with clock.away():  # the agent's own time, inside run_session
                fate = faults.fate(key, session.attempt, problem.level)
                seed = faults.noise_seed(key, session.attempt)
                response, logprobs = await sampler.generate(problem.prompt_ids, seed)
                with clock.ledger():
                    await session.record_trajectory(
                        prompt_ids=problem.prompt_ids,
                        response_ids=response,
                        response_logprobs=logprobs,
                    )
                await tool_call(fate, tasks[key])
                reward = problem.reward(response)
                with clock.ledger():
                    await session.post_reward(reward, acc=reward, level=problem.level)

        return runner

    async def one(problem: Problem, index: int, key: str) -> Any:
        with clock.ledger():
            return await ledger.run_session(
                agent(problem, key),
                f"{ledger.run}-{key}",  # session ids are unique in the database, across runs
                uid=problem.uid,
                session_index=index,
                group_size=group_size,
                partition=partition,
                global_step=step,
                data_source=DATA_SOURCE,
                timeout=SESSION_TIMEOUT,
            )

    for problem in batch:
        for index in range(group_size):
            key = f"{partition}{step}-{problem.uid}-{index}"  # what the session meets is drawn from it
            tasks[key] = asyncio.create_task(one(problem, index, key))
    await asyncio.gather(*tasks.values(), return_exceptions=True)  # cancelled ones included


def sorted_by_group(data: DataProto) -> DataProto:
    """Rows in (prompt, sample) order: the log's order follows the event loop's, and the
    mini-batches (and so the run) should not."""
    keys = list(zip(data.non_tensor_batch["group_uid"], data.non_tensor_batch["session_index"]))
    data.reorder(torch.tensor(sorted(range(len(keys)), key=keys.__getitem__)))
    return data


# ------------------------------------------------------------------------------ the update
def ppo_update(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    data: DataProto,
    config: ActorConfig,
    clock: Clock,
) -> dict[str, float]:
    """verl's actor update on one step's batch: old log-probs, then `ppo_epochs` passes over
    mini-batches; the policy moves between them, so all but the first are off-policy (ratios
    away from 1, clipping). Each loss is verl's policy loss and its `agg_loss` of the entropy."""
    with clock.policy("update"), torch.no_grad():
        data.batch["old_log_probs"] = logprobs_from_logits(
            response_logits(policy, data.batch), data.batch["responses"]
        )
    policy_loss = get_policy_loss_fn(config.policy_loss.loss_mode)
    rows = config.ppo_mini_batch_size * config.rollout_n  # verl counts mini-batches in prompts
    seen: dict[str, list[float]] = {}
    with clock.policy("update"):
        for _ in range(config.ppo_epochs):
            for mini in data.split(rows):
                mask = mini.batch["response_mask"]
                if not mask.any():  # no loss token: verl's token-mean would be 0/0
                    continue
                logits = response_logits(policy, mini.batch)
                pg_loss, pg_metrics = policy_loss(
                    old_log_prob=mini.batch["old_log_probs"],
                    log_prob=logprobs_from_logits(logits, mini.batch["responses"]),
                    advantages=mini.batch["advantages"],
                    response_mask=mask,
                    loss_agg_mode=config.loss_agg_mode,
                    config=config,
                )
                entropy = agg_loss(
                    loss_mat=entropy_from_logits(logits),
                    loss_mask=mask,
                    loss_agg_mode=config.loss_agg_mode,
                )
                loss = pg_loss - config.entropy_coeff * entropy
                optimizer.zero_grad()
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm=1.0)
                optimizer.step()
                for name, value in {
                    "actor/pg_loss": pg_loss.item(),
                    "actor/entropy": entropy.item(),
                    "actor/grad_norm": float(grad_norm),
                    **pg_metrics,
                }.items():
                    seen.setdefault(name, []).append(float(value))
    return {name: statistics.fmean(values) for name, values in seen.items()}


# ------------------------------------------------------------------------------ verl's figures
def verl_val_metrics(val: DataProto) -> dict[str, float]:
    """verl's validation figures on the val batch, as its V0 `_validate` computes them:
    `_val_metrics_update(process_validation_metrics(...))` (the method uses nothing of `self`)."""
    reward, _ = extract_reward(val)
    return RayPPOTrainer._val_metrics_update(
        None,
        val.non_tensor_batch["data_source"],
        list(val.non_tensor_batch["uid"]),
        {"reward": reward.sum(-1).tolist()},
        [np.asarray(val.non_tensor_batch["__num_turns__"], dtype=np.int32)],
    )


@dataclass
class Agreement:
    """How many of verl's figures the ledger's dict reports, and which differ (> 1e-6)."""

    names: int
    differ: list[str]

    @classmethod
    def of(cls, ours: dict[str, float], verls: dict[str, Any], complete: bool = False) -> Agreement:
        shared = set(ours) & set(verls)
        differ = [
            n for n in sorted(shared) if not math.isclose(ours[n], float(verls[n]), abs_tol=1e-6)
        ]
        if complete and shared != set(verls):  # val: every one of verl's names is the ledger's too
            differ.append(f"missing: {sorted(set(verls) - shared)}")
        return cls(len(shared), differ)

    def merged(self, other: Agreement) -> Agreement:
        return Agreement(self.names + other.names, self.differ + other.differ)


# ------------------------------------------------------------------------------ the clock
class Clock:
    """Splits wall time by what is in flight: the policy's compute (`policy/<phase>`), a ledger
    call being awaited (`ledger/<phase>`), or neither (`other`: tool waits, this script's code).

    The policy computes on this thread, so its time is exact. Ledger time is any moment a ledger
    call is in flight and the policy is not computing: an upper bound, since the loop may run an
    agent's own code meanwhile.
    """

    def __init__(self) -> None:
        self._in_ledger = 0
        self._in_policy = 0
        self._ledger_phase = "recording"
        self._policy_phase = "sampling"
        self._mark = time.perf_counter()
        self.spent: Counter[str] = Counter()

    def _tick(self) -> None:
        now = time.perf_counter()
        if self._in_policy:
            key = "policy/" + self._policy_phase
        elif self._in_ledger:
            key = "ledger/" + self._ledger_phase
        else:
            key = "other"
        self.spent[key] += now - self._mark
        self._mark = now

    @contextlib.contextmanager
    def ledger(self, phase: str = "recording") -> Iterator[None]:
        self._tick()
        self._in_ledger += 1
        self._ledger_phase = phase
        try:
            yield
        finally:
            self._tick()
            self._in_ledger -= 1
            self._ledger_phase = "recording"

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """Inside a ledger call, the part that is the caller's own (a runner's body)."""
        self._tick()
        self._in_ledger -= 1
        try:
            yield
        finally:
            self._tick()
            self._in_ledger += 1

    @contextlib.contextmanager
    def policy(self, phase: str = "sampling") -> Iterator[None]:
        self._tick()
        self._in_policy += 1
        self._policy_phase = phase
        try:
            yield
        finally:
            self._tick()
            self._in_policy -= 1

    def take(self) -> dict[str, float]:
        """Seconds per category since the last call."""
        self._tick()
        spent, self.spent = dict(self.spent), Counter()
        return spent


def ledger_seconds(spent: dict[str, float]) -> float:
    return sum(v for k, v in spent.items() if k.startswith("ledger/"))


def policy_seconds(spent: dict[str, float]) -> float:
    return sum(v for k, v in spent.items() if k.startswith("policy/"))


def sessions_recorded(record: StepRecord) -> int:
    """The sessions a step recorded, training and validation: what its ledger time is spent on."""
    return sum(
        int(figures.get(f"ledger/{partition}/all/sessions/total", 0))
        for partition, figures in (("train", record.train), ("val", record.val or {}))
    )


def ledger_ms_per_session(record: StepRecord) -> float:
    """The step's ledger time over its sessions (ms): the cost that does not depend on the
    policy's size, unlike the share."""
    return 1e3 * ledger_seconds(record.seconds) / max(1, sessions_recorded(record))


# ------------------------------------------------------------------------------ records
@dataclass
class StepRecord:
    step: int
    train: dict[str, float]  # metrics_dict("train", step): what a tracker logs
    val: dict[str, float] | None
    #: what verl reads of the val batch: data sources, uids, scores, turns
    val_rows: dict[str, list[Any]] | None
    actor: dict[str, float]  # the update's verl actor/* figures, means over mini-batches
    seconds: dict[str, float]  # the clock's split of the step's wall time
    verl: Agreement


@dataclass
class Evidence:
    audit_ok: bool
    audit_output: str
    figures: int  # logged figures recomputed from the replayed log
    steps: int
    differ: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    settings: Settings
    run: str
    url: str
    parameters: int
    records: list[StepRecord]
    evidence: Evidence | None


def log_own_scalars(board: Any, record: StepRecord) -> None:
    """The script's own figures beside the ledger's: the actor's, and the ledger's time."""
    wall = sum(record.seconds.values())
    own = {
        **record.actor,
        "timing/ledger_share": ledger_seconds(record.seconds) / wall,
        "timing/ledger_s": ledger_seconds(record.seconds),
        "timing/ledger_ms_per_session": ledger_ms_per_session(record),
        "timing/policy_s": policy_seconds(record.seconds),
        "timing/step_s": wall,
    }
    for name, value in own.items():
        board.writer.add_scalar(name, value, global_step=record.step)
    board.writer.flush()


# ------------------------------------------------------------------------------ the evidence
def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`rollout-ledger ARGS`, with this Python."""
    return subprocess.run(
        [sys.executable, "-m", "sessions.cli", *args], capture_output=True, text=True
    )


async def check_evidence(url: str, run: str, records: list[StepRecord]) -> Evidence:
    """`audit` the log and the stored read models; `replay` the log into a fresh database and
    compute every logged figure again from there: each must be what the run logged."""
    audit = cli("audit", "--db", url)
    differ: list[str] = []
    figures = 0
    with tempfile.TemporaryDirectory(prefix="train-grpo-replay-") as folder:
        replayed = f"sqlite+aiosqlite:///{Path(folder) / 'replayed.db'}"
        replay = cli("replay", "--db", url, "--into", replayed)
        if replay.returncode != 0:
            differ.append(f"replay failed: {replay.stderr.strip()}")
        else:
            async with Ledger.open(replayed, run=run, migrate=False) as again:
                for record in records:
                    for partition, logged, options in (
                        ("train", record.train, WIDTHS),
                        ("val", record.val, {}),
                    ):
                        if logged is None:
                            continue
                        rebuilt = await again.metrics_dict(partition, record.step, **options)
                        figures += len(logged)
                        if rebuilt.keys() != logged.keys():
                            differ.append(f"{partition} {record.step}: the names differ")
                        differ += [
                            f"{partition} {record.step} {name}: {value} -> {rebuilt.get(name)}"
                            for name, value in logged.items()
                            if not same(value, rebuilt.get(name))
                        ]
    output = (audit.stdout + audit.stderr).strip()
    return Evidence(audit.returncode == 0, output, figures, len(records), differ)


def same(a: float, b: float | None) -> bool:
    return b is not None and (a == b or (math.isnan(a) and math.isnan(b)))


# ------------------------------------------------------------------------------ printing
HEADER = (
    f"{'':>5} | {'train':^13} | {'val':^21} | {'failed (train + val)':^24} | {'':>8} "
    f"| {'ledger':^18} | {'policy':>6}\n"
    f"{'step':>5} | {'mean':>6} {'succ':>6} | {'mean':>6} {'succ':>6} {'mean@4':>7} "
    f"| {'run':>4} {'time':>4} {'sbx':>4} {'canc':>4} {'retr':>4} | {'pg_loss':>8} "
    f"| {'ms':>5} {'ms/ses':>6} {'share':>5} | {'ms':>6}"
)
LEGEND = (
    "mean: reward/mean (failures as zeros); succ: reward/mean_success_only (failures dropped); "
    f"mean@4: verl's val-core/{DATA_SOURCE}/reward/mean@4\n"
    "failed: runner_error, timeout, sandbox_error (after retries), cancelled; retr: sessions "
    "retried; ledger: the step's time in the ledger, per session recorded (ms/ses), and as a "
    "share of the step's wall time (which falls as the policy grows; ms/ses does not)"
)


def print_header(settings: Settings, run: str, url: str, parameters: int) -> None:
    if settings.quiet:
        return
    levels = ", ".join(
        f"{k}: {settings.fail_rate * w:.2f}" for k, w in sorted(LEVEL_WEIGHT.items())
    )
    print(
        f"run {run} in {url}\n"
        f"{settings.steps} steps of {settings.prompts} prompts x {settings.group_size} samples; "
        f"val {settings.val_prompts} x {settings.val_n} every {settings.val_every} steps; policy "
        f"{parameters:,} parameters; failure rate per attempt by level {levels}; cancel rate "
        f"{settings.cancel_rate}; infra failures retried up to {settings.max_attempts} attempts; "
        f"seed {settings.seed}"
    )
    print(LEGEND)
    print(HEADER)


def failure_counts(record: StepRecord) -> Counter[str]:
    out: Counter[str] = Counter()
    for partition, figures in (("train", record.train), ("val", record.val)):
        if figures is None:
            continue
        scope = f"ledger/{partition}/all/"
        for reason in REASONS:
            out[reason] += int(figures.get(scope + f"failed/{reason}", 0))
        out["cancelled"] += int(figures.get(scope + "sessions/cancelled", 0))
        out["retried"] += int(figures.get(scope + "sessions/retried", 0))
    return out


def table_row(record: StepRecord) -> str:
    t, v = record.train, record.val
    val = f"{'':>6} {'':>6} {'':>7}"
    if v is not None:
        headline = v.get(f"val-core/{DATA_SOURCE}/reward/mean@4", math.nan)
        val = (
            f"{v['ledger/val/all/reward/mean']:6.3f} "
            f"{v['ledger/val/all/reward/mean_success_only']:6.3f} {headline:7.3f}"
        )
    c = failure_counts(record)
    wall, ledger = sum(record.seconds.values()), ledger_seconds(record.seconds)
    return (
        f"{record.step:>5} | {t['ledger/train/all/reward/mean']:6.3f} "
        f"{t['ledger/train/all/reward/mean_success_only']:6.3f} | {val} "
        f"| {c['runner_error']:4d} {c['timeout']:4d} {c['sandbox_error']:4d} {c['cancelled']:4d} "
        f"{c['retried']:4d} | {record.actor.get('actor/pg_loss', math.nan):+8.4f} "
        f"| {ledger * 1e3:5.0f} {ledger_ms_per_session(record):6.2f} {ledger / wall:5.0%} "
        f"| {policy_seconds(record.seconds) * 1e3:6.0f}"
    )


def per_step(total: Counter[str], prefix: str, steps: int) -> str:
    return ", ".join(
        f"{k.split('/', 1)[1]} {v / steps * 1e3:.1f}"
        for k, v in sorted(total.items())
        if k.startswith(prefix)
    )


def print_summary(result: RunResult) -> None:
    records = result.records
    shares = sorted(ledger_seconds(r.seconds) / sum(r.seconds.values()) for r in records)
    costs = sorted(ledger_ms_per_session(r) for r in records)
    total: Counter[str] = Counter()
    for r in records:
        total.update(r.seconds)
    wall, n = sum(total.values()), len(records)
    sessions = sum(sessions_recorded(r) for r in records)
    print(
        f"\nledger cost per session: median {statistics.median(costs):.2f} ms "
        f"(min {costs[0]:.2f}, max {costs[-1]:.2f}) over {n} steps of {sessions / n:.0f} "
        f"sessions on average; the policy's own time {1e3 * policy_seconds(total) / sessions:.2f} "
        f"ms per session ({result.parameters / 1e6:.2f}M parameters)"
    )
    print(
        f"ledger share of step time: median {statistics.median(shares):.1%} "
        f"(min {shares[0]:.1%}, max {shares[-1]:.1%}); of the whole run "
        f"{ledger_seconds(total) / wall:.1%} ledger, {policy_seconds(total) / wall:.1%} policy. "
        "The share is the cost per session against the policy's: it falls as the policy grows "
        "(docs/training.md)"
    )
    print(
        f"  ms per step: ledger {per_step(total, 'ledger/', n)}; policy "
        f"{per_step(total, 'policy/', n)}; other {total['other'] / n * 1e3:.1f}"
    )
    window = max(1, min(10, n // 4))
    rewards = [r.train["ledger/train/all/reward/mean"] for r in records]
    print(
        f"train reward/mean: first {window} steps {statistics.fmean(rewards[:window]):.3f}, "
        f"last {window} steps {statistics.fmean(rewards[-window:]):.3f}"
    )
    names = sum(r.verl.names for r in records)
    differ = [d for r in records for d in r.verl.differ]
    print(
        f"verl's compute_data_metrics (train) and _val_metrics_update (val) equal metrics_dict on "
        f"{names} figures over {n} steps: {'yes' if not differ else differ[:5]}"
    )
    evidence = result.evidence
    if evidence is not None:
        print(f"rollout-ledger audit: {'ok' if evidence.audit_ok else 'FAILED'}")
        for line in evidence.audit_output.splitlines()[-2:]:
            print(f"  {line}")
        verdict = (
            "every one reproduces"
            if not evidence.differ
            else f"{len(evidence.differ)} differ: {evidence.differ[:5]}"
        )
        print(
            f"rollout-ledger replay: {evidence.figures} logged figures of {evidence.steps} steps "
            f"computed again from the replayed log: {verdict}"
        )
    print(f"the curves: rollout-ledger report --db {result.url} --run {result.run} --out report/")


# ------------------------------------------------------------------------------ command line
def parse(argv: list[str] | None) -> Settings:
    d = Settings()
    parser = argparse.ArgumentParser(
        prog="train_grpo.py", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--steps", type=int, default=d.steps, help="training steps")
    parser.add_argument(
        "--fail-rate",
        type=float,
        default=d.fail_rate,
        help="failure rate of an attempt at the mean prompt level; by level x0.25, x0.75, x1.25, x1.75",
    )
    parser.add_argument(
        "--cancel-rate", type=float, default=d.cancel_rate, help="sessions preempted, any level"
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="everything random follows it")
    parser.add_argument(
        "--db", default=d.db, help="SQLite file or database URL; each run adds a run of its own"
    )
    parser.add_argument("--run", help="the run's name (default: grpo-s<seed>-<random>)")
    parser.add_argument("--val-every", type=int, default=d.val_every, help="steps between val")
    parser.add_argument(
        "--max-attempts", type=int, default=d.max_attempts, help="attempts for infra failures"
    )
    parser.add_argument("--tensorboard", metavar="DIR", help="log every step's scalars there too")
    parser.add_argument(
        "--no-evidence",
        dest="evidence",
        action="store_false",
        help="no audit and replay at the end",
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    parser.add_argument(
        "--checkpoint", default=d.checkpoint, help="the trainer's state, written after every step"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on from --checkpoint (its run and next step) as a new launch of the run",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.val_every < 1 or args.max_attempts < 1:
        parser.error("--steps, --val-every and --max-attempts must be >= 1")
    if not (0 <= args.fail_rate <= 1 / max(LEVEL_WEIGHT.values()) and 0 <= args.cancel_rate <= 1):
        parser.error(
            f"--fail-rate must be in [0, {1 / max(LEVEL_WEIGHT.values()):.3f}], --cancel-rate in [0, 1]"
        )
    return Settings(**vars(args))


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 when a check failed: verl's figures, the audit or the replay."""
    result = asyncio.run(train(parse(argv)))
    failed = any(r.verl.differ for r in result.records)
    if result.evidence is not None:
        failed = failed or not result.evidence.audit_ok or bool(result.evidence.differ)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
