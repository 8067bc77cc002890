"""A runner's model calls, recorded per turn through its `RolloutContext` (docs/trl.md, "Per-turn
model calls"; docs/design.md §15).

TRL's `rollout_func` contract sees only whole completions: the runner returns one row per
completion, and whatever it generated turn by turn stays inside it. A multi-turn runner that
records each generation as a model call, as it happens, keeps what the policy said in the log
even when the session dies mid-way (a crash after call k of n leaves k calls and a failed
session), and need not build its row at all: when it returns no `prompt_ids`/`completion_ids`,
the row TRL trains on is assembled from its recorded calls by `sessions.calls.assemble`, the
function the ledger assembles the session's own row with at `complete`, so the two are one row.

TRL reports no weights version with a generation. Each call is stamped with the trainer's
`state.global_step` at the rollout unless the runner gives its own: TRL's `_generate` pushes the
trainer's weights to vLLM (`vllm_generation.sync_weights()`) whenever `state.global_step` moved
since the last push (`_last_loaded_step`), right before it calls `rollout_func`, and its trainer
is synchronous, so every generation of a call is served by that step's weights. A runner that
samples a server TRL does not sync passes its own `min_version`/`max_version` (or None).

Each command comes in two forms, as `SyncLedger`'s do: blocking (`start`, `record`, `fail`,
`generate`) for a synchronous runner, which runs on a thread of its own, and awaitable (`astart`,
`arecord`, `afail`, `agenerate`) for an async runner.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from sessions.integrations.trl.errors import RunnerOutputError, TRLSetupError

__all__ = ["STEP_VERSION", "ModelCalls", "sampled_logprobs"]

T = TypeVar("T")


class _StepVersion:
    """The default of a call's versions: the trainer's step at the rollout (see the module)."""

    def __repr__(self) -> str:
        return "STEP_VERSION"


#: A call's versions by default: the weights of `trainer.state.global_step`, which TRL synced
#: before the rollout. Pass None for "unknown", or the versions your own server reports.
STEP_VERSION: Any = _StepVersion()


def sampled_logprobs(
    logprobs: Any, logprob_token_ids: Any = None, completion_ids: Any = None
) -> list[float]:
    """One log-prob per completion token from TRL's generation output, whose `logprobs` are
    `[token][k]` (`VLLMClient.generate`, `VLLMGeneration.generate`: sorted by probability, the
    sampled token's among them): the entry whose `logprob_token_ids` is the sampled token, or
    the first where there is one per token (TRL's default `logprobs=0`). A flat list passes."""
    rows = logprobs.tolist() if hasattr(logprobs, "tolist") else list(logprobs)
    out: list[float] = []
    for i, entry in enumerate(rows):
        if not isinstance(entry, (list, tuple)):
            out.append(float(entry))
            continue
        if logprob_token_ids is None or completion_ids is None or len(entry) == 1:
            out.append(float(entry[0]))
            continue
        token = int(completion_ids[i])
        ids = [int(t) for t in logprob_token_ids[i]]
        if token not in ids:
            raise RunnerOutputError(
                f"token {i} of the completion ({token}) is not among its logprob_token_ids {ids}; "
                "pass TRL's logprobs with the logprob_token_ids and completion_ids of the same output"
            )
        out.append(float(entry[ids.index(token)]))
    return out


class ModelCalls:
    """Records one session's model calls (`RolloutContext.calls`): `start` before the request
    leaves, `record` with its answer before the runner goes on, `fail` when it got none; or
    `generate(fn, prompt_ids)` around a generation function, which does all three and times it."""

    def __init__(self, session: Any, runner_loop: asyncio.AbstractEventLoop, step: int) -> None:
        self._session = session  # the SessionProxy `arun_session` gave the runner
        self._loop = runner_loop
        #: the version a call is stamped with unless the runner gives one (see the module)
        self.step = step

    # --------------------------------------------------------------------- awaitable forms
    async def astart(
        self,
        *,
        turn: int | None = None,
        sampling: Mapping[str, Any] | None = None,
        version: Any = STEP_VERSION,
    ) -> str:
        """Record a call's intent before its request leaves; returns its id. A call neither
        recorded nor failed when the runner returns fails the session (`incomplete_capture`)."""
        version = self.step if version is STEP_VERSION else version
        return await self._session.start_call(
            turn=turn, sampling=None if sampling is None else dict(sampling), version=version
        )

    async def arecord(
        self,
        call_id: str,
        *,
        prompt_ids: Any,
        completion_ids: Any,
        logprobs: Any | None = None,
        finish_reason: str | None = None,
        min_version: Any = STEP_VERSION,
        max_version: Any = STEP_VERSION,
        latency_s: float | None = None,
        server: str | None = None,
        text: str | None = None,
    ) -> None:
        """Record a started call's answer: the whole prompt as sent (each turn's prompt extends
        the previous turn's prompt and completion by the tool's or the user's tokens), the
        completion, one log-prob per completion token (`sampled_logprobs` flattens TRL's)."""
        low = self.step if min_version is STEP_VERSION else min_version
        high = self.step if max_version is STEP_VERSION else max_version
        await self._session.record_call(
            call_id,
            prompt_ids=_plain(prompt_ids),
            response_ids=_plain(completion_ids),
            response_logprobs=None if logprobs is None else _plain(logprobs),
            finish_reason=finish_reason,
            min_version=low,
            max_version=high,
            latency_s=latency_s,
            server=server,
            text=text,
        )

    async def afail(
        self,
        call_id: str,
        error: BaseException | None = None,
        *,
        message: str = "",
        latency_s: float | None = None,
    ) -> None:
        """Record that a started call got no answer (its error, or a message)."""
        await self._session.fail_call(call_id, error, message=message, latency_s=latency_s)

    async def agenerate(
        self,
        fn: Callable[[list[int]], Any],
        prompt_ids: Any,
        *,
        turn: int | None = None,
        sampling: Mapping[str, Any] | None = None,
        server: str | None = None,
    ) -> dict[str, Any]:
        """One call around `fn(prompt_ids)` (a function or an async function) that returns a
        dict with `completion_ids` and optionally `logprobs` (flat, or TRL's `[token][k]` with
        `logprob_token_ids`), `finish_reason`, `min_version`, `max_version` and `text`: its
        intent recorded first, then its answer with the time it took, or its failure (the error
        raised again; a cancelled call, as a timed-out session's, stays open). Returns the dict."""
        prompt = _plain(prompt_ids)
        call_id = await self.astart(turn=turn, sampling=sampling)
        began = time.perf_counter()
        try:
            answer = fn(prompt)
            if inspect.isawaitable(answer):
                answer = await answer
            fields = _answer(answer)
        except Exception as error:
            await self.afail(call_id, error, latency_s=time.perf_counter() - began)
            raise
        await self.arecord(
            call_id,
            prompt_ids=prompt,
            latency_s=time.perf_counter() - began,
            server=server,
            **fields,
        )
        return dict(answer)

    # ---------------------------------------------------------------------- blocking forms
    def start(
        self,
        *,
        turn: int | None = None,
        sampling: Mapping[str, Any] | None = None,
        version: Any = STEP_VERSION,
    ) -> str:
        """`astart`, blocking: for a synchronous runner (on its own thread)."""
        return self._block(self.astart(turn=turn, sampling=sampling, version=version), "start")

    def record(self, call_id: str, **answer: Any) -> None:
        """`arecord`, blocking: for a synchronous runner."""
        self._block(self.arecord(call_id, **answer), "record")

    def fail(
        self,
        call_id: str,
        error: BaseException | None = None,
        *,
        message: str = "",
        latency_s: float | None = None,
    ) -> None:
        """`afail`, blocking: for a synchronous runner."""
        self._block(self.afail(call_id, error, message=message, latency_s=latency_s), "fail")

    def generate(
        self,
        fn: Callable[[list[int]], Any],
        prompt_ids: Any,
        *,
        turn: int | None = None,
        sampling: Mapping[str, Any] | None = None,
        server: str | None = None,
    ) -> dict[str, Any]:
        """`agenerate`, blocking, for a synchronous runner: `fn` runs in the runner's thread."""
        prompt = _plain(prompt_ids)
        call_id = self.start(turn=turn, sampling=sampling)
        began = time.perf_counter()
        try:
            answer = fn(prompt)
            fields = _answer(answer)
        except Exception as error:
            self.fail(call_id, error, latency_s=time.perf_counter() - began)
            raise
        self.record(
            call_id,
            prompt_ids=prompt,
            latency_s=time.perf_counter() - began,
            server=server,
            **fields,
        )
        return dict(answer)

    def _block(self, coro: Coroutine[Any, Any, T], name: str) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None:
            coro.close()
            raise TRLSetupError(
                f"context.calls.{name}(...) blocks, and an event loop runs in this thread: an async "
                f"runner awaits context.calls.a{name}(...)"
            )
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


def _answer(answer: Any) -> dict[str, Any]:
    """What a generation function returned, as `arecord`'s keywords (a `RunnerOutputError`, the
    session's `invalid_output`, when it is not a dict with `completion_ids`)."""
    if not isinstance(answer, Mapping) or "completion_ids" not in answer:
        raise RunnerOutputError(
            f"the generation function given to context.calls.generate returned {answer!r:.80}; "
            "return a dict with completion_ids (and logprobs, finish_reason, ... if you have them)"
        )
    completion = _plain(answer["completion_ids"])
    logprobs = answer.get("logprobs")
    if logprobs is not None:
        logprobs = sampled_logprobs(logprobs, answer.get("logprob_token_ids"), completion)
    return {
        "completion_ids": completion,
        "logprobs": logprobs,
        "finish_reason": answer.get("finish_reason"),
        "min_version": answer.get("min_version", STEP_VERSION),
        "max_version": answer.get("max_version", STEP_VERSION),
        "text": answer.get("text"),
    }


def _plain(value: Any) -> Any:
    """A tensor or array as a list (the handle checks the values); anything else as it is."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, list) else value
