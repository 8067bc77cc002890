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
steps reports verl's `val-core/.../reward/mean@4`. Each step prints a table row, including the
share of the step's wall time spent in the ledger.

At the end the run is its own evidence: `rollout-ledger audit` checks the log and the stored
read models, `rollout-ledger replay` rebuilds them into a fresh database, and every figure the
run logged is computed again from the replay and compared. `docs/training.md` walks through it.

    pip install -e '.[verl]'                    # from a clone (verl 0.9.1 and its pins)
    python examples/train_grpo.py               # about two minutes on 2 CPU cores
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

#: Seconds a tool call may take before it is a timeout; a hung call waits for it (asyncio).
TOOL_TIMEOUT = 0.05
#: A session's own deadline (generous: nothing here should reach it).
SESSION_TIMEOUT = 60.0
REASONS = ("runner_error", "timeout", "sandbox_error")


@dataclass
class Settings:
    """What a run is; every field is a flag of `main` (see `docs/training.md`)."""

    steps: int = 300
    fail_rate: float = 0.2
    cancel_rate: float = 0.02
    seed: int = 0
    db: str = "train_grpo.db"
    run: str | None = None
    prompts: int = 16
    group_size: int = 8
    val_prompts: int = 32
    val_n: int = 4
    val_every: int = 10
    max_attempts: int = 3
    lr: float = 3e-3
    width: int = 64
    ppo_epochs: int = 2
    mini_batches: int = 2
    entropy_coeff: float = 0.001
    tensorboard: str | None = None
    evidence: bool = True
    quiet: bool = False


# ------------------------------------------------------------------------------ the clock
class Clock:
    """Splits a step's wall time by what is in flight: the policy's compute, a ledger call being
    awaited (`ledger`, labelled by phase), or neither (tool waits, this script's own code).

    The policy runs on this thread, so its time is exact. Ledger time is any moment some ledger
    call is in flight and the policy is not: an upper bound, since the loop may run an agent's
    own code meanwhile.
    """

    def __init__(self) -> None:
        self._in_ledger = 0
        self._in_policy = 0
        self._phase = "recording"
        self._mark = time.perf_counter()
        self.spent: Counter[str] = Counter()

    def _tick(self) -> None:
        now = time.perf_counter()
        if self._in_policy:
            key = "policy/" + self._policy_phase
        elif self._in_ledger:
            key = "ledger/" + self._phase
        else:
            key = "other"
        self.spent[key] += now - self._mark
        self._mark = now

    @contextlib.contextmanager
    def ledger(self, phase: str = "recording") -> Iterator[None]:
        self._tick()
        self._in_ledger += 1
        self._phase = phase
        try:
            yield
        finally:
            self._tick()
            self._in_ledger -= 1
            self._phase = "recording"

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """Inside a ledger call, the part that is the agent's own (a runner's body)."""
        self._tick()
        self._in_ledger -= 1
        try:
            yield
        finally:
            self._tick()
            self._in_ledger += 1

    _policy_phase = "sampling"

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
            with clock.away():
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


# ------------------------------------------------------------------------------ the update
def actor_config(settings: Settings) -> ActorConfig:
    rows = settings.prompts * settings.group_size
    return ActorConfig(
        strategy="fsdp",
        rollout_n=settings.group_size,
        ppo_mini_batch_size=settings.prompts // settings.mini_batches,
        ppo_micro_batch_size_per_gpu=rows,
        ppo_epochs=settings.ppo_epochs,
        entropy_coeff=settings.entropy_coeff,
        loss_agg_mode="token-mean",
    )


def ppo_update(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    data: DataProto,
    config: ActorConfig,
    clock: Clock,
) -> dict[str, float]:
    """verl's actor update on one step's batch: old log-probs, then `ppo_epochs` passes over
    mini-batches (the policy moves between them, so the ratios, clipping and `pg_loss` of all
    but the first are off-policy), each loss from verl's policy-loss function and `agg_loss`."""
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
                log_prob = logprobs_from_logits(logits, mini.batch["responses"])
                pg_loss, pg_metrics = policy_loss(
                    old_log_prob=mini.batch["old_log_probs"],
                    log_prob=log_prob,
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


def sorted_by_group(data: DataProto) -> DataProto:
    """Rows in (prompt, sample) order: the log's order follows the event loop's, and the
    mini-batches (and so the run) should not."""
    keys = list(zip(data.non_tensor_batch["group_uid"], data.non_tensor_batch["session_index"]))
    order = sorted(range(len(keys)), key=keys.__getitem__)
    data.reorder(torch.tensor(order))
    return data


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


def disagreements(ours: dict[str, float], verls: dict[str, Any]) -> tuple[int, list[str]]:
    """How many of verl's names the ledger's dict reports, and which of them differ (> 1e-6)."""
    shared = sorted(set(ours) & set(verls))
    differ = [n for n in shared if not math.isclose(ours[n], float(verls[n]), abs_tol=1e-6)]
    return len(shared), differ


# ------------------------------------------------------------------------------ one step
@dataclass
class StepRecord:
    step: int
    train: dict[str, float]
    val: dict[str, float] | None
    #: what verl reads of the val batch: data sources, uids, scores, turns (for the test)
    val_rows: dict[str, list[Any]] | None
    actor: dict[str, float]
    seconds: dict[str, float]
    verl_names: int
    verl_differ: list[str]


@dataclass
class Evidence:
    audit_ok: bool
    audit_output: str
    figures: int
    steps: int
    differ: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    settings: Settings
    run: str
    url: str
    records: list[StepRecord]
    evidence: Evidence | None


async def train(settings: Settings) -> RunResult:
    """The whole run; returns every step's record and, with `settings.evidence`, the check."""
    torch.manual_seed(settings.seed)
    torch.set_num_threads(
        1
    )  # matrices this small gain nothing from threads; the other core is SQLite's writer
    rng = random.Random(settings.seed)
    val_set = problems(random.Random(settings.seed + 1), settings.val_prompts, "v")
    policy = Policy(width=settings.width)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=settings.lr)
    clock = Clock()
    sampler = Sampler(policy, timer=clock.policy)
    faults = Faults(settings.fail_rate, settings.cancel_rate, settings.seed)
    config = actor_config(settings)
    run = settings.run or f"grpo-s{settings.seed}-{uuid.uuid4().hex[:6]}"
    url = settings.db if "://" in settings.db else f"sqlite+aiosqlite:///{settings.db}"
    board = None
    if settings.tensorboard:
        from sessions.trackers import TensorBoardTracker, log_step

        board = TensorBoardTracker(settings.tensorboard)
    widths = dict(max_prompt_length=MAX_PROMPT, max_response_length=MAX_NEW_TOKENS)
    records: list[StepRecord] = []
    async with Ledger.open(
        url,
        run=run,
        retry_policy=RetryPolicy(max_attempts=settings.max_attempts, on=("infra",)),
        config={k: v for k, v in vars(settings).items() if k not in ("db", "run", "quiet")},
    ) as ledger:
        print_header(settings, run, url, policy)
        clock.take()
        for step in range(settings.steps):
            await rollouts(
                ledger,
                sampler,
                faults,
                clock,
                problems(rng, settings.prompts, f"t{step}"),
                "train",
                step,
                settings.group_size,
            )
            with clock.ledger("projection"):
                await ledger.project()
            with clock.ledger("batch"):
                batch = await ledger.batch(
                    "train", step, prompt_width=MAX_PROMPT, response_width=MAX_NEW_TOKENS
                )
                data = sorted_by_group(to_data_proto(batch))  # placeholders: groups of one
            with clock.ledger("metrics"):
                tracked = await ledger.metrics_dict("train", step, **widths)
            with clock.policy("update"):
                reward, _ = extract_reward(data)
                data.batch["token_level_scores"] = data.batch["token_level_rewards"] = reward
                data = compute_advantage(data, adv_estimator=AdvantageEstimator.GRPO)
            actor = ppo_update(policy, optimizer, data, config, clock)
            names, differ = disagreements(
                tracked, compute_data_metrics(batch=data, use_critic=False)
            )

            val = val_rows = None
            if step % settings.val_every == 0 or step == settings.steps - 1:
                await rollouts(ledger, sampler, faults, clock, val_set, "val", step, settings.val_n)
                with clock.ledger("projection"):
                    await ledger.project()
                with clock.ledger("batch"):
                    val_data = to_data_proto(await ledger.batch("val", step))
                with clock.ledger("metrics"):
                    val = await ledger.metrics_dict("val", step)
                verl_val = verl_val_metrics(val_data)
                val_names, val_differ = disagreements(val, verl_val)
                names, differ = names + val_names, differ + val_differ
                if not set(k for k in verl_val) <= set(val):
                    differ.append(f"val: verl has {sorted(set(verl_val) - set(val))}")
                val_rows = {
                    "data_sources": list(val_data.non_tensor_batch["data_source"]),
                    "uids": list(val_data.non_tensor_batch["uid"]),
                    "scores": val_data.batch["rm_scores"].sum(-1).tolist(),
                    "turns": [int(t) for t in val_data.non_tensor_batch["__num_turns__"]],
                }
            if board is not None:
                with clock.ledger("trackers"):
                    for partition in ("train", "val") if val is not None else ("train",):
                        await log_step(ledger, partition, step, trackers=[board])
            record = StepRecord(step, tracked, val, val_rows, actor, clock.take(), names, differ)
            if board is not None:
                log_own_scalars(board, record)
            records.append(record)
            if not settings.quiet:
                print(row(record), flush=True)
    if board is not None:
        board.close()
    evidence = await check_evidence(url, run, records) if settings.evidence else None
    result = RunResult(settings, run, url, records, evidence)
    if not settings.quiet:
        print_summary(result)
    return result


def log_own_scalars(board: Any, record: StepRecord) -> None:
    """The script's own figures beside the ledger's: the actor's, and the ledger's time."""
    wall = sum(record.seconds.values())
    own = {
        **record.actor,
        "timing/ledger_share": ledger_seconds(record.seconds) / wall,
        "timing/ledger_s": ledger_seconds(record.seconds),
        "timing/policy_s": policy_seconds(record.seconds),
        "timing/step_s": wall,
    }
    for name, value in own.items():
        board.writer.add_scalar(name, value, global_step=record.step)


# ------------------------------------------------------------------------------ the evidence
def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`rollout-ledger ARGS` with this Python."""
    return subprocess.run(
        [sys.executable, "-m", "sessions.cli", *args], capture_output=True, text=True
    )


async def check_evidence(url: str, run: str, records: list[StepRecord]) -> Evidence:
    """audit the log and the stored read models; replay the log into a fresh database and
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
            widths = dict(max_prompt_length=MAX_PROMPT, max_response_length=MAX_NEW_TOKENS)
            async with Ledger.open(replayed, run=run, migrate=False) as again:
                for record in records:
                    for partition, logged, options in (
                        ("train", record.train, widths),
                        ("val", record.val, {}),
                    ):
                        if logged is None:
                            continue
                        rebuilt = await again.metrics_dict(partition, record.step, **options)
                        figures += len(logged)
                        if rebuilt.keys() != logged.keys():
                            differ.append(f"{partition} {record.step}: names differ")
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
def header_lines() -> list[str]:
    return [
        "      |     train      |          val           | failed (train+val)   |         |  ledger  | policy",
        " step |  mean   succ   |  mean   succ   mean@4  | run  time  sbx  canc  retried | pg_loss | ms  share |   ms",
    ]


def print_header(settings: Settings, run: str, url: str, policy: Policy) -> None:
    if settings.quiet:
        return
    params = sum(p.numel() for p in policy.parameters())
    print(
        f"run {run} in {url}: {settings.steps} steps of {settings.prompts} prompts x "
        f"{settings.group_size} samples, val {settings.val_prompts} x {settings.val_n} every "
        f"{settings.val_every}; policy {params:,} parameters; fail rate {settings.fail_rate} "
        f"(by level {', '.join(f'{k}: {settings.fail_rate * w:.2f}' for k, w in sorted(LEVEL_WEIGHT.items()))}), "
        f"cancel rate {settings.cancel_rate}, seed {settings.seed}"
    )
    print("mean = reward/mean (failures as zeros); succ = reward/mean_success_only")
    for line in header_lines():
        print(line)


def counts(record: StepRecord) -> dict[str, int]:
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


def row(record: StepRecord) -> str:
    t, v = record.train, record.val
    scope = "ledger/train/all/"
    val = "                      "
    if v is not None:
        val = (
            f"{v['ledger/val/all/reward/mean']:.3f}  {v['ledger/val/all/reward/mean_success_only']:.3f}"
            f"   {v.get(f'val-core/{DATA_SOURCE}/reward/mean@4', float('nan')):.3f} "
        )
    c = counts(record)
    wall = sum(record.seconds.values())
    ledger = ledger_seconds(record.seconds)
    return (
        f" {record.step:4d} | {t[scope + 'reward/mean']:.3f}  {t[scope + 'reward/mean_success_only']:.3f}  "
        f"| {val} | {c['runner_error']:3d} {c['timeout']:5d} {c['sandbox_error']:4d} {c['cancelled']:5d} "
        f"{c['retried']:8d} | {record.actor.get('actor/pg_loss', float('nan')):+.4f} "
        f"| {ledger * 1000:4.0f} {ledger / wall:5.1%} | {policy_seconds(record.seconds) * 1000:4.0f}"
    )


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.1%} (min {min(values):.1%}, max {max(values):.1%})"


def print_summary(result: RunResult) -> None:
    records = result.records
    shares = [ledger_seconds(r.seconds) / sum(r.seconds.values()) for r in records]
    total: Counter[str] = Counter()
    for r in records:
        total.update(r.seconds)
    wall = sum(total.values())
    print()
    print(f"ledger share of step time: {spread(shares)} over {len(records)} steps")
    parts = ", ".join(
        f"{k.split('/', 1)[1]} {v / len(records) * 1000:.1f} ms"
        for k, v in sorted(total.items())
        if k.startswith("ledger/")
    )
    policy = ", ".join(
        f"{k.split('/', 1)[1]} {v / len(records) * 1000:.1f} ms"
        for k, v in sorted(total.items())
        if k.startswith("policy/")
    )
    print(
        f"  per step: ledger {parts}; policy {policy}; other {total['other'] / len(records) * 1000:.1f} ms"
    )
    print(
        f"  wall {wall:.1f} s: ledger {ledger_seconds(total) / wall:.1%}, policy {policy_seconds(total) / wall:.1%}"
    )
    first = statistics.fmean(r.train["ledger/train/all/reward/mean"] for r in records[:10])
    last = statistics.fmean(r.train["ledger/train/all/reward/mean"] for r in records[-10:])
    print(f"train reward/mean: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    names = sum(r.verl_names for r in records)
    differ = [d for r in records for d in r.verl_differ]
    print(
        f"verl's compute_data_metrics (train) and _val_metrics_update (val) equal metrics_dict "
        f"on {names} figures over {len(records)} steps: {'yes' if not differ else differ[:5]}"
    )
    evidence = result.evidence
    if evidence is not None:
        print(f"rollout-ledger audit: {'ok' if evidence.audit_ok else 'FAILED'}")
        for line in evidence.audit_output.splitlines()[-3:]:
            print(f"  {line}")
        verdict = (
            "every one reproduces"
            if not evidence.differ
            else f"{len(evidence.differ)} differ: {evidence.differ[:5]}"
        )
        print(
            f"replay: {evidence.figures} logged figures over {evidence.steps} steps recomputed "
            f"from the replayed log: {verdict}"
        )
    print(f"figures: rollout-ledger report --db {result.url} --run {result.run} --out report/")


# ------------------------------------------------------------------------------ command line
def parse(argv: list[str] | None) -> Settings:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps")
    parser.add_argument(
        "--fail-rate",
        type=float,
        default=defaults.fail_rate,
        help="failure rate of an attempt at the mean prompt level (level weights 0.25-1.75)",
    )
    parser.add_argument(
        "--cancel-rate",
        type=float,
        default=defaults.cancel_rate,
        help="share of sessions the rollout engine preempts",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--db", default=defaults.db, help="SQLite file or database URL (a new run each time)"
    )
    parser.add_argument("--run", help="run name (default: grpo-s<seed>-<random>)")
    parser.add_argument("--val-every", type=int, default=defaults.val_every)
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=defaults.max_attempts,
        help="attempts per session for infra failures",
    )
    parser.add_argument("--tensorboard", metavar="DIR", help="also log every step's scalars there")
    parser.add_argument(
        "--no-evidence",
        dest="evidence",
        action="store_false",
        help="skip audit and replay at the end",
    )
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    return Settings(**{k: v for k, v in vars(args).items() if v is not None or k == "run"})


def main(argv: list[str] | None = None) -> int:
    result = asyncio.run(train(parse(argv)))
    bad = result.evidence is not None and (not result.evidence.audit_ok or result.evidence.differ)
    bad = bad or any(r.verl_differ for r in result.records)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
