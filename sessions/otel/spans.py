"""One session's events as OpenTelemetry spans: a trace per session, a span per attempt and per
model call, events for trajectories, rewards and failures (docs/otel.md).

Pure: events in, `ReadableSpan`s out, no I/O, so the export and the follower build the same
spans and a test can hold them without a receiver. Every id is derived (`ids.py`), every
timestamp is an event's `recorded_at`, and every text that came from a user (ids, messages, tool
output, call text) goes through `visible` first, so control characters reach a viewer as escapes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sessions import events as ev
from sessions.errors import MissingDependency
from sessions.otel import attributes as A
from sessions.otel import ids
from sessions.report.text import cut, visible

__all__ = ["CALL_TEXT_LIMIT", "build_spans", "require_sdk"]

#: Characters of a call's text kept in its span (the rest is marked as cut).
CALL_TEXT_LIMIT = 2000
#: Characters of a span's name taken from an id or a model name.
_NAME_LIMIT = 120
_INSTRUMENTATION = "rollout_ledger.otel"


def require_sdk() -> Any:
    """The OpenTelemetry SDK's trace module, or a one-line error saying how to install it."""
    try:
        from opentelemetry.sdk import trace as sdk_trace
    except ImportError as error:
        raise MissingDependency(
            f"the OpenTelemetry export needs the OpenTelemetry SDK, which could not be imported "
            f"({error}); install the otel extra: pip install -e '.[otel]'"
        ) from error
    return sdk_trace


def _ns(when: datetime) -> int:
    if when.tzinfo is None:  # SQLite keeps no zone; the ledger only writes UTC
        when = when.replace(tzinfo=timezone.utc)
    return int(when.timestamp() * 1_000_000_000)


def _text(value: Any, limit: int | None = None) -> str:
    shown = visible(str(value))
    return shown if limit is None else cut(shown, limit)


def _maybe(value: Any) -> str | None:
    return None if value is None else _text(value)


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes without the unknowns: OpenTelemetry has no null value."""
    return {k: v for k, v in attributes.items() if v is not None}


@dataclass
class _Span:
    """A span being built; turned into a `ReadableSpan` once its end is known."""

    name: str
    span_id: int
    parent_id: int | None
    start: int
    end: int | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any], int]] = field(default_factory=list)
    error: str | None = None  # the status description when the span ended in an error
    ok: bool = False

    def event(self, name: str, when: int, attributes: Mapping[str, Any]) -> None:
        self.events.append((name, _clean(attributes), when))

    def close(self, when: int) -> None:
        if self.end is None:
            self.end = max(when, self.start)


class _SessionTrace:
    """Folds one session's events, in order, into its spans (one handler per event type)."""

    def __init__(self, session_id: str, first: int) -> None:
        self.session_id = session_id
        self.shown_id = _text(session_id)
        self.root = _Span(
            f"session {cut(self.shown_id, _NAME_LIMIT)}",
            ids.session_span_id(session_id),
            None,
            first,
        )
        self.root.attributes.update(
            {
                A.OPERATION: "invoke_agent",
                A.CONVERSATION_ID: self.shown_id,
                A.SESSION_ID: self.shown_id,
                A.PHOENIX_KIND: "AGENT",
                A.PHOENIX_SESSION: self.shown_id,
                A.OUTCOME: "open",
            }
        )
        self.attempts: list[_Span] = []
        self.calls: dict[tuple[int, str], _Span] = {}
        self.current: _Span | None = None  # the attempt under way
        self.attempt_no = 0
        self.model: str | None = None
        self.placeholder = False
        self.reward: float | None = None  # the last reward or score the events carry
        self.tokens: tuple[int, int] | None = None  # (in, out) over the calls; None: no call
        self.handlers: dict[type[ev.Event], Callable[[Any, int], None]] = {
            ev.SessionCreated: self._created,
            ev.SessionStarted: self._started,
            ev.ModelCallStarted: self._call_started,
            ev.ModelCallRecorded: self._call_recorded,
            ev.ModelCallFailed: self._call_failed,
            ev.TrajectoryRecorded: self._trajectory,
            ev.RewardPosted: self._reward,
            ev.AttemptFailed: self._attempt_failed,
            ev.SessionSucceeded: self._succeeded,
            ev.SessionFailed: self._failed,
            ev.PlaceholderEmitted: self._placeholder,
            ev.SessionCancelled: self._cancelled,
        }

    # ------------------------------------------------------------------ folding
    def apply(self, event: ev.Event, when: int) -> None:
        handler = self.handlers.get(type(event))
        if handler is not None:
            handler(event, when)

    def _holder(self) -> _Span:
        """Where an event that belongs to the attempt goes (the root before any attempt)."""
        return self.current if self.current is not None else self.root

    def _created(self, event: ev.SessionCreated, when: int) -> None:
        self.root.attributes.update(
            _clean(
                {
                    A.RUN: _text(event.run),
                    A.PARTITION: event.partition,
                    A.STEP: event.global_step,
                    A.GROUP: _text(event.uid),
                    A.GROUP_SIZE: event.group_size,
                    A.SLOT: event.session_index,
                    A.DATA_SOURCE: _maybe(event.data_source),
                    A.RUNNER: _maybe(event.runner),
                    A.LAUNCH: event.launch,
                }
            )
        )

    def _started(self, event: ev.SessionStarted, when: int) -> None:
        if self.current is not None:
            self.current.close(when)
        self.attempt_no = event.attempt or self.attempt_no + 1
        self.current = _Span(
            f"attempt {self.attempt_no}",
            ids.attempt_span_id(self.session_id, self.attempt_no),
            self.root.span_id,
            when,
        )
        self.current.attributes.update(
            {
                A.OPERATION: "invoke_agent",
                A.CONVERSATION_ID: self.shown_id,
                A.PHOENIX_SESSION: self.shown_id,
                A.ATTEMPT: self.attempt_no,
                A.PHOENIX_KIND: "CHAIN",
            }
        )
        self.attempts.append(self.current)

    def _call(self, call_id: str, when: int, model: str | None = None) -> _Span:
        """The span of call `call_id` of the current attempt, made on its first event."""
        key = (self.attempt_no, call_id)
        span = self.calls.get(key)
        if span is None:
            span = self.calls[key] = _Span(
                "chat" if model is None else f"chat {cut(model, _NAME_LIMIT)}",
                ids.call_span_id(self.session_id, self.attempt_no, call_id),
                self._holder().span_id,
                when,
            )
            span.attributes.update(
                _clean(
                    {
                        A.OPERATION: "chat",
                        A.CONVERSATION_ID: self.shown_id,
                        A.MODEL: model,
                        A.CALL_ID: _text(call_id),
                        A.CALL_OUTCOME: "open",
                        A.ATTEMPT: self.attempt_no or None,
                        A.PHOENIX_KIND: "LLM",
                    }
                )
            )
            if self.tokens is None:
                self.tokens = (0, 0)
        return span

    def _call_started(self, event: ev.ModelCallStarted, when: int) -> None:
        asked = event.sampling.get("model") if isinstance(event.sampling, dict) else None
        model = _maybe(asked)
        if model is not None and self.model is None:
            self.model = model
        span = self._call(event.call_id, when, model)
        span.attributes.update(
            _clean({A.CALL_TURN: event.turn, A.VERSION_REQUESTED: event.version})
        )

    def _call_recorded(self, event: ev.ModelCallRecorded, when: int) -> None:
        span = self._call(event.call_id, when)
        used_in, used_out = event.prompt_shared + event.prompt_len, event.response_len
        total_in, total_out = self.tokens or (0, 0)
        self.tokens = (total_in + used_in, total_out + used_out)
        span.ok = True
        span.attributes.update(
            _clean(
                {
                    A.CALL_OUTCOME: "recorded",
                    A.INPUT_TOKENS: used_in,
                    A.OUTPUT_TOKENS: used_out,
                    A.PHOENIX_TOKENS_PROMPT: used_in,
                    A.PHOENIX_TOKENS_COMPLETION: used_out,
                    A.FINISH_REASONS: None
                    if event.finish_reason is None
                    else [_text(event.finish_reason)],
                    A.CALL_LATENCY_S: event.latency_s,
                    A.CALL_SERVER: _maybe(event.server),
                    A.CALL_TEXT: None if event.text is None else _text(event.text, CALL_TEXT_LIMIT),
                    A.MIN_VERSION: event.min_version,
                    A.MAX_VERSION: event.max_version,
                }
            )
        )
        span.close(when)

    def _call_failed(self, event: ev.ModelCallFailed, when: int) -> None:
        span = self._call(event.call_id, when)
        error_type = _text(event.error_type) if event.error_type else "call_failed"
        message = _text(event.message)
        span.attributes.update(
            _clean(
                {
                    A.CALL_OUTCOME: "failed",
                    A.ERROR_TYPE: error_type,
                    A.CALL_LATENCY_S: event.latency_s,
                }
            )
        )
        span.event(
            A.EVENT_EXCEPTION, when, {"exception.type": error_type, "exception.message": message}
        )
        span.error = f"{error_type}: {message}" if message else error_type
        span.close(when)

    def _trajectory(self, event: ev.TrajectoryRecorded, when: int) -> None:
        self._holder().event(
            A.EVENT_TRAJECTORY,
            when,
            {
                "index": event.index,
                "num_turns": event.num_turns,
                "prompt_tokens": event.prompt_len,
                "response_tokens": event.response_len,
                "trainable_tokens": event.trainable_tokens,
                "from_calls": [_text(c) for c in event.from_calls] or None,
            },
        )

    def _reward(self, event: ev.RewardPosted, when: int) -> None:
        self.reward = event.reward
        info = _text(json.dumps(event.info, sort_keys=True, default=str)) if event.info else None
        self._holder().event(A.EVENT_REWARD, when, {"reward": event.reward, "info": info})

    def _attempt_failed(self, event: ev.AttemptFailed, when: int) -> None:
        span = self._holder()
        reason, origin = _text(event.reason), _text(event.origin)
        error_type = _text(event.error_type) if event.error_type else reason
        span.event(
            A.EVENT_ATTEMPT_FAILED,
            when,
            {
                A.FAILURE_REASON: reason,
                A.FAILURE_ORIGIN: origin,
                "exception.type": error_type,
                "exception.message": _text(event.message),
                "retry_in_s": event.retry_in_s,
            },
        )
        span.attributes.update(
            {A.ERROR_TYPE: error_type, A.FAILURE_REASON: reason, A.FAILURE_ORIGIN: origin}
        )
        span.error = f"{reason}: {_text(event.message)}"
        span.close(when)

    def _succeeded(self, event: ev.SessionSucceeded, when: int) -> None:
        if event.score is not None:
            self.reward = event.score
        self.root.ok = True
        self.root.attributes.update(
            {A.OUTCOME: "succeeded", A.SCORE_SOURCE: _text(event.score_source)}
        )
        if self.current is not None:
            self.current.ok = self.current.error is None
        self.root.close(when)

    def _failed(self, event: ev.SessionFailed, when: int) -> None:
        reason = _text(event.reason)
        error_type = _text(event.error_type) if event.error_type else reason
        message = _text(event.message)
        failure = {
            A.FAILURE_REASON: reason,
            A.FAILURE_ORIGIN: _text(event.origin),
            A.FAILURE_ERROR_TYPE: None if event.error_type is None else error_type,
            A.FAILURE_MESSAGE: message,
            A.METRIC_POLICY: _text(event.metric),
            A.PLACEHOLDER_POLICY: _text(event.placeholder),
        }
        self.root.attributes.update(
            _clean({A.OUTCOME: "failed", A.ERROR_TYPE: error_type, **failure})
        )
        self.root.event(
            A.EVENT_EXCEPTION,
            when,
            {"exception.type": error_type, "exception.message": message, **failure},
        )
        self.root.error = f"{reason}: {message}" if message else reason
        if self.current is not None and self.current.error is None:
            self.current.error = self.root.error
        if event.score is not None:  # keep_partial: the kept trajectories' score
            self.reward = event.score
        # the root ends with the placeholder, if one follows, else at the session's last event

    def _placeholder(self, event: ev.PlaceholderEmitted, when: int) -> None:
        self.placeholder = True
        self.reward = event.reward
        self.root.event(
            A.EVENT_PLACEHOLDER,
            when,
            {"reason": _text(event.reason), "token_id": event.token_id, "reward": event.reward},
        )
        self.root.close(when)

    def _cancelled(self, event: ev.SessionCancelled, when: int) -> None:
        self.root.attributes[A.OUTCOME] = "cancelled"
        self.root.event(A.EVENT_CANCELLED, when, {"message": _text(event.message or "")})
        self.root.error = None  # a cancellation is the caller's choice, not an error
        self.root.close(when)

    # ------------------------------------------------------------------ ending
    def finish(self, last: int, reward: float | None | object) -> list[_Span]:
        """Every span closed (an open session's, an open call's at the session's end), the
        session's totals set; root first, then the attempts, then the calls."""
        root = self.root
        root.attributes[A.PLACEHOLDER] = self.placeholder
        root.attributes[A.ATTEMPT] = self.attempt_no
        if self.model is not None:
            root.attributes[A.MODEL] = self.model
        if self.tokens is not None:
            tokens_in, tokens_out = self.tokens
            root.attributes.update(
                {
                    A.INPUT_TOKENS: tokens_in,
                    A.OUTPUT_TOKENS: tokens_out,
                    A.PHOENIX_TOKENS_PROMPT: tokens_in,
                    A.PHOENIX_TOKENS_COMPLETION: tokens_out,
                }
            )
        shown = self.reward if reward is ... else reward
        if shown is not None:
            root.attributes[A.REWARD] = float(shown)  # type: ignore[arg-type]
        end = root.end if root.end is not None else last
        for attempt in self.attempts:
            attempt.close(end)
        for call in self.calls.values():
            if call.end is None:  # started, never answered: the capture is incomplete
                call.error = "incomplete_capture: the call was started and never answered"
                call.close(end)
        root.close(end)
        return [root, *self.attempts, *self.calls.values()]


def build_spans(
    session_id: str,
    recorded: Sequence[ev.Recorded],
    *,
    reward: float | None | object = ...,
    resource: Any = None,
) -> list[Any]:
    """The spans of one session, root first: the session, then each attempt, then its calls.

    `recorded`: the session's events in version order (`ev.decode` of its stream). `reward`: the
    session's reward as the read model holds it, None when it has none (not given: the last
    reward or score its events carry). A session still open ends its spans at its last event,
    with outcome `open`."""
    sdk_trace = require_sdk()
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    if not recorded:
        return []
    trace = _SessionTrace(session_id, _ns(recorded[0].recorded_at))
    for item in recorded:
        trace.apply(item.event, _ns(item.recorded_at))
    built = trace.finish(_ns(recorded[-1].recorded_at), reward)

    trace_id = ids.trace_id(session_id)
    scope = InstrumentationScope(_INSTRUMENTATION, schema_url=A.SCHEMA_URL)
    flags = TraceFlags(TraceFlags.SAMPLED)

    def context(span_id: int) -> Any:
        return SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags)

    def readable(span: _Span) -> Any:
        status = (
            Status(StatusCode.ERROR, span.error)
            if span.error is not None
            else Status(StatusCode.OK)
            if span.ok
            else Status(StatusCode.UNSET)
        )
        return sdk_trace.ReadableSpan(
            name=span.name,
            context=context(span.span_id),
            parent=None if span.parent_id is None else context(span.parent_id),
            resource=resource,
            attributes=span.attributes,
            events=[
                sdk_trace.Event(name, attrs, timestamp) for name, attrs, timestamp in span.events
            ],
            kind=SpanKind.CLIENT
            if span.attributes.get(A.OPERATION) == "chat"
            else SpanKind.INTERNAL,
            status=status,
            start_time=span.start,
            end_time=span.end,
            instrumentation_scope=scope,
        )

    return [readable(span) for span in built]
