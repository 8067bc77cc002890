"""The embedded recorder: a handle per live session that turns commands into appended events."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

from sessions import aggregate as agg
from sessions import calls, storable, tokens, validation
from sessions import events as ev
from sessions.errors import ConfigError, InvalidInput, LedgerError
from sessions.failure_policy import RETRY_BUDGETS, MetricPolicy
from sessions.machine import FAILED
from sessions.placeholder import PlaceholderPolicy
from sessions.runner_failure import (
    RecordedFailure,
    error_text,
    failure_origin,
    failure_reason,
    recorded_failure,
    type_name,
)
from sessions.vocabulary import RUNNER_ERROR
from store import AppendOutcomeUnknown, ConcurrencyError, EventStore, encode_data

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


def _event_bytes(data: dict[str, Any], payload: bytes | None, data_json: str | None = None) -> int:
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
        sizes = [_event_bytes(e.data, e.payload, e.data_json) for e in envelopes]
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


def _envelopes_size(envelopes: Sequence[Any]) -> int:
    """The size `Limits` counts for envelopes about to be appended (outside the awaiting
    command: a generator there would hold its locals in cells; see `storable_envelopes`)."""
    return sum(len(e.payload or b"") + len(e.data_json) for e in envelopes)


def stored_bytes(stored: Sequence[Any]) -> int:
    """The size `Limits` counts for a session's stored events."""
    return sum(_event_bytes(s.data, s.payload) for s in stored)


class SessionHandle:
    """Commands on one session. Each validates, appends its events, then applies them.

    Commands on one handle are serialised (a lock), so concurrent calls from one runner cannot
    race each other into a version conflict.

    A handle that stages (`Ledger.session` and `Ledger.run_session` make such handles) acknowledges
    `record_trajectory` and `post_reward` once validated, decided and applied, without a round
    trip: their events are appended with the session's next durable command (any other one, or
    `flush()`) in that command's single append, so a session costs two appends instead of four.
    A crash before that append leaves the session as it was at its last durable command
    (docs/design.md §4, docs/reliability.md).
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
        on_failed: Callable[[str], None] | None = None,
        stage: bool = False,
    ) -> None:
        self._store = store
        #: told the run of each failure this handle records (the ledger's circuit breaker looks
        #: at the log before its next session, `sessions.runs.halts`)
        self._on_failed = on_failed
        self._view = view
        self._policy = policy
        self._metrics = metrics or MetricPolicy()
        self._selection = selection
        self._limits = limits or Limits()
        self._bytes = stored_bytes  # the stream's size as `Limits` counts it
        self._lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self._in_doubt: _Doubt | None = None  # an append whose outcome the store could not learn
        #: whether `record_trajectory` and `post_reward` wait for the next durable command
        self._stage = stage
        #: envelopes acknowledged and applied to the view, not yet appended
        self._staged: list[Any] = []
        #: an append that carried staged events failed: the view may be ahead of the log until
        #: it is folded again from the stored stream (before the next command decides anything)
        self._stale = False

    def _locked(self) -> asyncio.Lock | _Refolding:
        """The handle's command lock, once it is certain this is the handle's own event loop: a
        handle (its lock, its store's group-commit worker) belongs to the loop it was made on, and
        used from another one it would wait forever on a lock or a worker nobody runs."""
        if asyncio.get_running_loop() is not self._loop:
            raise LedgerError(
                f"session {self.session_id!r}: this SessionHandle was made on another event loop "
                f"({'closed' if self._loop.is_closed() else 'still open'}); a handle and its ledger serve the loop "
                "they were opened on — open the ledger in this loop, or use Ledger.load_session there"
            )
        return _Refolding(self) if self._stale else self._lock

    # ----------------------------------------------------------- properties
    @property
    def session_id(self) -> str:
        return self._view.session_id

    @property
    def state(self) -> str:
        return self._view.state

    @property
    def version(self) -> int:
        """The view's version: with staged commands, ahead of what is durable (`durable_version`)."""
        return self._view.version

    @property
    def durable_version(self) -> int:
        """The version the log is known to hold: `version` less the staged events."""
        return self._view.version - len(self._staged)

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
        min_version: int | None = None,
        max_version: int | None = None,
    ) -> int:
        """Record one trajectory; returns its index. Mask defaults to all 1 (every token
        trainable); `min_version` / `max_version`: the weights versions behind its response."""
        sid = self.session_id
        payload, prompt_len, response_len, has_logprobs, trainable = validation.trajectory_payload(
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
        low, high = validation.versions(sid, min_version, max_version)
        async with self._locked():
            event = ev.TrajectoryRecorded(
                index=self._view.recorded,
                num_turns=num_turns,
                prompt_len=prompt_len,
                response_len=response_len,
                has_logprobs=has_logprobs,
                trainable_tokens=trainable,
                materialization_reason=materialization_reason,
                extra=extra,
                min_version=low,
                max_version=high,
                payload=payload,
            )
            await self._commit(
                agg.decide_trajectory(self._view, event), capped="trajectory", stage=self._stage
            )
            return event.index

    async def start_call(
        self,
        call_id: str | None = None,
        *,
        turn: int | None = None,
        sampling: dict[str, Any] | None = None,
        version: int | None = None,
    ) -> str:
        """Record a model call's intent before the request leaves; returns its id (`c<n>`, the
        attempt's n-th call, when none is given). `turn`: the conversation turn (default: the
        attempt's count of calls so far); `version`: the weights version asked for, if known.
        A call left without `record_call` or `fail_call` fails the session closed at `complete`."""
        sid = self.session_id
        if call_id is not None:
            call_id = validation.label(sid, "call_id", call_id)
        if turn is not None:
            turn = validation.count(sid, "turn", turn)
        sampling = validation.json_dict(sid, "sampling", sampling)
        version = validation.version(sid, "version", version)
        async with self._locked():
            view = self._view
            call_id = call_id if call_id is not None else f"c{len(view.calls) + 1}"
            turn = turn if turn is not None else len(view.calls)
            await self._commit(
                agg.decide_call_started(view, call_id, turn, sampling, version), capped="sampling"
            )
        return call_id

    async def record_call(
        self,
        call_id: str,
        *,
        prompt_ids: Any,
        response_ids: Any,
        response_logprobs: Any | None = None,
        finish_reason: str | None = None,
        min_version: int | None = None,
        max_version: int | None = None,
        latency_s: float | None = None,
        server: str | None = None,
        text: str | None = None,
    ) -> None:
        """Record a started call's answer, before the caller hands it on: the whole prompt as
        sent (only what it adds to the previous call's context is stored), the response, its
        log-probs, and the weights versions that served it (one version: pass it as both, or as
        either). The session's row is assembled from its recorded calls at `complete`."""
        sid = self.session_id
        arrays = validation.trajectory(sid, prompt_ids, response_ids, None, response_logprobs)
        low, high = validation.versions(sid, min_version, max_version)
        latency_s = validation.latency(sid, latency_s)
        async with self._locked():
            view = self._view
            shared = calls.shared_prefix(view.call_context, arrays.prompt_ids)
            delta = tokens.TokenArrays(
                arrays.prompt_ids[shared:],
                arrays.response_ids,
                arrays.response_mask,
                arrays.logprobs,
            )
            event = ev.ModelCallRecorded(
                call_id=validation.label(sid, "call_id", call_id),
                prompt_shared=shared,
                prompt_len=delta.prompt_len,
                response_len=delta.response_len,
                has_logprobs=delta.logprobs is not None,
                finish_reason=finish_reason,
                min_version=low,
                max_version=high,
                latency_s=latency_s,
                server=server,
                text=text,
                payload=tokens.encode(delta),
            )
            await self._commit(agg.decide_call_recorded(view, event), capped="record_call")

    async def fail_call(
        self,
        call_id: str,
        error: BaseException | None = None,
        *,
        message: str = "",
        error_type: str | None = None,
        latency_s: float | None = None,
    ) -> None:
        """Record that a started call ended without an answer (`error`, or `message` and
        `error_type`): the call is settled and none of its tokens reach a row."""
        sid = self.session_id
        if error is not None:
            failure = recorded_failure(error)
            message, error_type = (
                _given(message, failure.message),
                _given(error_type, failure.error_type),
            )
        latency_s = validation.latency(sid, latency_s)
        async with self._locked():
            await self._commit(
                agg.decide_call_failed(
                    self._view,
                    validation.label(sid, "call_id", call_id),
                    message=message,
                    error_type=error_type,
                    latency_s=latency_s,
                ),
                capped="message",
            )

    async def post_reward(self, reward: float | None, **info: Any) -> None:
        """Post the reward (None = absent) and diagnostics; info merges into reward_info by key."""
        reward = validation.reward(self.session_id, "reward", reward)
        info = validation.json_dict(self.session_id, "info", info)
        async with self._locked():
            await self._commit(
                agg.decide_reward(self._view, reward, info), capped="info", stage=self._stage
            )

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
                selection=self._selection if trajectory_selection is None else trajectory_selection,
                metrics=self._metrics,
            )
            await self._commit(decided)
        return self.state

    async def fail(
        self,
        reason: str = RUNNER_ERROR,
        *,
        message: str = "",
        error_type: str | None = None,
        origin: str | None = None,
        retry_refused: str | None = None,
    ) -> None:
        """End the session as failed; `origin` (`infra`/`policy`) overrides the reason's default;
        `retry_refused` names the retry budget that refused the retry the policy would have made
        (`RetryPolicy.group_budget` / `step_budget`)."""
        if retry_refused is not None and not (
            isinstance(retry_refused, str) and retry_refused in RETRY_BUDGETS
        ):
            raise InvalidInput(
                self.session_id,
                "retry_refused",
                f"must be None or one of {list(RETRY_BUDGETS)}, got {retry_refused!r:.60}",
            )
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
                    retry_refused=retry_refused,
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
        reason: str = RUNNER_ERROR,
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
        """End the session as cancelled, `message` saying why: a pure abort, which leaves no row
        (no placeholder) and lets its group settle."""
        async with self._locked():
            await self._commit(agg.decide_cancel(self._view, message=message))

    async def flush(self) -> None:
        """Append the staged commands now (a no-op when none is staged): for a caller that must
        know they are durable before it goes on."""
        async with self._locked():
            if self._staged:
                await self._commit(())

    # -------------------------------------------------------------- internals
    async def _commit(
        self, decided: Sequence[ev.Event], *, capped: str | None = None, stage: bool = False
    ) -> None:
        """Append and apply `decided`, with the staged events before them; `capped` names the
        field a size cap refusal blames (None for start and terminal commands, which caps never
        refuse). `stage`: apply and stage them instead, for the next durable command's append."""
        view = self._view
        if self._stale:  # another command's append failed while this one waited for the lock
            decided_at = view.version
            await self._refold()
            raise _refolded_conflict(self.session_id, decided_at, view.version)
        doubt, self._in_doubt = self._in_doubt, None
        decided, envelopes = storable_envelopes(
            decided,
            session_id=view.session_id,
            version=view.version,
            run=view.run,
            uid=view.uid,
            partition=view.partition,
            global_step=view.global_step,
        )
        if doubt is not None:
            if doubt.version == view.version and list(doubt.decided) == decided:
                envelopes = (
                    doubt.envelopes
                )  # the same command again: the same ids, recognised if stored
            else:
                await self._resolve(doubt)
        if capped is not None:
            size = self._limits.check(view.session_id, capped, view.version, self._bytes, envelopes)
        else:
            size = _envelopes_size(envelopes)
        if stage:  # acknowledged now; durable with the next durable command's append
            # Every _YIELD_EVERY staged events a suspension point, as an awaited append is: a
            # runner that records in a loop must let timeouts, cancellation and the other
            # sessions in (a loop iteration each time would cost what staging saves). Cancelled
            # here, the command is not staged (nothing of it applied).
            if len(self._staged) % _YIELD_EVERY == _YIELD_EVERY - 1:
                await asyncio.sleep(0)
            for event in decided:
                view.apply(event)
            self._staged.extend(envelopes)
            self._bytes += size
            return
        staged = self._staged
        if staged:
            self._staged = []
            envelopes = staged + envelopes
        before = view.version
        committed = False
        try:  # `append_then_apply`, inline: one coroutine fewer per command
            append = self._store.submit(view.session_id, before - len(staged), envelopes)
            try:
                await append
            except asyncio.CancelledError:
                if append.done() and append.exception() is None:  # committed, then cancelled
                    committed = True
                    for event in decided:
                        view.apply(event)
                raise
            committed = True
            was = view.state
            for event in decided:
                view.apply(event)
            if self._on_failed is not None and view.state == FAILED != was:
                self._on_failed(view.run)
        except AppendOutcomeUnknown:
            if not staged:
                self._in_doubt = _Doubt(before, decided, envelopes, size)
            raise
        finally:
            if committed:  # (even if the caller was cancelled meanwhile)
                self._bytes += size
            elif staged:  # the view holds events the log may lack: fold it again before deciding
                self._stale = True

    async def _refold(self) -> None:
        """Fold the view again from the stored stream (in place: holders of `view` see it), after
        an append that carried staged events failed or its outcome was unknown."""
        stored = await self._store.read_stream(self.session_id)
        fresh = agg.fold(self.session_id, (ev.decode(s).event for s in stored))
        for name in _VIEW_FIELDS:
            setattr(self._view, name, getattr(fresh, name))
        self._bytes = stored_bytes(stored)
        self._staged = []
        self._stale = False

    async def _resolve(self, doubt: _Doubt) -> None:
        """Before a different command: read back whether the append in doubt landed. If it did,
        the handle applies it and this command, decided without it, is refused as a version
        conflict (run it again); if not, the command goes on. Unreadable: the doubt stays."""
        try:
            stored = {s.event_id for s in await self._store.read_stream(self.session_id)}
        except BaseException:
            self._in_doubt = doubt
            raise
        landed = [e.event_id in stored for e in doubt.envelopes]
        if not all(landed):
            return
        for event in doubt.decided:
            self._view.apply(event)
        self._bytes += doubt.size
        conflict = ConcurrencyError(self.session_id, doubt.version, self._view.version)
        conflict.add_note(
            "the earlier command whose outcome was unknown had been written after all; the "
            "handle has applied it — run this command again"
        )
        raise conflict


#: staged events between two suspension points of a staging handle
_YIELD_EVERY = 16
_VIEW_FIELDS = tuple(f.name for f in dataclasses.fields(agg.SessionView))


def _refolded_conflict(session_id: str, decided_at: int, stored: int) -> ConcurrencyError:
    conflict = ConcurrencyError(session_id, decided_at, stored)
    conflict.add_note(
        "an append that carried this handle's staged commands failed, so the handle was folded "
        "again from the log, which holds what was written; run this command again"
    )
    return conflict


class _Refolding:
    """The handle's lock, entered by folding the view from the log first (a stale handle's)."""

    __slots__ = ("_handle",)

    def __init__(self, handle: SessionHandle) -> None:
        self._handle = handle

    async def __aenter__(self) -> None:
        handle = self._handle
        await handle._lock.acquire()
        try:
            if handle._stale:
                await handle._refold()
        except BaseException:
            handle._lock.release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._handle._lock.release()


def _given(value: Any, default: Any) -> Any:
    """`value`, or `default` when none was given (None or an empty text); never the truth value
    of what a caller passed (an array has none), so a wrong type reaches the check that names it."""
    return default if value is None or (isinstance(value, str) and not value) else value


@dataclass(frozen=True, slots=True)
class _Doubt:
    """An append whose outcome the store could not learn (`AppendOutcomeUnknown`): what the
    handle decided at `version`, and the envelopes (event ids) it sent."""

    version: int
    decided: Sequence[ev.Event]
    envelopes: list[Any]
    size: int


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
    problem = (
        _session_id_problem(session_id)
        if type(session_id) is str
        else storable.session_id_problem(session_id)
    )
    if problem is not None:
        raise InvalidInput(None, "session_id", problem)
    cleaned: list[ev.Event] = []
    envelopes: list[Any] = []
    for event in decided:
        event, data = storable.storable_data(session_id, event)
        cleaned.append(event)
        version += 1
        envelopes.append(
            ev.envelope(
                event,
                session_id=session_id,
                version=version,
                run=run,
                uid=uid,
                partition=partition,
                global_step=global_step,
                recorded_at=now,
                data=data,  # the storable check's, so `to_data` runs once
            )
        )
    return cleaned, envelopes


#: A session's id is checked by its first command and remembered: each of its commands asks.
_session_id_problem = functools.lru_cache(maxsize=8192)(storable.session_id_problem)


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
