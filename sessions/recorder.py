"""The embedded recorder: a handle per live session that turns commands into appended events."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

from sessions import aggregate as agg
from sessions import events as ev
from sessions import storable, tokens, validation, vocabulary
from sessions.errors import ConfigError, InvalidInput, LedgerError, RolloutFailure
from sessions.failure_policy import MetricPolicy
from sessions.placeholder import PlaceholderPolicy
from store import EventStore, encode_data

__all__ = [
    "Limits",
    "MAX_EVENT_BYTES",
    "MAX_SESSION_BYTES",
    "MAX_SESSION_EVENTS",
    "SessionHandle",
    "RecordedFailure",
    "SessionOutcome",
    "append_then_apply",
    "storable_envelopes",
    "error_text",
    "event_bytes",
    "failure_origin",
    "failure_reason",
    "recorded_failure",
    "stored_bytes",
    "type_name",
]


#: Default caps (see `Limits`), after Temporal's 51,200 events / 50 MB per history.
MAX_EVENT_BYTES = 8 * 2**20
MAX_SESSION_EVENTS = 51_200
MAX_SESSION_BYTES = 128 * 2**20


def event_bytes(data: dict[str, Any], payload: bytes | None, data_json: str | None = None) -> int:
    """An event's stored size: its binary payload plus its JSON data as stored."""
    return len(payload or b"") + len(data_json if data_json is not None else encode_data(data))


@dataclass(frozen=True, slots=True)
class Limits:
    """Size caps checked before a command appends anything (None = no cap).

    `max_event_bytes` bounds one event (payload + JSON data); `max_session_events` and
    `max_session_bytes` bound a session's whole stream. Terminal commands (complete, fail,
    cancel) and `start` are never refused, so a session at its cap can always end.
    """

    max_event_bytes: int | None = MAX_EVENT_BYTES
    max_session_events: int | None = MAX_SESSION_EVENTS
    max_session_bytes: int | None = MAX_SESSION_BYTES

    def __post_init__(self) -> None:
        for name in ("max_event_bytes", "max_session_events", "max_session_bytes"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(
                    f"{name} must be a positive integer or None (no cap), got {value!r}"
                )

    def check(
        self,
        session_id: str,
        field: str,
        events_so_far: int,
        bytes_so_far: int,
        envelopes: Sequence[Any],
    ) -> int:
        """Raise InvalidInput (nothing written) if appending `envelopes` breaks a cap; else their size."""
        sizes = [event_bytes(e.data, e.payload, e.data_json) for e in envelopes]
        if self.max_event_bytes is not None:
            for envelope, size in zip(envelopes, sizes):
                if size > self.max_event_bytes:
                    raise _too_big(
                        session_id,
                        field,
                        size,
                        self.max_event_bytes,
                        "max_event_bytes",
                        f"{envelope.type} event would be {size:,} bytes ({len(envelope.payload or b''):,} of token "
                        f"payload, {size - len(envelope.payload or b''):,} of JSON)",
                    )
        if (
            self.max_session_events is not None
            and events_so_far + len(envelopes) > self.max_session_events
        ):
            raise _too_big(
                session_id,
                field,
                events_so_far + len(envelopes),
                self.max_session_events,
                "max_session_events",
                f"the session has {events_so_far:,} events and this command adds {len(envelopes)}",
            )
        total = bytes_so_far + sum(sizes)
        if self.max_session_bytes is not None and total > self.max_session_bytes:
            raise _too_big(
                session_id,
                field,
                total,
                self.max_session_bytes,
                "max_session_bytes",
                f"the session holds {bytes_so_far:,} bytes and this command adds {sum(sizes):,}",
            )
        return sum(sizes)


def _too_big(
    session_id: str, field: str, size: int, limit: int, name: str, detail: str
) -> InvalidInput:
    error = InvalidInput(
        session_id,
        field,
        f"{detail}: {size:,} is over {name}={limit:,}; nothing was written — record less, "
        f"or raise the cap with Ledger.open(..., {name}=...)",
    )
    error.size, error.limit, error.limit_name = size, limit, name  # type: ignore[attr-defined]
    return error


def stored_bytes(stored: Sequence[Any]) -> int:
    """The size `Limits` counts for a session's stored events."""
    return sum(event_bytes(s.data, s.payload) for s in stored)


@dataclass(frozen=True, slots=True)
class RecordedFailure:
    """An exception raised inside a session as the ledger records it: a reason and an origin the
    log can store, the error's text and its type's name. Built by `recorded_failure`, which never
    raises, so whatever a runner raises can end its session (docs/design.md §4)."""

    reason: str
    origin: str | None
    message: str
    error_type: str


#: The longest note `recorded_failure` adds to a message (why the runner's reason was not kept).
_NOTE_LIMIT = 300


def error_text(error: BaseException) -> str:
    """What `error` says, without ever raising: `str(error)`; its `repr()` when that is empty or
    raises (saying so); the type's name when both raise."""
    broken = None
    try:
        text = str(error)
        if text:
            return str.__str__(text)  # a str subclass's own methods are not trusted either
    except Exception as failed:  # noqa: BLE001 - a broken __str__ is the runner's, not ours
        broken = type(failed).__name__
    try:
        text = str.__str__(repr(error))
    except Exception:  # noqa: BLE001
        return type_name(error)
    return text if broken is None else f"{text} (its str() raised {broken})"


def type_name(error: BaseException) -> str:
    """The qualified name of `error`'s type, read from the type itself (a metaclass cannot
    override it)."""
    return str.__str__(type.__dict__["__qualname__"].__get__(type(error)))


def _shown(value: Any) -> str:
    """`value` for a message: its repr, cut; its type's name when repr raises."""
    try:
        return f"{str.__str__(repr(value)):.40}"
    except Exception:  # noqa: BLE001
        return f"a {type.__dict__['__qualname__'].__get__(type(value))}"


def recorded_failure(error: BaseException) -> RecordedFailure:
    """What failing a session because of `error` records (docs/design.md §4): the reason its type
    maps to, or the one a `RolloutFailure` carries; the origin it declares; `error_text(error)`.

    A reason or origin the log cannot take — one a `RolloutFailure` subclass set without its
    constructor's check (malformed, over 32 characters, reserved, or `orphaned`, the recovery
    sweep's), or one that raises when read — becomes `runner_error` (and the reason's default
    origin), the refusal noted in the message after the error's own text. Never raises.
    """
    reason, origin, notes = _mapped_reason(error), None, []
    if isinstance(error, RolloutFailure):
        declared, problem = _declared(error, "reason")
        if problem is None and not isinstance(declared, str):
            problem = f"a failure reason is a string, got {_shown(declared)}"
        problem = problem or vocabulary.reason_problem(declared, runner=True)
        if problem is None:
            reason = declared
        else:
            notes.append(f"reason refused, runner_error recorded: {problem}")
        declared, problem = _declared(error, "origin")
        if problem is None and declared is not None:
            if not isinstance(declared, str) or declared not in vocabulary.ORIGINS:
                problem = f"{_shown(declared)} is neither 'infra' nor 'policy'"
        if problem is None:
            origin = declared
        else:
            notes.append(f"origin refused, the reason's default used: {problem}")
    text = error_text(error)
    if notes:
        note = f" [rollout-ledger: {'; '.join(notes)}"
        note = (note if len(note) < _NOTE_LIMIT else note[: _NOTE_LIMIT - 2] + "…") + "]"
        if len(text) + len(note) > ev.MESSAGE_LIMIT:  # the error's own text first, then why
            text = text[: ev.MESSAGE_LIMIT - len(note) - 1] + "…"
        text += note
    return RecordedFailure(reason, origin, text, type_name(error))


def _mapped_reason(error: BaseException) -> str:
    if isinstance(error, RolloutFailure):
        return "runner_error"  # unless its own reason can be recorded (see recorded_failure)
    if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(error, InvalidInput) and _declared(error, "session_id")[0] is not None:
        return "invalid_output"  # a command of the session was refused: its tokens, mask, reward
    return "runner_error"  # an InvalidInput naming no session refused a name, not the output


def _declared(error: BaseException, name: str) -> tuple[Any, str | None]:
    """`error.<name>` as plain text (a str subclass, such as an enum, as its value) or as found,
    and None; or None and why it could not be read."""
    try:
        value = getattr(error, name)
        return (str.__str__(value) if isinstance(value, str) else value), None
    except Exception as failed:  # noqa: BLE001 - a property that raises is the runner's
        return None, f"reading it raised {type(failed).__name__}"


def failure_reason(error: BaseException) -> str:
    """The failure reason an exception raised inside a session is recorded with
    (docs/design.md §4); always one the log can store."""
    return recorded_failure(error).reason


def failure_origin(error: BaseException) -> str | None:
    """The origin a runner declared with its error (`RolloutFailure(origin=...)`), if any and
    valid."""
    return recorded_failure(error).origin


class SessionHandle:
    """Commands on one session. Each validates, appends its events, then applies them.

    Commands on one handle are serialised (a lock), so concurrent calls from one runner cannot
    race each other into a version conflict.
    """

    def __init__(
        self,
        store: EventStore,
        view: agg.SessionView,
        policy: PlaceholderPolicy,
        selection: str = "all",
        *,
        limits: Limits | None = None,
        stored_bytes: int = 0,
        metrics: MetricPolicy | None = None,
    ) -> None:
        self._store = store
        self._view = view
        self._policy = policy
        self._metrics = metrics or MetricPolicy()
        self._selection = selection
        self._limits = limits or Limits()
        self._bytes = stored_bytes  # the stream's size as `Limits` counts it
        self._lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()

    def _locked(self) -> asyncio.Lock:
        """The handle's command lock, once it is certain this is the handle's own event loop: a
        handle (its lock, its store's group-commit worker) belongs to the loop it was made on, and
        used from another one it would wait forever on a lock or a worker nobody runs."""
        if asyncio.get_running_loop() is not self._loop:
            raise LedgerError(
                f"session {self.session_id!r}: this SessionHandle was made on another event loop "
                f"({'closed' if self._loop.is_closed() else 'still open'}); a handle and its ledger serve the loop "
                "they were opened on — open the ledger in this loop, or use Ledger.load_session there"
            )
        return self._lock

    # ----------------------------------------------------------- properties
    @property
    def session_id(self) -> str:
        return self._view.session_id

    @property
    def state(self) -> str:
        return self._view.state

    @property
    def version(self) -> int:
        return self._view.version

    @property
    def terminal(self) -> bool:
        return self._view.terminal

    @property
    def attempt(self) -> int:
        """The current attempt, 1-based (a runner may behave differently on a retry)."""
        return self._view.attempt

    @property
    def view(self) -> agg.SessionView:
        """The folded state (read-only by convention)."""
        return self._view

    # -------------------------------------------------------------- commands
    async def start(self, *, attempt: int | None = None, timeout_s: float | None = None) -> None:
        """Start a session created with `start=False` (created -> running), or its next attempt
        after `retry` (retrying -> running)."""
        async with self._locked():
            await self._commit(agg.decide_start(self._view, attempt=attempt, timeout_s=timeout_s))

    async def record_trajectory(
        self,
        *,
        prompt_ids: Any,
        response_ids: Any,
        response_mask: Any | None = None,
        response_logprobs: Any | None = None,
        num_turns: int = 1,
        materialization_reason: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> int:
        """Record one trajectory; returns its index. Mask defaults to all 1 (every token trainable)."""
        sid = self.session_id
        arrays = validation.trajectory(
            sid, prompt_ids, response_ids, response_mask, response_logprobs
        )
        if (
            isinstance(num_turns, bool)
            or not isinstance(num_turns, (int, np.integer))
            or num_turns < 0
        ):
            raise InvalidInput(sid, "num_turns", f"must be an integer >= 0, got {num_turns!r}")
        num_turns = int(num_turns)
        extra = validation.json_dict(sid, "extra", extra)
        async with self._locked():
            event = ev.TrajectoryRecorded(
                index=self._view.recorded,
                num_turns=num_turns,
                prompt_len=arrays.prompt_len,
                response_len=arrays.response_len,
                has_logprobs=arrays.logprobs is not None,
                trainable_tokens=arrays.response_len
                if response_mask is None
                else int(arrays.response_mask.sum()),
                materialization_reason=materialization_reason,
                extra=extra,
                payload=tokens.encode(arrays),
            )
            await self._commit(agg.decide_trajectory(self._view, event), capped="trajectory")
            return event.index

    async def post_reward(self, reward: float | None, **info: Any) -> None:
        """Post the reward (None = absent) and diagnostics; info merges into reward_info by key."""
        reward = validation.reward(self.session_id, "reward", reward)
        info = validation.json_dict(self.session_id, "info", info)
        async with self._locked():
            await self._commit(agg.decide_reward(self._view, reward, info), capped="info")

    async def complete(
        self, *, score: float | None = None, trajectory_selection: str | None = None
    ) -> str:
        """End the session: `succeeded`, or `failed`/`empty_output` without a trajectory. Returns the state."""
        score = validation.reward(self.session_id, "score", score)
        async with self._locked():
            decided = agg.decide_complete(
                self._view,
                self._policy,
                score=score,
                selection=trajectory_selection or self._selection,
                metrics=self._metrics,
            )
            await self._commit(decided)
        return self.state

    async def fail(
        self,
        reason: str = "runner_error",
        *,
        message: str = "",
        error_type: str | None = None,
        origin: str | None = None,
    ) -> None:
        """End the session as failed; `origin` (`infra`/`policy`) overrides the reason's default."""
        async with self._locked():
            await self._commit(
                agg.decide_fail(
                    self._view,
                    self._policy,
                    reason,
                    message=message,
                    error_type=error_type,
                    origin=origin,
                    metrics=self._metrics,
                    selection=self._selection,
                )
            )

    async def fail_with(self, error: BaseException) -> None:
        """Fail the session because `error` was raised inside it, whatever it is: its reason,
        origin and text as `recorded_failure` makes them storable."""
        failure = recorded_failure(error)
        await self.fail(
            failure.reason,
            message=failure.message,
            error_type=failure.error_type,
            origin=failure.origin,
        )

    async def retry(
        self,
        reason: str = "runner_error",
        *,
        message: str = "",
        error_type: str | None = None,
        origin: str | None = None,
        retry_in_s: float = 0.0,
    ) -> None:
        """End the current attempt as failed and superseded (running -> retrying); `start()`
        begins the next. `Ledger.run_session(retry=...)` does this for you."""
        async with self._locked():
            origin = self._metrics.origin(reason, origin)  # type: ignore[arg-type]
            await self._commit(
                agg.decide_retry(
                    self._view,
                    reason,
                    origin,
                    message=message,
                    error_type=error_type,
                    retry_in_s=retry_in_s,
                )
            )

    async def retry_with(self, error: BaseException, *, retry_in_s: float = 0.0) -> None:
        """`retry` because `error` was raised inside the attempt (made storable as in `fail_with`)."""
        failure = recorded_failure(error)
        await self.retry(
            failure.reason,
            message=failure.message,
            error_type=failure.error_type,
            origin=failure.origin,
            retry_in_s=retry_in_s,
        )

    async def cancel(self, message: str | None = None) -> None:
        async with self._locked():
            await self._commit(agg.decide_cancel(self._view, message=message))

    # -------------------------------------------------------------- internals
    async def _commit(self, decided: Sequence[ev.Event], *, capped: str | None = None) -> None:
        """Append and apply `decided`; `capped` names the field a size cap refusal blames
        (None for start and terminal commands, which caps never refuse)."""
        view = self._view
        decided, envelopes = storable_envelopes(
            decided,
            session_id=view.session_id,
            version=view.version,
            run=view.run,
            uid=view.uid,
            partition=view.partition,
            global_step=view.global_step,
        )
        if capped is not None:
            size = self._limits.check(view.session_id, capped, view.version, self._bytes, envelopes)
        else:
            size = sum(event_bytes(e.data, e.payload, e.data_json) for e in envelopes)
        before = view.version
        try:
            await append_then_apply(self._store, view, decided, envelopes)
        finally:
            if view.version != before:  # committed (even if the caller was cancelled meanwhile)
                self._bytes += size


def storable_envelopes(
    decided: Sequence[ev.Event],
    *,
    session_id: str,
    version: int,
    run: str,
    uid: str,
    partition: str,
    global_step: int | None,
) -> tuple[list[ev.Event], list[Any]]:
    """The events made storable (`InvalidInput` if one cannot be) and wrapped for the store after
    `version`, with one timestamp for the command.

    A plain function rather than comprehensions inside the awaiting command: in Python 3.11 a
    comprehension that reads a coroutine's locals turns them into cells that live as long as its
    frame, until the commit, long enough for the cyclic collector to promote them.
    """
    now = datetime.now(timezone.utc)
    cleaned: list[ev.Event] = []
    envelopes: list[Any] = []
    for offset, event in enumerate(decided, start=1):
        event, data = storable.clean_event_data(session_id, event)
        cleaned.append(event)
        envelopes.append(
            ev.envelope(
                event,
                session_id=session_id,
                version=version + offset,
                run=run,
                uid=uid,
                partition=partition,
                global_step=global_step,
                recorded_at=now,
                data=data,
            )
        )
    return cleaned, envelopes


async def append_then_apply(
    store: EventStore, view: agg.SessionView, decided: Sequence[ev.Event], envelopes: list[Any]
) -> None:
    """Append, and apply to the view only once the append committed.

    A caller cancelled while its append is in flight still learns the append's fate before the
    cancellation propagates (the store's `AppendFuture` defers it), so the view never falls
    behind (or runs ahead of) the log.
    """
    append = store.submit(view.session_id, view.version, envelopes)
    try:
        await append
    except asyncio.CancelledError:
        if append.done() and append.exception() is None:  # committed, then the cancellation arrived
            for event in decided:
                view.apply(event)
        raise
    for event in decided:
        view.apply(event)


@dataclass(frozen=True, slots=True)
class SessionOutcome:
    """What `run_session` reports: the terminal state and, for failures, why.

    `state` is `succeeded`, `failed` or `cancelled` — or `recording` when `run_session`'s time
    (its `timeout` per attempt, plus `recording_timeout`) ran out before the session's end was
    written, because the database kept the append waiting (a lock held elsewhere). The end is
    then still being recorded in the background: `await outcome.recorded()` gives the outcome
    once it is (docs/design.md §12, docs/failures.md).
    """

    session_id: str
    state: str
    failure_reason: str | None = None
    error: BaseException | None = None
    #: attempts made (more than 1 when the retry policy retried it)
    attempts: int = 1
    #: for a `recording` outcome, the run still under way (await it through `recorded()`)
    pending: asyncio.Future[SessionOutcome] | None = field(default=None, repr=False, compare=False)

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded"

    async def recorded(self, timeout: float | None = None) -> SessionOutcome:
        """The outcome once the session's end is in the log: this one if it already was, else the
        background recording's, awaited (on the ledger's event loop) at most `timeout` seconds
        (`TimeoutError` after them; the recording goes on). The ledger's own error, if the
        database refused the recording, is raised here; `Ledger.close()` also waits for it."""
        if self.pending is None:
            return self
        return await asyncio.wait_for(asyncio.shield(self.pending), timeout)
