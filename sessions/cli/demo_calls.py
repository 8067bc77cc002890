"""`rollout-ledger demo --calls N`: a simulated tool agent that records each model call.

Each session is a conversation of N model calls (`docs/design.md §15`): every call's prompt is
the previous call's context (its prompt and response) plus the tool's output, so the session's
row is assembled from its calls at `complete`. The simulated server stamps each answer with the
weights version an asynchronous trainer would have served it with: mostly the step's own, some
sessions one step behind, and a seeded share whose conversation spans a weight update (the call
during the update served by both versions, `min_version < max_version`). Some calls fail and
are retried; the demo's failure rates make sessions die between calls (runner errors, leaving
their recorded calls and a failed session) or during one (a sandbox that dies with a call under
way, whose intent stays open). Every draw comes from the session's plan seed and attempt, so a
run is reproducible under `--seed`; latencies are drawn too (the simulated server's), and the
agent sleeps a thousandth of each.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from sessions.recorder import SessionHandle
from sessions.runner_failure import SandboxError
from sessions.vocabulary import RUNNER_ERROR, SANDBOX_ERROR, TIMEOUT

__all__ = ["CALL_FAIL_RATE", "BEHIND_SHARE", "SPANNING_SHARE", "SERVERS", "calling_agent"]

VOCAB = 32_000
#: The share of calls the simulated server fails (each is retried once, as a client would).
CALL_FAIL_RATE = 0.06
#: Of the sessions of a step after the first: served one weights version behind the step...
BEHIND_SHARE = 0.15
#: ...and those whose conversation spans a weight update (the call during it has both versions).
SPANNING_SHARE = 0.12
SERVERS = ("vllm-0", "vllm-1", "vllm-2")
_HANG_S = 5.0
#: The agent sleeps this share of each drawn latency (the demo runs in seconds, not hours).
_SLEEP_SHARE = 0.001
#: Seeds the call draws apart from the trajectory demo's, whose outcomes stay as they were.
_STREAM = 41


@dataclass(frozen=True)
class Served:
    """The weights versions behind one call's answer."""

    low: int
    high: int


def version_schedule(rng: np.random.Generator, step: int, calls: int) -> list[Served]:
    """Each call's versions, as an asynchronous trainer's server would stamp them at `step`."""
    draw = rng.random()
    if step == 0 or draw >= BEHIND_SHARE + SPANNING_SHARE:
        return [Served(step, step)] * calls
    if draw < BEHIND_SHARE:
        return [Served(step - 1, step - 1)] * calls
    update = int(rng.integers(0, calls))  # the call under way when the new weights arrived
    return [
        Served(step - 1, step - 1)
        if i < update
        else Served(step - 1, step)
        if i == update
        else Served(step, step)
        for i in range(calls)
    ]


async def calling_agent(
    handle: SessionHandle,
    *,
    outcome: str,
    seed: int,
    difficulty: float,
    prompt_len: int,
    step: int,
    calls: int,
) -> None:
    """One simulated tool-agent episode of `calls` model calls, each recorded as it happens;
    failures are raised the way real runners raise them. `outcome` is this attempt's (a retried
    sandbox may have found a healthy host: the caller decides, as for the trajectory agent)."""
    rng = np.random.default_rng([seed, handle.attempt, _STREAM])
    served = version_schedule(rng, step, calls)
    breaks = calls // 2  # the turn where a failing session breaks
    context = rng.integers(0, VOCAB, prompt_len)
    sampling = {"temperature": 1.0, "max_tokens": 120}
    for turn in range(calls):
        versions = served[turn]
        call_id = await handle.start_call(turn=turn, sampling=sampling, version=versions.low)
        latency = float(rng.lognormal(-0.5, 0.6))
        await asyncio.sleep(latency * _SLEEP_SHARE)  # the model generating
        if outcome == SANDBOX_ERROR and turn == breaks:  # dies with the call under way
            raise SandboxError("sandbox container exited with code 137 (OOM-killed)")
        if rng.random() < CALL_FAIL_RATE:
            await handle.fail_call(
                call_id,
                message="server answered 503: engine overloaded",
                error_type="HTTPError",
                latency_s=latency,
            )
            call_id = await handle.start_call(turn=turn, sampling=sampling, version=versions.low)
            latency = float(rng.lognormal(-0.5, 0.6))
        response = rng.integers(0, VOCAB, int(rng.integers(16, 120)))
        await handle.record_call(
            call_id,
            prompt_ids=context,
            response_ids=response,
            response_logprobs=-rng.exponential(0.7, response.shape[0]).astype(np.float32),
            finish_reason="tool_calls" if turn < calls - 1 else "stop",
            min_version=versions.low,
            max_version=versions.high,
            latency_s=latency,
            server=SERVERS[int(rng.integers(0, len(SERVERS)))],
        )
        context = np.concatenate((context, response))
        if outcome == RUNNER_ERROR and turn == breaks:  # dies between calls
            raise RuntimeError("tool call parser: unterminated JSON in model output")
        if outcome == TIMEOUT and turn == breaks:
            # the calls so far are verified (a partial score), then a tool call hangs
            correct = float(rng.random() < difficulty * 0.5)
            await handle.post_reward(correct, acc=correct, turns=turn + 1)
            await asyncio.sleep(_HANG_S)
        if outcome == "cancel" and turn == breaks:
            await asyncio.sleep(_HANG_S)  # a stuck tool call: the cancel ends it
        if turn < calls - 1:  # the tool's output, the next call's prompt extends the context by it
            context = np.concatenate((context, rng.integers(0, VOCAB, int(rng.integers(8, 60)))))
    correct = float(rng.random() < difficulty)
    await handle.post_reward(correct, acc=correct, turns=calls)
