"""The session aggregate: state rebuilt by folding events, and commands that decide new events.

Deciders are pure: they check the command against the transition table and the inputs, and
return the events to append. The recorder appends them and only then applies them (docs/design.md §3:
validate, append, then apply), so a failed append never leaves the in-memory state ahead of the log.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sessions import events as ev
from sessions import machine, vocabulary
from sessions.errors import InvalidInput
from sessions.failure_policy import MetricPolicy
from sessions.placeholder import EMIT, KEEP_PARTIAL, PlaceholderPolicy

__all__ = [
    "NEW",
    "SessionView",
    "decide_call_failed",
    "decide_call_recorded",
    "decide_call_started",
    "decide_cancel",
    "decide_complete",
    "decide_fail",
    "decide_retry",
    "decide_reward",
    "decide_start",
    "decide_trajectory",
    "fold",
]

NEW = "new"  # before SessionCreated; not a machine state


@dataclass(slots=True)
class _TrajectoryInfo:
    index: int
    num_turns: int
    prompt_len: int
    response_len: int


@dataclass(slots=True)
class _Call:
    """One model call of the current attempt: its intent, then its record or its failure."""

    call_id: str
    turn: int
    #: the intent's sampling fields (the gateway keeps a request's key there)
    sampling: dict[str, Any] = field(default_factory=dict)
    recorded: ev.ModelCallRecorded | None = None
    failed: bool = False

    @property
    def open(self) -> bool:
        return self.recorded is None and not self.failed


@dataclass(slots=True)
class SessionView:
    """Everything known about one session, derived from its events alone."""

    session_id: str
    state: str = NEW
    version: int = 0
    run: str = ""
    uid: str = ""
    session_index: int = 0
    group_size: int = 1
    partition: str = ""
    global_step: int | None = None
    data_source: str | None = None
    runner: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    trajectories: list[_TrajectoryInfo] = field(default_factory=list)
    reward: float | None = None
    reward_posted: bool = False
    reward_info: dict[str, Any] = field(default_factory=dict)
    selected: list[int] = field(default_factory=list)
    trajectory_selection: str | None = None
    score: float | None = None
    score_source: str | None = None
    failure_reason: str | None = None
    error_type: str | None = None
    message: str | None = None
    placeholder_decision: str | None = None
    placeholder_emitted: int = 0
    placeholder_token_id: int | None = None
    #: the current attempt (1-based; 0 before the session starts)
    attempt: int = 0
    #: trajectories recorded over all attempts (the next one's index); `trajectories` holds the
    #: current attempt's only — a failed attempt's are superseded
    recorded: int = 0
    superseded: int = 0
    #: (attempt, reason) of each superseded attempt
    retries: list[tuple[int, str]] = field(default_factory=list)
    failure_origin: str | None = None
    metric_decision: str | None = None
    #: the current attempt's model calls by id, in the order their intents were recorded (a
    #: failed attempt's are superseded with its trajectories)
    calls: dict[str, _Call] = field(default_factory=dict)
    #: the attempt's recorded calls in the order they were recorded: each call's stored prompt is
    #: a delta of the context the one recorded before it left, so this is the order that rebuilds
    #: them (concurrent calls may be recorded in another order than they started)
    call_records: list[ev.ModelCallRecorded] = field(default_factory=list)
    #: the token context after the last recorded call of the attempt (its prompt and response):
    #: what the next call's prompt is stored as a delta of
    call_context: Any = None
    #: model calls over all attempts, by how they ended
    calls_recorded: int = 0
    calls_failed: int = 0

    @property
    def terminal(self) -> bool:
        return self.state in machine.TERMINAL_STATES

    def open_calls(self) -> list[str]:
        """Ids of the attempt's calls with an intent and neither record nor failure."""
        return [c.call_id for c in self.calls.values() if c.open]

    def recorded_calls(self) -> list[ev.ModelCallRecorded]:
        """The attempt's recorded calls, in the order they were recorded (the order their stored
        prompts are deltas in)."""
        return list(self.call_records)

    def apply(self, event: ev.Event) -> None:
        """Advance the view by one event (the events are trusted: they are the log)."""
        handler = _APPLY.get(type(event))
        if handler is None:
            raise TypeError(f"no fold rule for {type(event).__name__}")
        handler(self, event)
        self.version += 1


def fold(session_id: str, recorded: Iterable[ev.Event]) -> SessionView:
    view = SessionView(session_id)
    for event in recorded:
        view.apply(event)
    return view


def _created(view: SessionView, e: ev.SessionCreated) -> None:
    view.state = machine.CREATED
    view.run, view.uid, view.session_index, view.group_size = (
        e.run,
        e.uid,
        e.session_index,
        e.group_size,
    )
    view.partition, view.global_step, view.data_source, view.runner = (
        e.partition,
        e.global_step,
        e.data_source,
        e.runner,
    )
    view.metadata = dict(e.metadata)


def _started(view: SessionView, e: ev.SessionStarted) -> None:
    view.state = machine.RUNNING
    view.attempt = e.attempt if e.attempt is not None else view.attempt + 1


def _trajectory(view: SessionView, e: ev.TrajectoryRecorded) -> None:
    view.trajectories.append(_TrajectoryInfo(e.index, e.num_turns, e.prompt_len, e.response_len))
    view.recorded = max(view.recorded, e.index + 1)


def _call_started(view: SessionView, e: ev.ModelCallStarted) -> None:
    view.calls[e.call_id] = _Call(e.call_id, e.turn, e.sampling)


def _call_recorded(view: SessionView, e: ev.ModelCallRecorded) -> None:
    view.calls[e.call_id].recorded = e
    view.call_records.append(e)
    view.calls_recorded += 1
    from sessions import calls  # numpy: only the folds of sessions that record calls load it

    try:
        view.call_context = calls.extend(view.call_context, e)[1]
    except ValueError:  # a pruned payload: a settled session's, whose context nobody extends
        view.call_context = None


def _call_failed(view: SessionView, e: ev.ModelCallFailed) -> None:
    view.calls[e.call_id].failed = True
    view.calls_failed += 1


def _attempt_failed(view: SessionView, e: ev.AttemptFailed) -> None:
    """The attempt's work is superseded: its trajectories, calls and reward no longer count."""
    view.state = machine.RETRYING
    view.superseded += len(view.trajectories)
    view.trajectories = []
    view.calls, view.call_records, view.call_context = {}, [], None
    view.reward, view.reward_posted, view.reward_info = None, False, {}
    view.retries.append((e.attempt, e.reason))


def _reward(view: SessionView, e: ev.RewardPosted) -> None:
    view.reward = e.reward
    view.reward_posted = True
    view.reward_info.update(e.info)
    view.reward_info["reward"] = e.reward


def _succeeded(view: SessionView, e: ev.SessionSucceeded) -> None:
    view.state = machine.SUCCEEDED
    view.selected = list(e.selected)
    view.trajectory_selection = e.trajectory_selection
    view.score, view.score_source = e.score, e.score_source


def _failed(view: SessionView, e: ev.SessionFailed) -> None:
    view.state = machine.FAILED
    view.failure_reason, view.error_type, view.message = e.reason, e.error_type, e.message
    view.placeholder_decision = e.placeholder
    view.failure_origin, view.metric_decision = e.origin, e.metric
    if e.placeholder == KEEP_PARTIAL:
        view.selected = list(e.selected)


def _placeholder(view: SessionView, e: ev.PlaceholderEmitted) -> None:
    view.placeholder_emitted += 1
    view.placeholder_token_id = e.token_id


def _cancelled(view: SessionView, e: ev.SessionCancelled) -> None:
    view.state = machine.CANCELLED
    view.message = e.message


_APPLY: dict[type, Any] = {
    ev.SessionCreated: _created,
    ev.SessionStarted: _started,
    ev.TrajectoryRecorded: _trajectory,
    ev.ModelCallStarted: _call_started,
    ev.ModelCallRecorded: _call_recorded,
    ev.ModelCallFailed: _call_failed,
    ev.RewardPosted: _reward,
    ev.AttemptFailed: _attempt_failed,
    ev.SessionSucceeded: _succeeded,
    ev.SessionFailed: _failed,
    ev.PlaceholderEmitted: _placeholder,
    ev.SessionCancelled: _cancelled,
    ev.RunConfigured: lambda view, e: None,  # a run's stream, not a session's: nothing to fold
    ev.PayloadsPruned: lambda view, e: None,  # a run's stream too
}


# ---------------------------------------------------------------- deciders
def decide_start(
    view: SessionView, *, attempt: int | None = None, timeout_s: float | None = None
) -> list[ev.Event]:
    """The first attempt (from `created`), or the next one after a retry's backoff."""
    machine.next_state(view.session_id, view.state, "start")
    if view.state == machine.RETRYING:
        following = view.attempt + 1
        if attempt is not None and attempt != following:
            raise InvalidInput(
                view.session_id,
                "attempt",
                f"attempt {view.attempt} was retried, so the next is {following}, not {attempt!r}",
            )
        attempt = following
    return [ev.SessionStarted(attempt=attempt, timeout_s=timeout_s)]


def decide_retry(
    view: SessionView,
    reason: str,
    origin: str,
    *,
    message: str = "",
    error_type: str | None = None,
    retry_in_s: float = 0.0,
) -> list[ev.Event]:
    """End the current attempt as failed and superseded; the session waits for its next start."""
    machine.next_state(view.session_id, view.state, "retry")
    _check_reason(view.session_id, reason)
    _check_text(view.session_id, "message", message)
    _check_text(view.session_id, "error_type", error_type)
    if (
        isinstance(retry_in_s, bool)
        or not isinstance(retry_in_s, numbers.Real)
        or not 0 <= retry_in_s < math.inf
    ):
        raise InvalidInput(
            view.session_id,
            "retry_in_s",
            f"must be a finite number of seconds >= 0, got {retry_in_s!r}",
        )
    return [
        ev.AttemptFailed(
            attempt=max(view.attempt, 1),
            reason=reason,
            origin=origin,
            error_type=None if error_type is None else error_type[: ev.ERROR_TYPE_LIMIT],
            message=(message or "")[: ev.MESSAGE_LIMIT],
            discarded_trajectories=len(view.trajectories),
            retry_in_s=float(retry_in_s),
        )
    ]


def decide_trajectory(view: SessionView, event: ev.TrajectoryRecorded) -> list[ev.Event]:
    machine.next_state(view.session_id, view.state, "record_trajectory")
    return [event]


def decide_call_started(
    view: SessionView,
    call_id: str,
    turn: int,
    sampling: dict[str, Any],
    version: int | None,
) -> list[ev.Event]:
    """A model call's intent, before it is dispatched; its id is new in the attempt."""
    machine.next_state(view.session_id, view.state, "start_call")
    if call_id in view.calls:
        raise InvalidInput(
            view.session_id,
            "call_id",
            f"call {call_id!r} was started already in this attempt; give each call an id of its own",
        )
    return [ev.ModelCallStarted(call_id=call_id, turn=turn, sampling=sampling, version=version)]


def _open_call(view: SessionView, command: str, call_id: str) -> None:
    machine.next_state(view.session_id, view.state, command)
    call = view.calls.get(call_id)
    if call is None:
        raise InvalidInput(
            view.session_id,
            "call_id",
            f"no call {call_id!r} was started in this attempt: record its intent with "
            "start_call() before the request leaves",
        )
    if not call.open:
        ended = "recorded" if call.recorded is not None else "failed"
        raise InvalidInput(view.session_id, "call_id", f"call {call_id!r} was {ended} already")


def decide_call_recorded(view: SessionView, event: ev.ModelCallRecorded) -> list[ev.Event]:
    """A started call's answer."""
    _open_call(view, "record_call", event.call_id)
    return [event]


def decide_call_failed(
    view: SessionView,
    call_id: str,
    *,
    message: str = "",
    error_type: str | None = None,
    latency_s: float | None = None,
) -> list[ev.Event]:
    """A started call that ended without an answer."""
    _open_call(view, "fail_call", call_id)
    _check_text(view.session_id, "message", message)
    _check_text(view.session_id, "error_type", error_type)
    return [
        ev.ModelCallFailed(
            call_id=call_id,
            error_type=None if error_type is None else error_type[: ev.ERROR_TYPE_LIMIT],
            message=(message or "")[: ev.MESSAGE_LIMIT],
            latency_s=latency_s,
        )
    ]


def _from_calls(view: SessionView, recorded: list[ev.ModelCallRecorded]) -> list[ev.Event]:
    """The trajectories the attempt's recorded calls make, numbered after those recorded."""
    from sessions import calls, tokens

    made: list[ev.Event] = []
    for offset, row in enumerate(calls.assemble(recorded)):
        arrays = tokens.TokenArrays(
            row.prompt_ids, row.response_ids, row.response_mask, row.logprobs
        )
        made.append(
            ev.TrajectoryRecorded(
                index=view.recorded + offset,
                num_turns=row.num_turns,
                prompt_len=arrays.prompt_len,
                response_len=arrays.response_len,
                has_logprobs=row.logprobs is not None,
                trainable_tokens=int(row.response_mask.sum()),
                min_version=row.min_version,
                max_version=row.max_version,
                from_calls=row.call_ids,
                payload=tokens.encode(arrays),
            )
        )
    return made


def _answered_before_the_first_open(view: SessionView) -> list[ev.ModelCallRecorded]:
    """The attempt's recorded calls up to its first unanswered one (in the order they started):
    what partial work is. In record order, and cut at the first record of a call that started
    after it, since each stored prompt is a delta of the record before it."""
    before: set[str] = set()
    for call in view.calls.values():
        if call.open:
            break
        before.add(call.call_id)
    answered: list[ev.ModelCallRecorded] = []
    for record in view.call_records:
        if record.call_id not in before:
            break
        answered.append(record)
    return answered


def decide_reward(view: SessionView, reward: float | None, info: dict[str, Any]) -> list[ev.Event]:
    machine.next_state(view.session_id, view.state, "post_reward")
    return [ev.RewardPosted(reward=reward, info=info)]


def _select(trajectories: list[Any], selection: str) -> list[int]:
    """The trajectories (of the current attempt) that go to the batch: all, or the longest."""
    if selection == "all":
        return [t.index for t in trajectories]
    longest = max(trajectories, key=lambda t: (t.prompt_len + t.response_len, t.index))
    return [longest.index]


def decide_complete(
    view: SessionView,
    policy: PlaceholderPolicy,
    *,
    score: float | None = None,
    selection: str = "all",
    metrics: MetricPolicy | None = None,
) -> list[ev.Event]:
    """Success if there is a trajectory; otherwise the session failed with `empty_output`."""
    machine.next_state(view.session_id, view.state, "complete")
    if not isinstance(selection, str) or selection not in ("all", "longest"):
        raise InvalidInput(
            view.session_id,
            "trajectory_selection",
            f"must be 'all' or 'longest', got {selection!r}",
        )
    unanswered = view.open_calls()
    if unanswered:  # fail closed: never a silently short row
        return decide_fail(
            view,
            policy,
            vocabulary.INCOMPLETE_CAPTURE,
            message=f"complete() with {len(unanswered)} model call(s) started and never "
            f"recorded or failed: {', '.join(unanswered)}",
            metrics=metrics,
            selection=selection,
        )
    made = [] if view.trajectories else _from_calls(view, view.recorded_calls())
    trajectories = view.trajectories or made
    if not trajectories:
        return decide_fail(
            view,
            policy,
            vocabulary.EMPTY_OUTPUT,
            message="complete() with no recorded trajectory"
            + (" and no recorded model call" if view.calls else ""),
            metrics=metrics,
            selection=selection,
        )
    selected = _select(trajectories, selection)
    if score is not None:
        source = "external"
    elif view.reward_posted and view.reward is not None:
        score, source = view.reward, "reward_info"
    else:
        source = "absent"
    return [
        *made,
        ev.SessionSucceeded(
            selected=selected, trajectory_selection=selection, score=score, score_source=source
        ),
    ]


def decide_fail(
    view: SessionView,
    policy: PlaceholderPolicy,
    reason: str,
    *,
    message: str = "",
    error_type: str | None = None,
    origin: str | None = None,
    metrics: MetricPolicy | None = None,
    selection: str = "all",
    retry_refused: str | None = None,
) -> list[ev.Event]:
    """SessionFailed plus, policy permitting, its PlaceholderEmitted — appended together.

    `origin` is what the runner declared (`RolloutFailure(origin=...)`); without one the metric
    policy's origins (then the defaults) decide. A `keep_partial` decision with a posted reward
    and a trajectory sends the selected trajectories with that reward instead of a placeholder;
    without them it falls back to `emit`. The decisions applied are recorded in SessionFailed.
    """
    machine.next_state(view.session_id, view.state, "fail")
    _check_reason(view.session_id, reason)
    _check_text(view.session_id, "message", message)
    _check_text(view.session_id, "error_type", error_type)
    metrics = metrics or _DEFAULT_METRICS
    origin = metrics.origin(reason, origin)  # type: ignore[arg-type]
    decision = policy.decide(view.partition, reason, origin)
    selected: list[int] = []
    score = None
    made: list[ev.Event] = []
    if decision == KEEP_PARTIAL:
        if view.reward_posted and view.reward is not None and not view.trajectories:
            made = _from_calls(view, _answered_before_the_first_open(view))
        trajectories = view.trajectories or made
        if trajectories and view.reward_posted and view.reward is not None:
            selected, score = _select(trajectories, selection), view.reward
        else:
            decision, made = EMIT, []
    failed = ev.SessionFailed(
        reason=reason,
        error_type=None if error_type is None else error_type[: ev.ERROR_TYPE_LIMIT],
        message=(message or "")[: ev.MESSAGE_LIMIT],
        discarded_trajectories=len(view.trajectories) + len(made) - len(selected),
        placeholder=decision,
        origin=origin,
        metric=metrics.decide(view.partition, reason, origin),
        selected=selected,
        score=score,
        retry_refused=retry_refused,
    )
    if decision != EMIT:
        return [*made, failed]
    reward_info = {**view.reward_info, "reward": 0.0, "finished": False}
    return [
        failed,
        ev.PlaceholderEmitted(
            reason=reason,
            token_id=policy.token_id,
            reward_info=reward_info,
            prompt_len=policy.prompt_length,
            response_len=policy.response_length,
        ),
    ]


_DEFAULT_METRICS = MetricPolicy()


def _check_reason(session_id: str, reason: object) -> None:
    vocabulary.check_reason(reason, session_id=session_id)


def decide_cancel(view: SessionView, *, message: str | None = None) -> list[ev.Event]:
    machine.next_state(view.session_id, view.state, "cancel")
    _check_text(view.session_id, "message", message)
    return [ev.SessionCancelled(message=(message or None) and message[: ev.MESSAGE_LIMIT])]


def _check_text(session_id: str, field: str, value: object) -> None:
    """Free text must be text (None allowed); what it holds is made storable later (`storable`)."""
    if value is not None and not isinstance(value, str):
        raise InvalidInput(
            session_id, field, f"must be a string or None, got {type(value).__name__}"
        )
