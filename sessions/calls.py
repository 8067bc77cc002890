"""A session's model calls as training rows (docs/design.md §15).

Each recorded call stores only the prompt tokens it adds to the context of the call recorded
before it in the attempt (`ModelCallRecorded.prompt_shared`); `full_prompts` rebuilds each call's
whole prompt. `assemble` turns an attempt's recorded calls into rows as verl's tool agent loop
builds its `AgentLoopOutput`: the first call's prompt is the row's prompt; the response is each
call's response (mask 1, its log-probs) with the tokens the environment added between two calls
(tool results, user turns: mask 0, log-prob 0) in between. A call whose prompt does not extend
the previous call's context (the agent rewrote or truncated its history) starts a new row, as a
new conversation would in verl.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sessions import tokens
from sessions.events import ModelCallRecorded

__all__ = ["AssembledRow", "assemble", "extend", "full_prompts", "shared_prefix"]


@dataclass(frozen=True, slots=True)
class AssembledRow:
    """One training row made from consecutive calls of an attempt."""

    call_ids: list[str]
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    #: None unless every call of the row recorded its log-probs
    logprobs: np.ndarray | None
    min_version: int | None
    max_version: int | None
    #: verl's count: user and tool turns + assistant turns + 1 (`ToolAgentLoop`)
    num_turns: int


def shared_prefix(context: np.ndarray | None, prompt: np.ndarray) -> int:
    """How many leading tokens `prompt` shares with `context` (0 without a context)."""
    if context is None:
        return 0
    length = min(context.shape[0], prompt.shape[0])
    differs = np.flatnonzero(context[:length] != prompt[:length])
    return int(differs[0]) if differs.size else length


def extend(
    context: np.ndarray | None, call: ModelCallRecorded, arrays: tokens.TokenArrays | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`call`'s whole prompt, and the context after it (that prompt and its response), from the
    context after the call recorded before it (None before the first); `arrays`: the call's
    decoded arrays when the caller has them already."""
    arrays = call.arrays() if arrays is None else arrays
    shared = arrays.prompt_ids[:0] if context is None else context[: call.prompt_shared]
    prompt = np.concatenate((shared, arrays.prompt_ids))
    return prompt, np.concatenate((prompt, arrays.response_ids))


def full_prompts(recorded: Sequence[ModelCallRecorded]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each call's (whole prompt, context after it), rebuilt from the shared prefixes."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    context: np.ndarray | None = None
    for call in recorded:
        prompt, context = extend(context, call)
        out.append((prompt, context))
    return out


def _versions(calls: Sequence[ModelCallRecorded]) -> tuple[int | None, int | None]:
    lows = [c.min_version for c in calls if c.min_version is not None]
    highs = [c.max_version for c in calls if c.max_version is not None]
    return (min(lows) if lows else None, max(highs) if highs else None)


def assemble(recorded: Sequence[ModelCallRecorded]) -> list[AssembledRow]:
    """The rows an attempt's recorded calls (in the order recorded) make."""
    rows: list[AssembledRow] = []
    chain: list[ModelCallRecorded] = []
    parts: list[tuple[np.ndarray, int, np.ndarray | None]] = []  # (ids, mask value, logprobs)
    prompt: np.ndarray | None = None
    environment_turns = 0
    previous: np.ndarray | None = None

    def close() -> None:
        if not chain:
            return
        ids = np.concatenate([p[0] for p in parts])
        mask = np.concatenate([np.full(p[0].shape[0], p[1], dtype=np.uint8) for p in parts])
        logprobs = None
        if all(c.has_logprobs for c in chain):
            logprobs = np.concatenate(
                [
                    p[2] if p[2] is not None else np.zeros(p[0].shape[0], dtype=np.float32)
                    for p in parts
                ]
            )
        low, high = _versions(chain)
        assert prompt is not None
        rows.append(
            AssembledRow(
                call_ids=[c.call_id for c in chain],
                prompt_ids=prompt,
                response_ids=ids,
                response_mask=mask,
                logprobs=logprobs,
                min_version=low,
                max_version=high,
                num_turns=environment_turns + len(chain) + 1,
            )
        )

    for call in recorded:
        arrays = call.arrays()  # decoded once: its prompt, response and log-probs all serve
        whole, context = extend(previous, call, arrays)
        extends = previous is not None and call.prompt_shared == previous.shape[0]
        if not extends:
            close()
            chain, parts, prompt, environment_turns = [], [], whole, 0
        else:
            added = whole[previous.shape[0] :]  # type: ignore[union-attr]
            if added.shape[0]:
                parts.append((added, 0, None))
                environment_turns += 1
        chain.append(call)
        parts.append((arrays.response_ids, 1, arrays.logprobs))
        previous = context
    close()
    return rows
