"""A session's events as a readable timeline, and its state as of any log position."""

from __future__ import annotations

from typing import Any

from sessions import aggregate as agg
from sessions import events as ev
from sessions.errors import InvalidInput
from store import EventStore

__all__ = [
    "describe",
    "session_history",
]


def describe(event: ev.Event) -> str:
    """The key fields of one event, in a line."""
    if isinstance(event, ev.SessionCreated):
        step = "-" if event.global_step is None else event.global_step
        return (
            f"run={event.run} uid={event.uid} index={event.session_index}/{event.group_size} "
            f"{event.partition} step={step} source={event.data_source or '-'}"
        )
    if isinstance(event, ev.SessionStarted):
        return f"attempt={event.attempt or 1} timeout=" + (
            "-" if event.timeout_s is None else f"{event.timeout_s}s"
        )
    if isinstance(event, ev.TrajectoryRecorded) and not event.from_calls:
        trainable = (
            "?" if event.trainable_tokens is None else event.trainable_tokens
        )  # from the data: no decode
        return (
            f"#{event.index} prompt {event.prompt_len} + response {event.response_len} tokens "
            f"({trainable} trainable), {event.num_turns} turns"
            + (", logprobs" if event.has_logprobs else "")
        )
    if isinstance(event, ev.ModelCallStarted):
        return f"call {event.call_id} turn {event.turn}" + (
            "" if event.version is None else f" version={event.version}"
        )
    if isinstance(event, ev.ModelCallRecorded):
        versions = (
            "-"
            if event.min_version is None
            else str(event.min_version)
            if event.min_version == event.max_version
            else f"{event.min_version}..{event.max_version}"
        )
        return (
            f"call {event.call_id}: prompt +{event.prompt_len} (after {event.prompt_shared} "
            f"shared), response {event.response_len} tokens, finish={event.finish_reason or '-'}, "
            f"version={versions}"
            + ("" if event.latency_s is None else f", {event.latency_s * 1000:.0f} ms")
        )
    if isinstance(event, ev.ModelCallFailed):
        return f"call {event.call_id} failed: {event.error_type or ''} {event.message}".rstrip()
    if isinstance(event, ev.TrajectoryRecorded) and event.from_calls:
        return (
            f"#{event.index} assembled from calls {', '.join(event.from_calls)}: prompt "
            f"{event.prompt_len} + response {event.response_len} tokens "
            f"({event.trainable_tokens} trainable), {event.num_turns} turns"
        )
    if isinstance(event, ev.RewardPosted):
        info = ", ".join(f"{k}={v}" for k, v in sorted(event.info.items()))
        return f"reward={'absent' if event.reward is None else event.reward}" + (
            f" ({info})" if info else ""
        )
    if isinstance(event, ev.SessionSucceeded):
        return f"score={event.score} ({event.score_source}), rows {event.selected} [{event.trajectory_selection}]"
    if isinstance(event, ev.SessionFailed):
        return f"{event.reason}: {event.error_type or ''} {event.message} — placeholder {event.placeholder}, discarded {event.discarded_trajectories}"
    if isinstance(event, ev.PlaceholderEmitted):
        return f"token_id={event.token_id} reward={event.reward} for {event.reason}"
    if isinstance(event, ev.SessionCancelled):
        return event.message or ""
    return ""


async def session_history(
    store: EventStore, session_id: str, *, at_position: int | None = None
) -> tuple[list[dict[str, Any]], agg.SessionView]:
    stored = await store.read_stream(session_id, at_position=at_position)
    if not stored:
        if at_position is not None and await store.stream_version(session_id):
            raise InvalidInput(
                session_id, "--at", f"the session has no events at or before position {at_position}"
            )
        raise InvalidInput(session_id, "session_id", "no such session in this database")
    decoded = [ev.decode(s) for s in stored]
    view = agg.fold(session_id, (r.event for r in decoded))
    rows = [
        {
            "position": r.position,
            "version": r.version,
            "recorded_at": r.recorded_at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
            "type": r.type,
            "details": describe(r.event),
        }
        for r in decoded
    ]
    return rows, view
