"""Each ``generate`` call of a wrapped verl agent loop, recorded as a model call as it happens
(docs/design.md §15, docs/verl.md "Model calls").

verl's agent loops reach the inference servers through one object, the ``server_manager`` they
are built with (verl 0.9.1's ``LLMServerClient``), whose ``generate(request_id=, prompt_ids=,
sampling_params=, ...)`` returns a ``TokenOutput``: the response's token ids, their log-probs, a
stop reason, and in ``extra_fields`` the weights versions that served it (``min_global_steps`` /
``max_global_steps``, which the client sets from the server's ``global_steps``). The ledger agent
loop builds its inner loops with ``RecordingServer`` in that place: each call's intent is in the
log before the request leaves and its record before the inner loop sees the answer, so a run
that dies after k calls leaves those k calls.

The session a call belongs to is the attempt running in the caller's context (``recording``):
one ``RecordingServer`` serves every attempt of a sample, and a run the ledger does not record (a
slot it already holds) passes straight through.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from sessions import calls
from sessions.recorder import SessionHandle

__all__ = ["RecordingServer", "made_from_calls", "recording", "stamped_version"]

_ATTEMPT: contextvars.ContextVar[SessionHandle | None] = contextvars.ContextVar(
    "rollout_ledger_verl_attempt", default=None
)
#: sampling settings worth keeping with a call's intent (the rest are verl's plumbing)
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_new_tokens",
    "logprobs",
    "repetition_penalty",
    "stop_token_ids",
    "seed",
)


@contextmanager
def recording(handle: SessionHandle) -> Iterator[None]:
    """Record the ``generate`` calls made in this context as ``handle``'s model calls."""
    token = _ATTEMPT.set(handle)
    try:
        yield
    finally:
        _ATTEMPT.reset(token)


def _sampling(params: Any) -> dict[str, Any] | None:
    if not isinstance(params, dict):
        return None
    kept = {key: params[key] for key in _SAMPLING_KEYS if params.get(key) is not None}
    return {
        key: (list(value) if isinstance(value, (list, tuple)) else value)
        for key, value in kept.items()
    } or None


def stamped_version(value: Any) -> int | None:
    """A weights version verl stamped (``min_global_steps`` / ``max_global_steps``); None for
    verl's -1 (no step known), a missing one, or anything that is not a version."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    return None


def _version(fields: dict[str, Any], key: str) -> int | None:
    value = fields.get(key)
    return stamped_version(fields.get("global_steps") if value is None else value)


class RecordingServer:
    """verl's ``server_manager`` with every ``generate`` recorded in the running attempt's session;
    every other attribute is the wrapped manager's."""

    def __init__(self, server_manager: Any) -> None:
        self._server_manager = server_manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server_manager, name)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        handle = _ATTEMPT.get()
        if handle is None:
            return await self._server_manager.generate(*args, **kwargs)
        prompt_ids = kwargs.get("prompt_ids", args[1] if len(args) > 1 else None)
        call_id = await handle.start_call(sampling=_sampling(kwargs.get("sampling_params")))
        started = time.perf_counter()
        try:
            output = await self._server_manager.generate(*args, **kwargs)
        except asyncio.CancelledError:
            raise  # the attempt is being aborted: its session records that, not the call
        except BaseException as error:
            await handle.fail_call(call_id, error, latency_s=time.perf_counter() - started)
            raise
        fields = getattr(output, "extra_fields", None) or {}
        await handle.record_call(
            call_id,
            prompt_ids=prompt_ids,
            response_ids=output.token_ids,
            response_logprobs=output.log_probs or None,
            finish_reason=output.stop_reason,
            min_version=_version(fields, "min_global_steps"),
            max_version=_version(fields, "max_global_steps"),
            latency_s=time.perf_counter() - started,
        )
        return output


def made_from_calls(handle: SessionHandle, output: Any) -> bool:
    """Whether the row the attempt's recorded calls assemble is ``output`` (verl's
    ``AgentLoopOutput``) token for token: prompt, response, mask, log-probs and turn count. When
    it is, the session's row is made from its calls at ``complete``; when it is not (verl cut the
    response at ``response_length``, a loop rewrote its history, a loop reached the servers
    another way), the loop hands ``output`` over whole and the calls stay in the log as what
    happened."""
    recorded = handle.view.recorded_calls()
    if not recorded or handle.view.open_calls():
        return False
    rows = calls.assemble(recorded)
    if len(rows) != 1:
        return False
    row = rows[0]
    mask = output.response_mask
    if not (
        np.array_equal(row.prompt_ids, np.asarray(output.prompt_ids))
        and np.array_equal(row.response_ids, np.asarray(output.response_ids))
        and np.array_equal(row.response_mask, np.asarray(mask if mask is not None else []))
        and row.num_turns == output.num_turns
    ):
        return False
    theirs = output.response_logprobs
    if (row.logprobs is None) != (theirs is None):
        return False
    return theirs is None or np.array_equal(row.logprobs, np.asarray(theirs, dtype=np.float32))
