"""One session's events as OpenTelemetry spans: a trace per session, a span per attempt and per
model call, events for trajectories, rewards and failures (docs/otel.md).

Pure: events in, `ReadableSpan`s out, no I/O, so the export and the follower build the same
spans and a test can hold them without a receiver. Every id is derived (`ids.py`), every
timestamp is an event's `recorded_at`, and every text that came from a user (ids, messages, tool
output, call text) goes through `visible` first, so control characters reach a viewer as escapes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
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

    def event(self, name: str, when: int, **attributes: Any) -> None:
        self.events.append((name, _clean(attributes), when))

    def close(self, when: int) -> None:
        if self.end is None:
            self.end = max(when, self.start)


@dataclass
class _Call:
    span: _Span
    input_tokens: int | None = None
    output_tokens: int | None = None


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
    reward or score its events carry). A session still
    open ends its spans at its last event, with outcome `open`."""
    sdk_trace = require_sdk()
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    if not recorded:
        return []
    trace = ids.trace_id(session_id)
    shown_id = _text(session_id)
    root_id = ids.session_span_id(session_id)
    first = _ns(recorded[0].recorded_at)
    last = _ns(recorded[-1].recorded_at)
    root = _Span(f"session {cut(shown_id, 120)}", root_id, None, first)
    root.attributes.update(
        {
            A.OPERATION: "invoke_agent",
            A.CONVERSATION_ID: shown_id,
            A.SESSION_ID: shown_id,
            A.PHOENIX_KIND: "AGENT",
            A.PHOENIX_SESSION: shown_id,
            A.OUTCOME: "open",
        }
    )
    attempts: list[_Span] = []
    calls: dict[tuple[int, str], _Call] = {}
    current: _Span | None = None
    attempt_no = 0
    model: str | None = None
    placeholder = False
    event_reward: float | None = None
    tokens_in = tokens_out = 0
    any_call = False

    def holder() -> _Span:
        return current if current is not None else root

    for item in recorded:
        event, when = item.event, _ns(item.recorded_at)
        if isinstance(event, ev.SessionCreated):
            root.attributes.update(
                _clean(
                    {
                        A.RUN: _text(event.run),
                        A.PARTITION: event.partition,
                        A.STEP: event.global_step,
                        A.GROUP: _text(event.uid),
                        A.GROUP_SIZE: event.group_size,
                        A.SLOT: event.session_index,
                        A.DATA_SOURCE: None
                        if event.data_source is None
                        else _text(event.data_source),
                        A.RUNNER: None if event.runner is None else _text(event.runner),
                        A.LAUNCH: event.launch,
                    }
                )
            )
        elif isinstance(event, ev.SessionStarted):
            if current is not None:
                current.close(when)
            attempt_no = event.attempt or attempt_no + 1
            current = _Span(
                f"attempt {attempt_no}", ids.attempt_span_id(session_id, attempt_no), root_id, when
            )
            current.attributes.update(
                {
                    A.OPERATION: "invoke_agent",
                    A.CONVERSATION_ID: shown_id,
                    A.ATTEMPT: attempt_no,
                    A.PHOENIX_KIND: "CHAIN",
                }
            )
            attempts.append(current)
        elif isinstance(event, ev.ModelCallStarted):
            parent = holder()
            asked = event.sampling.get("model") if isinstance(event.sampling, dict) else None
            if asked is not None and model is None:
                model = _text(asked)
            span = _Span(
                "chat" if asked is None else f"chat {cut(_text(asked), 120)}",
                ids.call_span_id(session_id, attempt_no, event.call_id),
                parent.span_id,
                when,
            )
            span.attributes.update(
                _clean(
                    {
                        A.OPERATION: "chat",
                        A.CONVERSATION_ID: shown_id,
                        A.MODEL: None if asked is None else _text(asked),
                        A.CALL_ID: _text(event.call_id),
                        A.CALL_TURN: event.turn,
                        A.CALL_OUTCOME: "open",
                        A.ATTEMPT: attempt_no or None,
                        A.VERSION_REQUESTED: event.version,
                        A.PHOENIX_KIND: "LLM",
                    }
                )
            )
            calls[(attempt_no, event.call_id)] = _Call(span)
            any_call = True
        elif isinstance(event, ev.ModelCallRecorded):
            call = calls.get((attempt_no, event.call_id))
            if call is None:  # a record without its intent: the log says so, the span shows it
                call = _Call(
                    _Span(
                        "chat",
                        ids.call_span_id(session_id, attempt_no, event.call_id),
                        holder().span_id,
                        when,
                    )
                )
                call.span.attributes[A.CALL_ID] = _text(event.call_id)
                calls[(attempt_no, event.call_id)] = call
            any_call = True
            call.input_tokens = event.prompt_shared + event.prompt_len
            call.output_tokens = event.response_len
            tokens_in += call.input_tokens
            tokens_out += call.output_tokens
            call.span.ok = True
            call.span.attributes.update(
                _clean(
                    {
                        A.CALL_OUTCOME: "recorded",
                        A.INPUT_TOKENS: call.input_tokens,
                        A.OUTPUT_TOKENS: call.output_tokens,
                        A.PHOENIX_TOKENS_PROMPT: call.input_tokens,
                        A.PHOENIX_TOKENS_COMPLETION: call.output_tokens,
                        A.FINISH_REASONS: None
                        if event.finish_reason is None
                        else [_text(event.finish_reason)],
                        A.CALL_LATENCY_S: event.latency_s,
                        A.CALL_SERVER: None if event.server is None else _text(event.server),
                        A.CALL_TEXT: None
                        if event.text is None
                        else _text(event.text, CALL_TEXT_LIMIT),
                        A.MIN_VERSION: event.min_version,
                        A.MAX_VERSION: event.max_version,
                    }
                )
            )
            call.span.close(when)
        elif isinstance(event, ev.ModelCallFailed):
            call = calls.get((attempt_no, event.call_id))
            if call is None:
                call = _Call(
                    _Span(
                        "chat",
                        ids.call_span_id(session_id, attempt_no, event.call_id),
                        holder().span_id,
                        when,
                    )
                )
                call.span.attributes[A.CALL_ID] = _text(event.call_id)
                calls[(attempt_no, event.call_id)] = call
            error_type = _text(event.error_type) if event.error_type else "call_failed"
            message = _text(event.message)
            call.span.attributes.update(
                _clean(
                    {
                        A.CALL_OUTCOME: "failed",
                        A.ERROR_TYPE: error_type,
                        A.CALL_LATENCY_S: event.latency_s,
                    }
                )
            )
            call.span.event(
                A.EVENT_EXCEPTION,
                when,
                **{"exception.type": error_type, "exception.message": message},
            )
            call.span.error = f"{error_type}: {message}" if message else error_type
            call.span.close(when)
        elif isinstance(event, ev.TrajectoryRecorded):
            holder().event(
                A.EVENT_TRAJECTORY,
                when,
                index=event.index,
                num_turns=event.num_turns,
                prompt_tokens=event.prompt_len,
                response_tokens=event.response_len,
                trainable_tokens=event.trainable_tokens,
                from_calls=[_text(c) for c in event.from_calls] or None,
            )
        elif isinstance(event, ev.RewardPosted):
            event_reward = event.reward
            holder().event(
                A.EVENT_REWARD,
                when,
                reward=event.reward,
                info=_text(json.dumps(event.info, sort_keys=True, default=str))
                if event.info
                else None,
            )
        elif isinstance(event, ev.AttemptFailed):
            span = holder()
            error_type = _text(event.error_type) if event.error_type else _text(event.reason)
            span.event(
                A.EVENT_ATTEMPT_FAILED,
                when,
                **{
                    A.FAILURE_REASON: _text(event.reason),
                    A.FAILURE_ORIGIN: _text(event.origin),
                    "exception.type": error_type,
                    "exception.message": _text(event.message),
                    "retry_in_s": event.retry_in_s,
                },
            )
            span.attributes.update(
                {
                    A.ERROR_TYPE: error_type,
                    A.FAILURE_REASON: _text(event.reason),
                    A.FAILURE_ORIGIN: _text(event.origin),
                }
            )
            span.error = f"{_text(event.reason)}: {_text(event.message)}"
            span.close(when)
        elif isinstance(event, ev.SessionSucceeded):
            event_reward = event.score if event.score is not None else event_reward
            root.ok = True
            root.attributes.update(
                {A.OUTCOME: "succeeded", A.SCORE_SOURCE: _text(event.score_source)}
            )
            if current is not None:
                current.ok = current.error is None
            root.close(when)
        elif isinstance(event, ev.SessionFailed):
            error_type = _text(event.error_type) if event.error_type else _text(event.reason)
            message = _text(event.message)
            failure = {
                A.FAILURE_REASON: _text(event.reason),
                A.FAILURE_ORIGIN: _text(event.origin),
                A.FAILURE_ERROR_TYPE: None if event.error_type is None else error_type,
                A.FAILURE_MESSAGE: message,
                A.METRIC_POLICY: _text(event.metric),
                A.PLACEHOLDER_POLICY: _text(event.placeholder),
            }
            root.attributes.update(
                _clean({A.OUTCOME: "failed", A.ERROR_TYPE: error_type, **failure})
            )
            root.event(
                A.EVENT_EXCEPTION,
                when,
                **{"exception.type": error_type, "exception.message": message},
                **failure,
            )
            root.error = f"{_text(event.reason)}: {message}" if message else _text(event.reason)
            if current is not None and current.error is None:
                current.error = root.error
            if event.score is not None:
                event_reward = event.score
        elif isinstance(event, ev.PlaceholderEmitted):
            placeholder = True
            event_reward = event.reward
            root.event(
                A.EVENT_PLACEHOLDER,
                when,
                reason=_text(event.reason),
                token_id=event.token_id,
                reward=event.reward,
            )
            root.close(when)
        elif isinstance(event, ev.SessionCancelled):
            root.attributes[A.OUTCOME] = "cancelled"
            root.event(A.EVENT_CANCELLED, when, message=_text(event.message or ""))
            root.close(when)
    if root.end is None and root.attributes[A.OUTCOME] == "failed":
        root.close(_ns(recorded[-1].recorded_at))
    if root.attributes[A.OUTCOME] == "cancelled":
        root.error = None  # a cancellation is the caller's choice, not an error
    root.attributes[A.PLACEHOLDER] = placeholder
    root.attributes[A.ATTEMPT] = attempt_no
    if model is not None:
        root.attributes[A.MODEL] = model
    if any_call:
        root.attributes.update(
            {
                A.INPUT_TOKENS: tokens_in,
                A.OUTPUT_TOKENS: tokens_out,
                A.PHOENIX_TOKENS_PROMPT: tokens_in,
                A.PHOENIX_TOKENS_COMPLETION: tokens_out,
            }
        )
    shown_reward = event_reward if reward is ... else reward
    if shown_reward is not None:
        root.attributes[A.REWARD] = float(shown_reward)  # type: ignore[arg-type]
    end = root.end if root.end is not None else last
    for attempt in attempts:
        attempt.close(end)
    for call in calls.values():
        if call.span.end is None:  # started, never answered: the capture is incomplete
            call.span.error = "incomplete_capture: the call was started and never answered"
            call.span.close(end)
    root.close(end)

    scope = InstrumentationScope(_INSTRUMENTATION, schema_url=A.SCHEMA_URL)
    flags = TraceFlags(TraceFlags.SAMPLED)

    def context(span_id: int) -> Any:
        return SpanContext(trace, span_id, is_remote=False, trace_flags=flags)

    def readable(span: _Span, kind: Any) -> Any:
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
                sdk_trace.Event(name, attributes, timestamp)
                for name, attributes, timestamp in span.events
            ],
            kind=kind,
            status=status,
            start_time=span.start,
            end_time=span.end,
            instrumentation_scope=scope,
        )

    out = [readable(root, SpanKind.INTERNAL)]
    out.extend(readable(a, SpanKind.INTERNAL) for a in attempts)
    out.extend(readable(c.span, SpanKind.CLIENT) for c in calls.values())
    return out
