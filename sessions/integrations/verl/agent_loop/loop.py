"""``LedgerAgentLoop``: any verl agent loop, each run recorded as a ledger session (docs/design.md §13).

verl 0.9.1's ``AgentLoopWorker.generate_sequences`` gathers its samples' agent loops without
``return_exceptions``: one loop that raises fails the whole step and throws its siblings' work
away (V0, ``one_step_off_policy``, ``fully_async_policy``); V1's ``AgentLoopWorkerTQ`` marks the
prompt's group ``failure`` and pads it downstream. This loop wraps an inner loop, named like any
registered one, and makes each run a session of the ledger:

* the session's slot comes from verl's own fields (``sample``); its ledger is the worker
  process's (``process_ledger``), with the job's settings (``settings``);
* each ``generate`` call of the inner loop is recorded as a model call as it happens, with the
  weights versions verl's server client stamps on it (``calls``): a run that dies after k calls
  leaves k calls in the log;
* an attempt runs the inner loop, then scores its output with verl's own reward worker when the
  loop did not score it (exactly what verl would do next; verl then skips it), under the
  configured timeout; the session's row is the one its calls assemble when that is verl's output
  token for token, else the output handed over whole (tokens, mask, log-probs, turns, versions);
  the reward and ``reward_extra_info`` are posted and the output returned unchanged;
* an exception or a timeout fails the attempt, which the run's ``RetryPolicy`` may retry with a
  fresh inner loop; the final failure is a failed session, and the loop returns the placeholder
  output (``placeholder_output``): verl's step completes with one row per sample;
* cancellation is a pure abort: recorded as cancelled, re-raised, no placeholder;
* a slot the ledger already holds (verl's validation pads its batch with copies of its first
  rows; a validation step run again after a resume) runs the inner loop unrecorded, and still
  returns a placeholder if it fails.

Errors of the ledger itself (the database unreachable, a ``uid`` the ledger refuses) propagate:
the job is misconfigured and should say so on its first step.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import hydra
import numpy as np
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from sessions.batches.reward_info import RESERVED
from sessions.errors import ConfigError, InvalidArgumentType, InvalidInput
from sessions.integrations.verl.agent_loop.calls import (
    RecordingServer,
    made_from_calls,
    recording,
    stamped_version,
)
from sessions.integrations.verl.agent_loop.placeholder_output import (
    placeholder_output,
    placeholder_reward_info,
    wants_logprobs,
)
from sessions.integrations.verl.agent_loop.process_ledger import process_ledger
from sessions.integrations.verl.agent_loop.sample import VerlSample, running_sample
from sessions.integrations.verl.agent_loop.settings import LedgerSettings
from sessions.recorder import SessionHandle, failure_reason
from sessions.vocabulary import RUNNER_ERROR

__all__ = [
    "check_agent_loop_entries",
    "LedgerAgentLoop",
    "LedgerSingleTurnAgentLoop",
    "LedgerToolAgentLoop",
    "session_id_for",
]

logger = logging.getLogger(__name__)

_SINGLE_TURN = "verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop"
_TOOL_AGENT = "verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop"

#: (inner loop, data source) -> the reward_extra_info of this process's last output ({}: unscored)
_REWARD_KEYS: dict[tuple[str, str | None], dict[str, Any]] = {}
#: verl's own loops never score their outputs (verl's reward worker or its trainer does)
_UNSCORED_LOOPS = frozenset({_SINGLE_TURN, _TOOL_AGENT})
_DECLARE_KEYS = (
    "declare them in the verl command: +ledger.reward_keys='{acc: 0.0, pred: \"\"}' (each extra "
    "key of the reward function with the value a failed run carries), or +ledger.reward_keys='{}' "
    "when it returns none"
)


def session_id_for(run: str, sample: VerlSample) -> str:
    """The session id of a slot: readable, unique per (run, partition, step, uid, index), <= 128."""
    tag = hashlib.sha256(run.encode()).hexdigest()[:8]
    step = "none" if sample.global_step is None else str(sample.global_step)
    body = f"{sample.partition}/{step}/{sample.uid}/{sample.session_index}"
    if len(tag) + 1 + len(body) > 128:
        body = f"{sample.partition}/{step}/{hashlib.sha256(body.encode()).hexdigest()[:40]}"
    return f"{tag}/{body}"


def _inner_config(inner_agent: str) -> Mapping[str, Any]:
    """What ``hydra.utils.instantiate`` builds the inner loop from: a registered agent loop by its
    name, or a class by its dotted path. Its class is imported here, when the wrapper is built, so
    a typo or an import error is one ``ConfigError`` naming the path, never a failed run per row."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    entry = _agent_loop_registry.get(inner_agent)
    if entry is None:
        if "." not in inner_agent:
            raise ConfigError(
                f"inner_agent {inner_agent!r} is not a registered agent loop "
                f"({sorted(_agent_loop_registry)}) nor a dotted class path; name one in the "
                "agent_loop_config_path entry"
            )
        entry = {"_target_": inner_agent}
    target = str(entry.get("_target_", ""))
    try:
        cls = hydra.utils.get_class(target)
    except Exception as error:  # noqa: BLE001 - any import failure is the job's misconfiguration
        raise ConfigError(
            f"inner_agent {inner_agent!r}: cannot import its class {target!r} "
            f"({type(error).__name__}: {error}); fix the class path in the agent_loop_config_path "
            "entry, or the module's import"
        ) from error
    if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
        raise ConfigError(
            f"inner_agent {inner_agent!r}: {target!r} is not a verl agent loop (an AgentLoopBase "
            "subclass); name the agent loop class the ledger should wrap"
        )
    if issubclass(cls, LedgerAgentLoop):
        raise ConfigError(
            f"inner_agent {inner_agent!r} is itself a ledger agent loop ({target}); name the loop it "
            "wraps by its class path instead (e.g. "
            f"{_SINGLE_TURN})"
        )
    return entry


def check_agent_loop_entries(entries: Sequence[Mapping[str, Any]]) -> int:
    """The entries of an agent-loop YAML checked where the job starts (the trainer's driver,
    before Ray): each entry's class imported, and each ledger entry's inner loop resolved as the
    wrapper will (``_inner_config``), so a typo is one ``ConfigError`` naming it. Returns how many
    ledger entries were checked. Names the YAML registers are visible to each other, as in a
    worker; verl's registry is left as it was."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    saved = dict(_agent_loop_registry)
    _agent_loop_registry.update({str(entry["name"]): entry for entry in entries})
    checked = 0
    try:
        for entry in entries:
            target = str(entry.get("_target_", ""))
            try:
                cls = hydra.utils.get_class(target)
            except Exception as error:  # noqa: BLE001 - named below
                raise ConfigError(
                    f"agent loop {entry.get('name')!r}: cannot import its class {target!r} "
                    f"({type(error).__name__}: {error}); fix the agent_loop_config_path entry"
                ) from error
            if isinstance(cls, type) and issubclass(cls, LedgerAgentLoop):
                inner = entry.get("inner_agent") or cls.default_inner_agent
                if not inner:
                    raise ConfigError(
                        f"the ledger agent loop {entry.get('name')!r} needs inner_agent: the agent "
                        "loop it wraps (a registered name such as tool_agent, or a class path)"
                    )
                _inner_config(str(inner))
                checked += 1
    finally:
        _agent_loop_registry.clear()
        _agent_loop_registry.update(saved)
    return checked


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as Python values (what the ledger's JSON columns store)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _reward_info(output: AgentLoopOutput) -> dict[str, Any]:
    info = output.extra_fields.get("reward_extra_info") or {}
    return {key: _plain(value) for key, value in info.items() if key not in RESERVED}


class LedgerAgentLoop(AgentLoopBase):
    """Runs ``inner_agent`` (a registered agent-loop name or a class path) as a ledger session.

    Built by verl once per sample, with verl's standard arguments and the keys of its
    ``agent_loop_config_path`` entry; every argument but ``inner_agent`` and ``name`` goes on to
    the inner loop, which is built anew for each attempt.
    """

    #: the loop this class wraps when its config entry names none
    default_inner_agent: str | None = None

    def __init__(
        self,
        trainer_config: Any,
        server_manager: Any,
        tokenizer: Any,
        processor: Any,
        dataset_cls: Any,
        data_config: Any,
        hf_model_type: str | None = None,
        *,
        inner_agent: str | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        # AgentLoopBase.__init__ is not called: it builds a tokenization builder per object,
        # which only the inner loop (built per attempt) uses.
        inner = inner_agent or self.default_inner_agent
        if not inner:
            raise ConfigError(
                f"the ledger agent loop {name!r} needs inner_agent: the agent loop it wraps "
                "(a registered name such as tool_agent, or a class path)"
            )
        self.name = name or inner
        self.inner_agent = inner
        self.config = trainer_config.config
        self.settings = LedgerSettings.from_config(
            self.config, pad_token_id=getattr(tokenizer, "pad_token_id", None)
        )
        self._inner_entry = _inner_config(inner)
        self._unscored_inner = str(self._inner_entry.get("_target_")) in _UNSCORED_LOOPS
        self._inner_args = dict(
            trainer_config=trainer_config,
            server_manager=RecordingServer(server_manager),
            tokenizer=tokenizer,
            processor=processor,
            dataset_cls=dataset_cls,
            data_config=data_config,
            hf_model_type=hf_model_type,
            **kwargs,
        )
        #: the first attempt's inner loop, built now: a constructor that raises is one error
        #: naming the loop before any rollout, not a failed session per row
        self._first_inner: AgentLoopBase | None = self._build_inner()

    def _build_inner(self) -> AgentLoopBase:
        try:
            return hydra.utils.instantiate(config=self._inner_entry, **self._inner_args)  # type: ignore[no-any-return]
        except Exception as error:  # noqa: BLE001 - the user's constructor: named, then raised
            cause = error.__cause__ or error  # hydra wraps the constructor's error
            raise ConfigError(
                f"inner_agent {self.inner_agent!r}: building {self._inner_entry.get('_target_')!r} "
                f"raised {type(cause).__name__}: {cause}; fix its constructor or the arguments of its "
                "agent_loop_config_path entry"
            ) from error

    # ----------------------------------------------------------------------- one sample
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        sample = running_sample(self, kwargs)
        ledger = await process_ledger(self.settings)
        outputs: list[AgentLoopOutput] = []

        async def runner(handle: SessionHandle) -> None:
            with recording(handle):
                output = await self._attempt(sample, sampling_params, kwargs)
            await self._record(handle, output)
            outputs.append(output)

        try:
            outcome = await ledger.run_session(
                runner,
                session_id_for(self.settings.run, sample),
                uid=sample.uid,
                session_index=sample.session_index,
                group_size=sample.group_size,
                partition=sample.partition,
                global_step=sample.global_step,
                data_source=sample.data_source,
                runner=self.name,
                sample_index=sample.sample_index,
            )
        except InvalidInput as error:
            if not _slot_taken(error):
                raise
            return await self._unrecorded(sample, sampling_params, kwargs, error)
        if outcome.succeeded:
            self._check_declared_keys(outputs[-1])
            return outputs[-1]
        logger.warning(
            "agent loop %s failed (%s) for uid %s, run %d: %s",
            self.name,
            outcome.failure_reason,
            sample.uid,
            sample.session_index,
            outcome.error,
        )
        return await self._placeholder(sample, sampling_params, kwargs, outcome.failure_reason)

    async def _attempt(
        self, sample: VerlSample, sampling_params: dict[str, Any], kwargs: dict[str, Any]
    ) -> AgentLoopOutput:
        """One attempt: a fresh inner loop, its output scored as verl would, within the timeout."""

        async def work() -> AgentLoopOutput:
            inner, self._first_inner = self._first_inner, None
            if inner is None:  # a retry (or a padding copy's run): a fresh inner loop
                inner = self._build_inner()
            output = await inner.run(dict(sampling_params), **dict(kwargs))
            if isinstance(output, list):
                raise InvalidArgumentType(
                    f"agent loop {self.inner_agent} returned {len(output)} outputs; the ledger "
                    "agent loop wraps loops that return one AgentLoopOutput"
                )
            if output.reward_score is None:
                # verl's next step (AgentLoopWorker._agent_loop_postprocess) does exactly this;
                # doing it here makes a failing reward a failed session too
                await sample.worker._compute_score([output], kwargs=kwargs)
            # what a placeholder of this loop carries: the reward function's keys, or none when
            # the loop's outputs stay unscored here (verl scores them on the trainer)
            scored = output.reward_score is not None
            _REWARD_KEYS[(self.inner_agent, sample.data_source)] = (
                _reward_info(output) if scored else {}
            )
            return output

        timeout = self.settings.timeout
        return await (work() if timeout is None else asyncio.wait_for(work(), timeout))

    async def _record(self, handle: SessionHandle, output: AgentLoopOutput) -> None:
        if not made_from_calls(handle, output):
            fields = output.extra_fields
            await handle.record_trajectory(
                prompt_ids=output.prompt_ids,
                response_ids=output.response_ids,
                response_mask=output.response_mask,
                response_logprobs=output.response_logprobs,
                num_turns=output.num_turns,
                min_version=stamped_version(fields.get("min_global_steps")),
                max_version=stamped_version(fields.get("max_global_steps")),
            )
        if output.reward_score is not None:
            await handle.post_reward(float(output.reward_score), **_reward_info(output))

    async def _placeholder(
        self,
        sample: VerlSample,
        sampling_params: Mapping[str, Any],
        kwargs: dict[str, Any],
        reason: str | None,
    ) -> AgentLoopOutput:
        """The placeholder output, with the reward function's extra keys (``_placeholder_keys``)."""
        keys = await self._placeholder_keys(sample, kwargs, reason)
        return placeholder_output(
            self.settings.placeholder_policy(),
            reason=reason or RUNNER_ERROR,
            logprobs=wants_logprobs(sampling_params),
            reward_info=keys or None,
            global_step=sample.global_step,
        )

    async def _placeholder_keys(
        self, sample: VerlSample, kwargs: dict[str, Any], reason: str | None
    ) -> dict[str, Any]:
        """The reward keys a placeholder carries, each with a placeholder's value: verl takes the
        batch's keys from row 0, so a placeholder short of them drops them for the batch (row 0)
        or makes verl's ``_postprocess`` raise ``KeyError`` (a later row). In order: declared
        (``+ledger.reward_keys``); learned from this process's last run of the loop (its reward
        function's keys, or none when verl left it unscored); learned by scoring the
        placeholder's own tokens with verl's reward worker; none for verl's own loops when verl
        passes no reward worker (the trainer scores their rows). Otherwise nothing can tell, and
        the run stops here with one ``ConfigError`` saying what to declare."""
        declared = self.settings.placeholder_reward_keys()
        if declared is not None:
            return declared
        known = _REWARD_KEYS.get((self.inner_agent, sample.data_source))
        if known is not None:
            return placeholder_reward_info(known)
        if getattr(sample.worker, "reward_loop_worker_handles", None):
            probe = placeholder_output(
                self.settings.placeholder_policy(),
                reason=reason or RUNNER_ERROR,
                logprobs=False,
                reward_info=None,
                global_step=sample.global_step,
            )
            probe.reward_score = None
            try:  # the reward function on the placeholder's own tokens, only for its keys
                await sample.worker._compute_score([probe], kwargs=kwargs)
            except Exception as error:  # noqa: BLE001 - named in the error below
                raise ConfigError(
                    f"the ledger agent loop {self.name!r} cannot tell which reward keys a failed run's "
                    f"placeholder must carry: uid {sample.uid!r} failed before any run of this worker "
                    f"was scored, and verl's reward function raised on the placeholder "
                    f"({type(error).__name__}: {error}); {_DECLARE_KEYS}"
                ) from error
            return placeholder_reward_info(_reward_info(probe))
        if self._unscored_inner:
            return {}
        raise ConfigError(
            f"the ledger agent loop {self.name!r} cannot tell which reward keys a failed run's "
            f"placeholder must carry: uid {sample.uid!r} failed before any run of this worker "
            f"succeeded, verl passes no reward worker, and {self.inner_agent!r} may score itself; "
            f"{_DECLARE_KEYS}"
        )

    def _check_declared_keys(self, output: AgentLoopOutput) -> None:
        """A scored success whose reward keys differ from ``+ledger.reward_keys`` is refused: its
        placeholders would make verl drop the keys or raise ``KeyError`` on the batch."""
        declared = self.settings.placeholder_reward_keys()
        if declared is None or output.reward_score is None:
            return
        found = _reward_info(output)
        if set(found) != set(declared):
            raise ConfigError(
                f"ledger.reward_keys declares {sorted(declared)}, but the reward of "
                f"{self.inner_agent!r} returned {sorted(found)}; declare exactly the reward "
                "function's extra keys (verl takes a batch's keys from its first row)"
            )

    async def _unrecorded(
        self,
        sample: VerlSample,
        sampling_params: dict[str, Any],
        kwargs: dict[str, Any],
        error: InvalidInput,
    ) -> AgentLoopOutput:
        """A slot the ledger holds already (a padding copy): run it, record nothing."""
        logger.info("agent loop slot already recorded, running it unrecorded: %s", error)
        try:
            return await self._attempt(sample, sampling_params, kwargs)
        except Exception as failure:  # noqa: BLE001 - the wrapper's promise holds here too
            return await self._placeholder(sample, sampling_params, kwargs, _reason_of(failure))


def _slot_taken(error: InvalidInput) -> bool:
    """Whether the ledger refused a session because its slot is recorded already (its id, or its
    group's session_index), not because the slot is wrong (an index past the group size)."""
    text = str(error)
    return (error.field == "session_id" and "already exists" in text) or (
        error.field == "session_index" and "is taken" in text
    )


def _reason_of(error: BaseException) -> str:
    return failure_reason(error)


@register("ledger_single_turn_agent")
class LedgerSingleTurnAgentLoop(LedgerAgentLoop):
    """verl's ``single_turn_agent``, recorded."""

    default_inner_agent = _SINGLE_TURN


@register("ledger_tool_agent")
class LedgerToolAgentLoop(LedgerAgentLoop):
    """verl's ``tool_agent`` (multi-turn, tools), recorded."""

    default_inner_agent = _TOOL_AGENT
