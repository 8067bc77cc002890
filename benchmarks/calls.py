"""What recording model calls costs (docs/design.md §15).

    python -m benchmarks.calls                      # SQLite file, and PostgreSQL if it answers
    python -m benchmarks.calls --sessions 64 --calls 10 --reps 5 --db postgresql://...

Two figures, each the median of `--reps` repetitions with its range, the subject beside a named
baseline measured in the same run:

1. **Per call, on the caller's event loop.** `--sessions` sessions run concurrently on one loop,
   each making `--calls` model calls in a growing conversation (a 256-token prompt, then 64
   tool tokens and a 96-token response per call, log-probs): each call is `start_call` before the
   request and `record_call` after it. The cost is the loop thread's CPU time for the run less
   that of the same loop making the same calls unrecorded, per call (the database's own writing
   runs on its writer thread or server, not on the caller's loop); the caller's wait for its two
   awaits is printed beside it.
   Baseline: the same calls appended to a JSONL file on the same loop (`json.dumps` of the call's
   ids, tokens and log-probs, then a write), what a hand-rolled trace does. Target: <= 150 µs per
   call on SQLite.
2. **The step's batch.** The same sessions completed (rows assembled from their calls) and
   `ledger.batch` of the step, against the same rows recorded whole with `record_trajectory` (one
   event per session): seconds from the last session's end to the batch returned (the projector
   reads the calls' events too). Target: <= 1.2x.

Load average is printed at start and end; quote figures from a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.pg import pg_url, server_answers

PROMPT, TOOL, RESPONSE = 256, 64, 96


def _conversation(calls: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(whole prompt, response, log-probs) of each call of one growing conversation."""
    rng = np.random.default_rng(seed)
    context = rng.integers(0, 32_000, PROMPT, dtype=np.int32)
    out = []
    for _ in range(calls):
        response = rng.integers(0, 32_000, RESPONSE, dtype=np.int32)
        logprobs = -rng.random(RESPONSE, dtype=np.float32)
        out.append((context, response, logprobs))
        tool = rng.integers(0, 32_000, TOOL, dtype=np.int32)
        context = np.concatenate((context, response, tool))
    return out


async def _session(ledger: Any, run: str, index: int) -> Any:
    """Session `index` of the step: a group of its own at train step 0."""
    return await ledger.create_session(
        f"{run}-{index}",
        uid=f"u{index}",
        session_index=0,
        group_size=1,
        partition="train",
        global_step=0,
    )


async def _plain(sessions: int, calls: int) -> float:
    """The loop thread's CPU seconds for the same sessions making the same calls, unrecorded."""

    async def one(index: int) -> None:
        for _call in _conversation(calls, index):
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    began = time.thread_time()
    await asyncio.gather(*(one(i) for i in range(sessions)))
    return time.thread_time() - began


async def _with_calls(
    ledger: Any, run: str, sessions: int, calls: int
) -> tuple[float, float, float]:
    """(the loop thread's CPU seconds for the sessions and their calls, the seconds the calls'
    awaits took, seconds from the last session's end to the step's batch returned)."""
    spent = 0.0
    cpu = time.thread_time()

    async def one(index: int) -> None:
        nonlocal spent
        handle = await _session(ledger, run, index)
        for prompt, response, logprobs in _conversation(calls, index):
            t0 = time.perf_counter()
            call = await handle.start_call()
            spent += time.perf_counter() - t0
            await asyncio.sleep(0)  # the request is under way: other sessions run
            t0 = time.perf_counter()
            await handle.record_call(
                call,
                prompt_ids=prompt,
                response_ids=response,
                response_logprobs=logprobs,
                min_version=0,
            )
            spent += time.perf_counter() - t0
        await handle.post_reward(1.0)
        await handle.complete()

    await asyncio.gather(*(one(i) for i in range(sessions)))
    cpu = time.thread_time() - cpu
    asked = time.perf_counter()
    await ledger.batch("train", 0, run=run, timeout=600)
    return cpu, spent, time.perf_counter() - asked


async def _whole(ledger: Any, run: str, sessions: int, calls: int) -> float:
    """Seconds from the last session's end to the step's batch returned, when each session
    hands its assembled row over whole."""
    from sessions import calls as assembly
    from sessions import events as ev
    from sessions import tokens

    rows = []
    for index in range(sessions):  # the same rows the calls assemble, built before the clock
        recorded, context = [], None
        for n, (prompt, response, logprobs) in enumerate(_conversation(calls, index)):
            shared = assembly.shared_prefix(context, prompt)
            arrays = tokens.TokenArrays(
                prompt[shared:], response, np.ones(len(response), np.uint8), logprobs
            )
            recorded.append(
                ev.ModelCallRecorded(
                    call_id=f"c{n}",
                    prompt_shared=shared,
                    prompt_len=arrays.prompt_len,
                    response_len=arrays.response_len,
                    has_logprobs=True,
                    payload=tokens.encode(arrays),
                )
            )
            context = np.concatenate((prompt, response))
        [row] = assembly.assemble(recorded)
        rows.append(row)

    async def one(index: int) -> None:
        row = rows[index]
        handle = await _session(ledger, run, index)
        await handle.record_trajectory(
            prompt_ids=row.prompt_ids,
            response_ids=row.response_ids,
            response_mask=row.response_mask,
            response_logprobs=row.logprobs,
            num_turns=row.num_turns,
        )
        await handle.post_reward(1.0)
        await handle.complete()

    await asyncio.gather(*(one(i) for i in range(sessions)))
    asked = time.perf_counter()
    await ledger.batch("train", 0, run=run, timeout=600)
    return time.perf_counter() - asked


async def _jsonl(path: Path, sessions: int, calls: int) -> float:
    """Loop seconds to append every call as a JSON line (the baseline of figure 1)."""
    spent = 0.0
    with path.open("w", encoding="utf-8") as out:

        async def one(index: int) -> None:
            nonlocal spent
            for n, (prompt, response, logprobs) in enumerate(_conversation(calls, index)):
                await asyncio.sleep(0)
                t0 = time.perf_counter()
                line = json.dumps(
                    {
                        "session": index,
                        "call": n,
                        "prompt_ids": prompt.tolist(),
                        "response_ids": response.tolist(),
                        "logprobs": logprobs.tolist(),
                        "version": 0,
                    }
                )
                out.write(line + "\n")
                spent += time.perf_counter() - t0

        await asyncio.gather(*(one(i) for i in range(sessions)))
        out.flush()
        os.fsync(out.fileno())
    return spent


def _spread(values: list[float], scale: float, unit: str) -> str:
    values = [v * scale for v in values]
    return f"{statistics.median(values):,.1f} {unit} [{min(values):,.1f}-{max(values):,.1f}]"


async def measure(url: str, sessions: int, calls: int, reps: int, folder: Path) -> dict[str, Any]:
    from sessions import Ledger

    per_call, waited, baseline, batch_calls, batch_whole = [], [], [], [], []
    n = sessions * calls
    for rep in range(reps + 1):  # a run of each kind per repetition (its step 0 is the batch);
        tag = uuid.uuid4().hex[:8]  # the first repetition warms up and is not counted
        async with Ledger.open(url, run=f"calls{tag}") as ledger:
            cpu, spent, took = await _with_calls(ledger, ledger.run, sessions, calls)
        plain = await _plain(sessions, calls)
        async with Ledger.open(url, run=f"whole{tag}") as ledger:
            whole = await _whole(ledger, ledger.run, sessions, calls)
        jsonl = await _jsonl(folder / f"calls-{rep}.jsonl", sessions, calls)
        if rep == 0:
            continue
        per_call.append(max(cpu - plain, 0.0) / n)
        waited.append(spent / n)
        batch_calls.append(took)
        batch_whole.append(whole)
        baseline.append(jsonl / n)
    ratios = [c / w for c, w in zip(batch_calls, batch_whole)]
    return {
        "per_call_us": per_call,
        "await_us": waited,
        "jsonl_us": baseline,
        "batch_with_calls_s": batch_calls,
        "batch_whole_s": batch_whole,
        "ratio": ratios,
    }


def report(backend: str, got: dict[str, Any]) -> list[str]:
    ratio = statistics.median(got["ratio"])
    return [
        f"{backend}: per call, the loop thread's CPU (start_call + record_call, less the same "
        f"loop unrecorded): {_spread(got['per_call_us'], 1e6, 'µs')}; JSONL baseline "
        f"{_spread(got['jsonl_us'], 1e6, 'µs')}; target <= 150 µs on SQLite",
        f"{backend}: per call, the caller's wait (its two awaits, other sessions running "
        f"meanwhile): {_spread(got['await_us'], 1e6, 'µs')}",
        f"{backend}: last end to the step's batch, rows from calls "
        f"{_spread(got['batch_with_calls_s'], 1e3, 'ms')} vs recorded whole "
        f"{_spread(got['batch_whole_s'], 1e3, 'ms')}: {ratio:.2f}x "
        f"[{min(got['ratio']):.2f}-{max(got['ratio']):.2f}]; target <= 1.2x",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.calls", description=__doc__)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--calls", type=int, default=10, help="model calls per session")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--db", help="a database URL (default: a SQLite file, then PostgreSQL)")
    args = parser.parse_args(argv)
    print(f"load average at start: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="calls-bench-") as tmp:
        folder = Path(tmp)
        targets = [("given", args.db)] if args.db else [("sqlite", str(folder / "calls.db"))]
        if not args.db:
            why = server_answers()
            if why is None:
                targets.append(("postgresql", pg_url()))  # each repetition its own runs
            else:
                print(f"postgresql: not measured ({why})")
        for backend, url in targets:
            got = asyncio.run(measure(url, args.sessions, args.calls, args.reps, folder))
            for line in report(backend, got):
                print(line)
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
