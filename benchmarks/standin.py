"""What the stand-in server's tiny torch model costs per answer, beside the scripted answers it
replaced (the named baseline: `ok <sum of the prompt % 997>` with made-up log-probs, as the
stand-in answered before it had a model).

    python -m benchmarks.standin [--rounds 7] [--calls 200]

Two figures, each a median over `--rounds` rounds that run the subject and the baseline in turn
(so a load that comes and goes shifts both alike), with the rounds' min and max and the load:

* answer    one answer computed in this process, over the prompts of 32 conversations of 8 turns
            (the gateway benchmark's shape): µs per answer
* HTTP call one non-streamed chat call to a stand-in served in this process (the client in the
            same loop), with the token options the gateway adds: µs per call, what the model adds
            to every call the gateway's tests and benchmark make

`--answers-only model|scripted --count N` computes N answers and nothing else, for a
load-independent count of instructions; under callgrind only those N answers are counted:

    valgrind --tool=callgrind --instr-atstart=no python -m benchmarks.standin --answers-only model
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from sessions.gateway.standin import (
    EOS,
    Answer,
    StandIn,
    TinyModel,
    chat_prompt,
    encode,
    model,
    serving,
)

SESSIONS, TURNS = 32, 8
TOKEN_OPTIONS = {"return_token_ids": True, "logprobs": True, "return_tokens_as_token_ids": True}


class Scripted:
    """The baseline: the stand-in's answers before its model (commit ebb95db), same interface."""

    def answer(
        self, prompt: Sequence[int], max_tokens: int | None = None, forced: Sequence[int] = ()
    ) -> Answer:
        response = list(forced) or [*encode(f"ok {sum(prompt) % 997}"), EOS]
        return Answer(response, [-((t % 8) + 1) / 8 for t in response], "stop")


def conversations() -> list[list[dict[str, str]]]:
    """Each turn's messages of SESSIONS conversations of TURNS calls, answered by the model."""
    turns = []
    for n in range(SESSIONS):
        messages = [{"role": "user", "content": f"session {n}"}]
        for _ in range(TURNS):
            turns.append(list(messages))
            text = model().answer(chat_prompt(messages)).text
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": "go on"},
            ]
    return turns


def callgrind(switch: str) -> None:
    """Under `valgrind --tool=callgrind --instr-atstart=no`, count only what lies between
    `on` and `off` (start-up and torch's import run uncounted); elsewhere nothing."""
    if shutil.which("callgrind_control"):
        subprocess.run(
            ["callgrind_control", "-i", switch, str(os.getpid())], capture_output=True, check=False
        )


def per_answer_us(answerer: TinyModel | Scripted, prompts: list[list[int]]) -> float:
    started = time.perf_counter()
    for prompt in prompts:
        answerer.answer(prompt)
    return (time.perf_counter() - started) / len(prompts) * 1e6


async def per_call_us(http: Any, base: str, turns: list[list[dict[str, str]]]) -> float:
    started = time.perf_counter()
    for messages in turns:
        reply = await http.post(
            base + "/v1/chat/completions",
            json={"model": "m", "messages": messages, **TOKEN_OPTIONS},
        )
        reply.raise_for_status()
    return (time.perf_counter() - started) / len(turns) * 1e6


def line(name: str, values: list[float], baseline: list[float] | None = None) -> str:
    text = (
        f"  {name:<26} {statistics.median(values):9.1f} µs  [{min(values):.1f} – {max(values):.1f}]"
    )
    if baseline is not None:
        ratios = [v / b for v, b in zip(values, baseline)]
        text += f"   x{statistics.median(ratios):.2f} the baseline [{min(ratios):.2f} – {max(ratios):.2f}]"
    return text


async def http_rounds(turns: list[list[dict[str, str]]], rounds: int) -> dict[str, list[float]]:
    import httpx

    with_model = StandIn()
    scripted = StandIn()
    scripted.model = Scripted()  # type: ignore[assignment]  # the same server, scripted answers
    figures: dict[str, list[float]] = {"scripted": [], "model": []}
    async with (
        serving(scripted.app) as scripted_base,
        serving(with_model.app) as model_base,
        httpx.AsyncClient(trust_env=False) as http,
    ):
        await per_call_us(http, scripted_base, turns[:8])  # warm both connections
        await per_call_us(http, model_base, turns[:8])
        for _ in range(rounds):
            figures["scripted"].append(await per_call_us(http, scripted_base, turns))
            figures["model"].append(await per_call_us(http, model_base, turns))
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=SESSIONS * TURNS, help="HTTP calls a round")
    parser.add_argument("--answers-only", choices=["model", "scripted"])
    parser.add_argument("--count", type=int, default=256)
    args = parser.parse_args(argv)
    turns = conversations()
    prompts = [chat_prompt(messages) for messages in turns]
    if args.answers_only:
        answerer: Callable[[], TinyModel | Scripted] = (
            model if args.answers_only == "model" else Scripted
        )
        subject = answerer()
        subject.answer(prompts[0])  # first-call work (torch's lazy set-up) left out
        callgrind("on")
        for n in range(args.count):
            subject.answer(prompts[n % len(prompts)])
        callgrind("off")
        return
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    answers: dict[str, list[float]] = {"scripted": [], "model": []}
    for _ in range(args.rounds):
        answers["scripted"].append(per_answer_us(Scripted(), prompts))
        answers["model"].append(per_answer_us(model(), prompts))
    calls = asyncio.run(http_rounds((turns * 4)[: args.calls], args.rounds))
    lengths = [len(model().answer(p).response_ids) for p in prompts]
    print(
        f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
        f"model answers of {min(lengths)}-{max(lengths)} tokens (median "
        f"{statistics.median(lengths):g}); {args.rounds} rounds, median [min – max]"
    )
    print("one answer:")
    print(line("scripted (baseline)", answers["scripted"]))
    print(line("tiny torch model", answers["model"], answers["scripted"]))
    print(f"one HTTP chat call ({args.calls} a round, sequential):")
    print(line("scripted (baseline)", calls["scripted"]))
    print(line("tiny torch model", calls["model"], calls["scripted"]))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
