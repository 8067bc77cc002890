"""`rollout-ledger demo`: simulated multi-turn agent rollouts through the real recorder.

Every session is a real asyncio task running a simulated agent: a prompt of tens to hundreds of
tokens, 1-6 turns of model output (mask 1) interleaved with tool output (mask 0), real
`asyncio.wait_for` timeouts, and injected runner errors, sandbox failures and cancellations at the
requested rates. Outcomes are drawn from `--seed`, so a run is reproducible. `--max-attempts N`
retries sandbox failures (a retry finds a healthy host three times in four), `--exclude-infra`
leaves infrastructure failures out of the reward means, and `--keep-partial` sends a timed-out
agent's verified partial work to the batch instead of a placeholder. `--calls N` makes each
session a conversation of N model calls recorded as they happen, its row assembled from them
(`demo_calls.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from sessions.errors import ConfigError, RunHalted
from sessions.failure_policy import EXCLUDE, MetricPolicy, RetryPolicy
from sessions.ledger import Ledger
from sessions.placeholder import KEEP_PARTIAL, PlaceholderPolicy
from sessions.recorder import SessionHandle
from sessions.runner_failure import SandboxError
from sessions.vocabulary import ANY, INFRA, RUNNER_ERROR, SANDBOX_ERROR, TIMEOUT

DATA_SOURCES = ("gsm8k", "swe-lite")
VOCAB = 32_000
_TIMEOUT_S = 1.5  # generous: only the injected hangs should time out, never the ledger
_HANG_S = 5.0
#: The most model calls a demo session makes (a conversation's context grows with each).
MAX_CALLS = 64


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 2
    prompts: int = 16
    group_size: int = 4
    fail_rate: float = 0.2
    cancel_rate: float = 0.05
    seed: int = 0
    concurrency: int = 256
    #: The same uids at every step, as when dataset prompt ids serve as uids: each step's
    #: groups are still their own (a group is (run, partition, global_step, uid)).
    reuse_uids: bool = False
    #: Attempts per session: infrastructure failures (the sandbox's) are retried up to this many.
    max_attempts: int = 1
    #: Leave infrastructure failures out of the reward means (metric policy `exclude`).
    exclude_infra: bool = False
    #: A timed-out agent's partial work, verified, goes to the batch (placeholder policy `keep_partial`).
    keep_partial: bool = False
    #: The first step recorded: a run is grown by `demo --run NAME --start-step N` (steps N..).
    start_step: int = 0
    #: Model calls per session, each recorded as it happens (0: the agent hands over a whole
    #: trajectory, as the demo always did).
    calls: int = 0
    #: The sandbox service is down from this step on: every session fails `sandbox_error`, every
    #: retry too (what the world did, not a setting of the run: outside its fingerprint).
    outage_from_step: int | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "prompts", "group_size", "concurrency", "max_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        for name in ("fail_rate", "cancel_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}"
                )
        if not 0 <= self.calls <= MAX_CALLS:
            raise ConfigError(f"--calls must be in [0, {MAX_CALLS}], got {self.calls}")
        if self.fail_rate + self.cancel_rate > 1.0:
            raise ConfigError("--fail-rate plus --cancel-rate must not exceed 1")


@dataclass(frozen=True)
class Plan:
    """What will happen to one session, drawn up front from the seed."""

    outcome: str  # ok | runner_error | sandbox_error | timeout | cancel
    turns: int
    prompt_len: int
    difficulty: float
    seed: int


def new_run_name() -> str:
    return f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _plan_session(rng: random.Random, config: DemoConfig, difficulty: float, step: int = 0) -> Plan:
    x = rng.random()
    if config.outage_from_step is not None and step >= config.outage_from_step:
        outcome = SANDBOX_DOWN
    elif x < config.cancel_rate:
        outcome = "cancel"
    elif x < config.cancel_rate + config.fail_rate:
        outcome = rng.choice((RUNNER_ERROR, SANDBOX_ERROR, TIMEOUT))
    else:
        outcome = "ok"
    return Plan(outcome, rng.randint(1, 6), rng.randint(24, 400), difficulty, rng.randrange(2**31))


#: A session planned while the sandbox service is down (`--outage-from-step`): it fails
#: `sandbox_error` on every attempt.
SANDBOX_DOWN = "sandbox_down"
#: How often a sandbox that failed fails again on the retry (a flaky host, not a bad task).
_SANDBOX_REFAIL = 0.25
#: Seconds between attempts in the demo's retry policy.
_RETRY_BACKOFF_S = 0.01


def policies(config: DemoConfig) -> dict[str, object]:
    """The ledger options that carry out the demo's flags (all defaults without them)."""
    # the demo's own settings are the run's user config: its fingerprint, checked (and recorded)
    # as the ledger opens, so a rerun of `--run NAME` with other flags is refused, not mixed in
    # (`steps` and `start_step` say how far, not how: a run grown by --start-step keeps its digest)
    settings = dataclasses.asdict(config)
    del settings["steps"], settings["start_step"], settings["outage_from_step"]
    if not config.calls:  # a run recorded before --calls existed keeps its fingerprint
        del settings["calls"]
    options: dict[str, object] = {"config": {"demo": settings}}
    if config.max_attempts > 1:
        options["retry_policy"] = RetryPolicy(
            max_attempts=config.max_attempts, on=(INFRA,), backoff_s=_RETRY_BACKOFF_S
        )
    if config.exclude_infra:
        options["metric_policy"] = MetricPolicy(rules={ANY: {INFRA: EXCLUDE}})
    if config.keep_partial:
        options["placeholder_policy"] = PlaceholderPolicy(rules={ANY: {TIMEOUT: KEEP_PARTIAL}})
    return options


async def agent(handle: SessionHandle, plan: Plan) -> None:
    """One simulated agent episode; failures are raised the way real runners raise them."""
    rng = np.random.default_rng(plan.seed + 7919 * (handle.attempt - 1))
    if plan.outcome == SANDBOX_ERROR and handle.attempt > 1 and rng.random() >= _SANDBOX_REFAIL:
        plan = Plan(
            "ok", plan.turns, plan.prompt_len, plan.difficulty, plan.seed
        )  # the retry found a healthy host
    prompt = rng.integers(0, VOCAB, plan.prompt_len)
    pieces, masks = [], []
    for turn in range(plan.turns):
        await asyncio.sleep(float(rng.uniform(0.0005, 0.003)))  # the model generating
        model_tokens = int(rng.integers(16, 180))
        pieces.append(rng.integers(0, VOCAB, model_tokens))
        masks.append(np.ones(model_tokens, dtype=np.uint8))
        if turn < plan.turns - 1:
            tool_tokens = int(rng.integers(8, 120))
            pieces.append(rng.integers(0, VOCAB, tool_tokens))
            masks.append(np.zeros(tool_tokens, dtype=np.uint8))
        if plan.outcome == SANDBOX_ERROR and turn == plan.turns // 2:
            raise SandboxError("sandbox container exited with code 137 (OOM-killed)")
        if plan.outcome == RUNNER_ERROR and turn == plan.turns // 2:
            raise RuntimeError("tool call parser: unterminated JSON in model output")
        if plan.outcome == TIMEOUT and turn == plan.turns // 2:
            # the work so far is recorded and verified (a partial score), then a tool call hangs
            await _record(handle, rng, prompt, pieces, masks, turn + 1, plan.difficulty * 0.5)
            await asyncio.sleep(_HANG_S)
        if plan.outcome == "cancel" and turn == plan.turns // 2:
            await asyncio.sleep(_HANG_S)  # a stuck tool call: the cancel ends it
    await _record(handle, rng, prompt, pieces, masks, plan.turns, plan.difficulty)


async def _sandbox_down(handle: SessionHandle) -> None:
    """The agent while the sandbox service is down: its sandbox is refused at once."""
    await asyncio.sleep(0.001)
    raise SandboxError("sandbox pool unreachable: connection refused (the service is down)")


async def _record(
    handle: SessionHandle,
    rng: np.random.Generator,
    prompt: np.ndarray,
    pieces: list[np.ndarray],
    masks: list[np.ndarray],
    turns: int,
    difficulty: float,
) -> None:
    """Record the episode so far as a trajectory and post its verified reward."""
    response = np.concatenate(pieces)[:1024]
    mask = np.concatenate(masks)[:1024]
    logprobs = -rng.exponential(0.7, response.shape[0]).astype(np.float32)
    await handle.record_trajectory(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        response_logprobs=logprobs,
        num_turns=turns,
    )
    correct = float(rng.random() < difficulty)
    await handle.post_reward(correct, acc=correct, turns=turns)


async def run_demo(
    ledger: Ledger, config: DemoConfig, *, on_session: Callable[[], None] | None = None
) -> dict[str, float]:
    """Run all steps; returns timing figures (seconds, events, events per second)."""
    rng = random.Random(
        config.seed if not config.start_step else f"{config.seed}:{config.start_step}"
    )
    limit = asyncio.Semaphore(config.concurrency)
    run_tag = ledger.run.replace("_", "-")
    started = time.perf_counter()
    events_before = ledger.store.events_committed

    async def one(session_id: str, plan: Plan, **identity: object) -> None:
        step = identity["global_step"]
        assert isinstance(step, int)
        async with limit:
            task = asyncio.ensure_future(
                ledger.run_session(
                    _runner(plan, step, config.calls), session_id, timeout=_TIMEOUT_S, **identity
                )
            )
            if plan.outcome == "cancel":
                await asyncio.sleep(0.01)
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
            if on_session is not None:  # a creation the breaker refused raised: not counted
                on_session()

    for step in range(config.start_step, config.start_step + config.steps):
        jobs = []
        for partition in ("train", "val"):
            for p in range(config.prompts):
                uid = (
                    f"{run_tag}-p{p}" if config.reuse_uids else f"{run_tag}-{partition}{step}-p{p}"
                )
                difficulty = rng.betavariate(2, 2)
                source = DATA_SOURCES[p % len(DATA_SOURCES)]
                for k in range(config.group_size):
                    plan = _plan_session(rng, config, difficulty, step)
                    jobs.append(
                        one(
                            f"{run_tag}-{partition}{step}-p{p}-s{k}",
                            plan,
                            uid=uid,
                            session_index=k,
                            group_size=config.group_size,
                            partition=partition,
                            global_step=step,
                            data_source=source,
                            runner="demo-agent",
                        )
                    )
        # every session of the step settles, even once the run is halted (then RunHalted)
        ended = await asyncio.gather(*jobs, return_exceptions=True)
        errors = [e for e in ended if isinstance(e, BaseException)]
        halts = [e for e in errors if isinstance(e, RunHalted)]
        if errors:
            raise halts[0] if halts else errors[0]
    elapsed = time.perf_counter() - started
    appended = ledger.store.events_committed - events_before
    return {
        "seconds": elapsed,
        "events": appended,
        "events_per_second": appended / elapsed if elapsed else 0.0,
    }


def _runner(plan: Plan, step: int, calls: int) -> Callable[[SessionHandle], Awaitable[None]]:
    """The session's agent: a whole trajectory handed over, or `calls` model calls recorded."""
    if plan.outcome == SANDBOX_DOWN:
        return _sandbox_down
    if not calls:
        return lambda handle: agent(handle, plan)
    from sessions.cli.demo_calls import calling_agent

    def run(handle: SessionHandle) -> Awaitable[None]:
        outcome = plan.outcome
        if outcome == SANDBOX_ERROR and handle.attempt > 1 and _healthy_host(plan, handle.attempt):
            outcome = "ok"
        return calling_agent(
            handle,
            outcome=outcome,
            seed=plan.seed,
            difficulty=plan.difficulty,
            prompt_len=plan.prompt_len,
            step=step,
            calls=calls,
        )

    return run


def _healthy_host(plan: Plan, attempt: int) -> bool:
    """Whether a retried sandbox finds a healthy host: the draw `agent` makes for it."""
    rng = np.random.default_rng(plan.seed + 7919 * (attempt - 1))
    return bool(rng.random() >= _SANDBOX_REFAIL)


def example_session(run: str, config: DemoConfig) -> str:
    """The id `run_demo` gives the first session of the last val step (one to show with `history`)."""
    return f"{run.replace('_', '-')}-val{config.start_step + config.steps - 1}-p0-s0"


def next_commands(run: str, db: str | None, session_id: str) -> list[str]:
    """The commands the demo suggests after its summary, ready to paste into a POSIX shell."""
    import re
    import shlex

    where = "" if db is None else f" --db {shlex.quote(db)}"
    quoted = run.replace("'", "''")
    query = f"SELECT * FROM failure_breakdown WHERE run = '{quoted}'"
    # double quotes read better around SQL; only when nothing in it means something to the shell
    shown = f'"{query}"' if re.fullmatch(r"[\w.-]+", run) else shlex.quote(query)
    return [
        f"rollout-ledger metrics{where}",
        f"rollout-ledger history {shlex.quote(session_id)}{where}",
        f"rollout-ledger sql {shown}{where}",
    ]
