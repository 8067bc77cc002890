"""One step of agent rollouts through the gateway: an OpenAI Agents SDK agent, unmodified but for
the base URL and key it is given, answers 8 prompts x 4 times against a stand-in inference server
(a tiny torch model in vLLM's answer format); some agents crash (their tool's sandbox dies) and
some hang (killed by the timeout). The step's batch and metrics then come out of the ledger as
for any other runner: failures by reason, placeholder rows, the honest and success-only means.

    python examples/gateway_agents.py [--db URL] [--seed 0] [--crash 3] [--hang 2] [--timeout 8]

Which sessions crash or hang is drawn from `--seed`; everything else is deterministic too.
Needs the `gateway` extra and the `openai-agents` package (`pip install -e '.[gateway,test]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import agents
import openai

from sessions import Ledger
from sessions.gateway.server import serve
from sessions.gateway.standin import StandIn, serving

GROUPS, GROUP_SIZE, STEP = 8, 4, 0
RUN = "gateway-example"


# ------------------------------------------------------------------------------ the agent
def calculator_agent(base_url: str, api_key: str, sandbox: Sandbox) -> agents.Agent[Any]:
    """An ordinary Agents SDK agent with one tool; nothing in it knows the gateway is there."""

    @agents.function_tool(failure_error_function=None)  # a tool's crash ends the run
    async def add(a: int, b: int) -> str:
        """Add two numbers (in the sandbox)."""
        return await sandbox.run(a + b)

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model="tool", openai_client=client)
    return agents.Agent(name="calculator", instructions="Add.", tools=[add], model=model)


class Sandbox:
    """Where the agent's tool runs; the faults of this example are the sandbox's."""

    def __init__(self, fault: str | None) -> None:
        self.fault = fault

    async def run(self, value: int) -> str:
        if self.fault == "crash":
            raise RuntimeError("the tool's sandbox died")
        if self.fault == "hang":
            await asyncio.Event().wait()  # never set: hangs until the timeout cancels the agent
        return str(value)


def grade(answer: str) -> float:
    """A toy verifier: the share of letters in the final answer (the stand-in's model is not
    trained, so any reward that varies with its answers will do)."""
    return round(sum(c.isalpha() for c in answer) / max(len(answer), 1), 4)


# ------------------------------------------------------------------------------ the step
def plan(seed: int, crash: int, hang: int) -> dict[str, str]:
    """The sessions that crash or hang, by session id, drawn from `seed`."""
    slots = [f"q{g}-{i}" for g in range(GROUPS) for i in range(GROUP_SIZE)]
    chosen = random.Random(seed).sample(slots, crash + hang)
    return {sid: ("crash" if n < crash else "hang") for n, sid in enumerate(chosen)}


async def rollout(
    gateway: Any, group: int, index: int, fault: str | None, timeout: float
) -> float | None:
    """One session: the agent runs through the gateway and is graded; its reward, or None when
    it crashed or timed out (the session block failed the session with the exception)."""
    session_id = f"q{group}-{index}"
    identity = dict(uid=f"q{group}", session_index=index, group_size=GROUP_SIZE, partition="train")
    try:
        async with gateway.session(session_id, global_step=STEP, **identity) as s:
            agent = calculator_agent(s.base_url, s.api_key, Sandbox(fault))
            question = f"Question {group}: what is 2 + 2? (sample {index})"
            try:
                result = await asyncio.wait_for(agents.Runner.run(agent, question), timeout)
            except TimeoutError:  # wait_for's own says nothing: the ledger records this message
                raise TimeoutError(f"the agent ran past its {timeout:g}s timeout") from None
            reward = grade(result.final_output)
            await s.post_reward(reward)
            return reward
    except Exception:  # recorded: the session failed with it, its calls kept
        return None


async def main(db: str, seed: int, crash: int, hang: int, timeout: float, parallel: int) -> None:
    agents.set_tracing_disabled(True)  # nothing leaves this machine
    faults = plan(seed, crash, hang)
    print(
        f"step {STEP}: {GROUPS} groups x {GROUP_SIZE} sessions of an Agents SDK agent through "
        f"the gateway (agent timeout {timeout:g}s)"
    )
    for fault in ("crash", "hang"):
        chosen = sorted(sid for sid, f in faults.items() if f == fault)
        print(f"injected (seed {seed}): {fault} {', '.join(chosen) or 'none'}")
    standin = StandIn()
    async with (
        Ledger.open(db, run=RUN) as ledger,
        serving(standin.app) as upstream,
        serve(ledger, [upstream]) as gateway,
    ):
        slots = asyncio.Semaphore(parallel)  # sandboxes a trainer runs at once

        async def limited(group: int, index: int) -> float | None:
            async with slots:
                fault = faults.get(f"q{group}-{index}")
                return await rollout(gateway, group, index, fault, timeout)

        keys = [(g, i) for g in range(GROUPS) for i in range(GROUP_SIZE)]
        rewards = dict(zip(keys, await asyncio.gather(*(limited(g, i) for g, i in keys))))
        failures = []
        for group in range(GROUPS):
            cells = []
            for index in range(GROUP_SIZE):
                view = (await ledger.load_session(f"q{group}-{index}")).view
                if view.failure_reason is None:
                    cells.append(f"{rewards[group, index]:.3f}")
                    continue
                calls = len(view.recorded_calls())
                cells.append(f"{view.failure_reason} ({calls} call{'s' * (calls != 1)} kept)")
                failures.append(f"  q{group}-{index}: {view.failure_reason}: {view.message[:80]}")
            print(f"  q{group}: " + " | ".join(cells))
        print("failed sessions (the ledger's record):")
        print("\n".join(failures) or "  none")

        batch = await ledger.batch("train", STEP, timeout=60)
        figures = await ledger.metrics_dict("train", STEP, timeout=60)
    scope = "ledger/train/all/"
    by_reason = {
        k.removeprefix(scope + "failed/"): int(v)
        for k, v in figures.items()
        if k.startswith(scope + "failed/")
    }
    print(
        f"sessions: {int(figures[scope + 'sessions/total'])} "
        f"({int(figures[scope + 'sessions/succeeded'])} succeeded, "
        f"{int(figures[scope + 'sessions/failed'])} failed)"
    )
    print("failures by reason: " + (", ".join(f"{r} {n}" for r, n in sorted(by_reason.items()))))
    print(
        f"batch: {batch.batch_size[0]} rows, input_ids {tuple(batch['input_ids'].shape)}, "
        f"{int(batch['is_placeholder'].sum())} placeholder rows"
    )
    print(f"  {scope}reward/mean = {figures[scope + 'reward/mean']:.4f}  (failures as zeros)")
    print(
        f"  {scope}reward/mean_success_only = {figures[scope + 'reward/mean_success_only']:.4f}"
        "  (what dropping failures would report)"
    )


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", help="a new ledger's URL or SQLite path (default: a temp file)")
    parser.add_argument("--seed", type=int, default=0, help="which sessions crash or hang")
    parser.add_argument("--crash", type=int, default=3, help="agents whose sandbox dies")
    parser.add_argument("--hang", type=int, default=2, help="agents that hang past the timeout")
    parser.add_argument("--timeout", type=float, default=8.0, help="seconds an agent may run")
    parser.add_argument("--parallel", type=int, default=4, help="agents run at once")
    args = parser.parse_args(argv)
    if args.crash < 0 or args.hang < 0 or args.crash + args.hang > GROUPS * GROUP_SIZE:
        parser.error(
            f"--crash and --hang must be >= 0 and together at most {GROUPS * GROUP_SIZE}, "
            f"the step's sessions; got {args.crash} and {args.hang}"
        )
    if args.timeout <= 0 or args.parallel < 1:
        parser.error("--timeout must be > 0 seconds and --parallel at least 1")
    return args


if __name__ == "__main__":
    options = arguments(sys.argv[1:])
    with tempfile.TemporaryDirectory() as folder:
        db = options.db or str(Path(folder) / "gateway_agents.db")
        asyncio.run(
            main(db, options.seed, options.crash, options.hang, options.timeout, options.parallel)
        )
