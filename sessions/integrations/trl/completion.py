"""A runner's completion, checked, and the dict TRL's `rollout_func` returns, placeholders included.

A runner returns one mapping per completion: `prompt_ids`, `completion_ids` and `reward` always;
`logprobs`, `env_mask` (1 = the model's token, 0 = tool or environment output) and `num_turns`
when it has them; any other key is a column TRL forwards to the reward functions. A runner that
recorded its turns as model calls (`turns.py`) may leave `prompt_ids` and `completion_ids` out:
its row is then the one its calls make, as the ledger assembles it. A failed
session's row is the placeholder TRL accepts (`docs/design.md §5`, shaped for TRL): one prompt
and one completion token (the pad token, which TRL counts as a terminated completion),
`env_mask` [0] so no token reaches the loss, logprob 0.0, and reward `None`, which TRL leaves out
of the group baseline (advantage 0) and out of its logged `reward`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sessions.integrations.trl.errors import RunnerOutputError, TRLSetupError

if TYPE_CHECKING:
    from sessions.calls import AssembledRow

__all__ = [
    "FAILURE",
    "REWARD",
    "SESSION",
    "Completion",
    "parse_completion",
    "trl_output",
]

#: The columns the wrapper adds to TRL's output; reward functions receive them by these names.
REWARD = "ledger_reward"
FAILURE = "ledger_failure"
SESSION = "ledger_session_id"
REQUIRED = ("prompt_ids", "completion_ids", "reward")
OPTIONAL = ("logprobs", "env_mask", "num_turns")
#: The keys of a row the runner builds itself; without both, its recorded calls make the row.
ROW_KEYS = frozenset({"prompt_ids", "completion_ids"})
#: Names TRL itself passes to reward functions (or reads from the output): a column of that name
#: would collide with them.
RESERVED = frozenset(
    {"prompt", "prompts", "completion", "completions", "trainer_state", "log_extra", "log_metric"}
    | {"environments", REWARD, FAILURE, SESSION}
)


@dataclass(frozen=True)
class Completion:
    """One runner's result, checked: what the session records and the row TRL gets."""

    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float
    logprobs: list[float] | None = None
    env_mask: list[int] | None = None
    num_turns: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    #: the recorded model calls the row was assembled from (`turns.py`); empty when the runner
    #: returned the row itself
    call_ids: tuple[str, ...] = ()


def _plain(value: Any) -> Any:
    """A tensor or array as a list; anything else as it is."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, list) else value


def _ints(name: str, value: Any, *, allowed: tuple[int, ...] | None = None) -> list[int]:
    value = _plain(value)
    if not isinstance(value, (list, tuple)) or not value:
        raise RunnerOutputError(
            f"the runner's {name} must be a non-empty list of token ids, got {value!r:.80}"
        )
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise RunnerOutputError(
                f"the runner's {name} holds {item!r}, not a non-negative integer"
            )
        if allowed is not None and item not in allowed:
            raise RunnerOutputError(f"the runner's {name} holds {item!r}; use only {allowed}")
        out.append(item)
    return out


def builds_from_calls(result: Any) -> bool:
    """Whether a runner's result leaves its row to its recorded calls: a dict with neither
    `prompt_ids` nor `completion_ids`."""
    return isinstance(result, Mapping) and not (ROW_KEYS & result.keys())


def parse_completion(result: Any, assembled: Sequence[AssembledRow] | None = None) -> Completion:
    """Check a runner's result; a `RunnerOutputError` (the session fails as `invalid_output`)
    names the first thing wrong. `assembled`: the rows the attempt's recorded model calls make
    (None when it recorded none), which are the completion when the result leaves its row to
    them (`builds_from_calls`)."""
    if not isinstance(result, Mapping):
        raise RunnerOutputError(
            f"the runner returned {type(result).__name__}; return a dict with {', '.join(REQUIRED)}"
        )
    if assembled is not None and builds_from_calls(result):
        return _from_calls(result, assembled)
    missing = [key for key in REQUIRED if key not in result]
    if missing:
        calls = (
            "; or record each turn through context.calls and leave prompt_ids and "
            "completion_ids out"
            if ROW_KEYS & set(missing)
            else ""
        )
        raise RunnerOutputError(
            f"the runner's result lacks {', '.join(missing)} (keys: {sorted(result)}){calls}"
        )
    _check_names(result)
    prompt_ids = _ints("prompt_ids", result["prompt_ids"])
    completion_ids = _ints("completion_ids", result["completion_ids"])
    reward = _reward(result)
    logprobs = _plain(result.get("logprobs"))
    if logprobs is not None:
        if not isinstance(logprobs, (list, tuple)) or len(logprobs) != len(completion_ids):
            raise RunnerOutputError(
                f"the runner's logprobs must be one number per completion token ({len(completion_ids)}), got {logprobs!r:.80}"
            )
        logprobs = [float(x) for x in logprobs]
    env_mask = result.get("env_mask")
    if env_mask is not None:
        env_mask = _ints("env_mask", env_mask, allowed=(0, 1))
        if len(env_mask) != len(completion_ids):
            raise RunnerOutputError(
                f"the runner's env_mask has {len(env_mask)} entries for {len(completion_ids)} completion tokens"
            )
    num_turns = result.get("num_turns", 1)
    if isinstance(num_turns, bool) or not isinstance(num_turns, int) or num_turns < 0:
        raise RunnerOutputError(
            f"the runner's num_turns must be an integer >= 0, got {num_turns!r}"
        )
    extra = {k: v for k, v in result.items() if k not in REQUIRED and k not in OPTIONAL}
    return Completion(prompt_ids, completion_ids, reward, logprobs, env_mask, num_turns, extra)


def _check_names(result: Mapping[str, Any]) -> None:
    clash = sorted(set(result) & RESERVED)
    if clash:
        raise RunnerOutputError(
            f"the runner's result uses {clash}, which TRL or the ledger already pass to reward functions; rename them"
        )


def _reward(result: Mapping[str, Any]) -> float:
    reward = _plain(result["reward"])
    if (
        isinstance(reward, bool)
        or not isinstance(reward, (int, float))
        or not math.isfinite(reward)
    ):
        raise RunnerOutputError(f"the runner's reward must be a finite number, got {reward!r:.80}")
    return float(reward)


def _from_calls(result: Mapping[str, Any], assembled: Sequence[AssembledRow]) -> Completion:
    """The completion a runner's recorded calls make: the row the ledger assembles from them at
    `complete` (`sessions.calls.assemble`), so TRL trains on the session's own row."""
    if "reward" not in result:
        raise RunnerOutputError(f"the runner's result lacks reward (keys: {sorted(result)})")
    _check_names(result)
    given = sorted(set(OPTIONAL) & result.keys())
    if given:
        raise RunnerOutputError(
            f"the runner's result gives {given}, but its row is assembled from its recorded model "
            "calls, which say them; leave them out, or return prompt_ids and completion_ids too"
        )
    if len(assembled) != 1:
        starts = [row.call_ids[0] for row in assembled[1:]]
        raise RunnerOutputError(
            f"the runner's recorded calls make {len(assembled)} rows, and TRL takes one completion "
            f"per session: call(s) {', '.join(starts)} do not extend the context before them (each "
            "turn's prompt must be the previous prompt and completion plus the new tokens)"
        )
    (row,) = assembled
    return Completion(
        prompt_ids=row.prompt_ids.tolist(),
        completion_ids=row.response_ids.tolist(),
        reward=_reward(result),
        logprobs=None if row.logprobs is None else row.logprobs.tolist(),
        env_mask=row.response_mask.tolist(),
        num_turns=row.num_turns,
        extra={k: v for k, v in result.items() if k != "reward"},
        call_ids=tuple(row.call_ids),
    )


def trl_output(
    completions: Sequence[Completion | None],
    failures: Sequence[str | None],
    session_ids: Sequence[str],
    placeholder_token_id: int,
) -> dict[str, Any]:
    """The dict `rollout_func` returns: one row per session, a placeholder where it failed
    (`completions[i]` None, `failures[i]` its reason)."""
    token = placeholder_token_id
    done = [c for c in completions if c is not None]
    with_logprobs = [c.logprobs is not None for c in done]
    if any(with_logprobs) and not all(with_logprobs):
        raise TRLSetupError(
            f"{with_logprobs.count(False)} of {len(done)} completions came back without logprobs: TRL takes "
            "logprobs for every row or for none; return them from every runner call, or from none"
        )
    keep_logprobs = bool(done) and all(with_logprobs)
    columns = sorted({key for c in done for key in c.extra})
    out: dict[str, Any] = {
        "prompt_ids": [],
        "completion_ids": [],
        "logprobs": [] if keep_logprobs else None,
    }
    out.update(env_mask=[], **{REWARD: [], FAILURE: list(failures), SESSION: list(session_ids)})
    out.update({key: [] for key in columns})
    for c in completions:
        if c is None:
            out["prompt_ids"].append([token])
            out["completion_ids"].append([token])
            out["env_mask"].append([0])
            out[REWARD].append(None)
            if keep_logprobs:
                out["logprobs"].append([0.0])
            for key in columns:
                out[key].append(None)
            continue
        out["prompt_ids"].append(c.prompt_ids)
        out["completion_ids"].append(c.completion_ids)
        out["env_mask"].append(
            c.env_mask if c.env_mask is not None else [1] * len(c.completion_ids)
        )
        out[REWARD].append(c.reward)
        if keep_logprobs:
            out["logprobs"].append(c.logprobs)
        for key in columns:
            out[key].append(c.extra.get(key))
    return out
