"""Trace and span ids derived from what they stand for, so exporting a session twice sends the
same ids and a viewer that keys spans on them shows the session once (docs/otel.md).

OpenTelemetry ids are random by default; here each is the leading bytes of a SHA-256 over a
tag and the session's own keys (session id, attempt, call id), each prefixed by its length so no
two different keys hash the same bytes. An all-zero id is invalid in OpenTelemetry; the chance of one is 2^-64 per span,
and it is mapped to 1 rather than left to a viewer to reject.
"""

from __future__ import annotations

import hashlib

__all__ = ["attempt_span_id", "call_span_id", "session_span_id", "trace_id"]


def _digest(*parts: str) -> bytes:
    hasher = hashlib.sha256()
    for part in parts:
        raw = part.encode("utf-8", "surrogatepass")
        hasher.update(len(raw).to_bytes(8, "big"))
        hasher.update(raw)
    return hasher.digest()


def _nonzero(value: int) -> int:
    return value or 1


def trace_id(session_id: str) -> int:
    """The 128-bit trace id of a session: one trace per session."""
    return _nonzero(int.from_bytes(_digest("rollout-ledger/trace", session_id)[:16], "big"))


def session_span_id(session_id: str) -> int:
    """The 64-bit id of the session's root span."""
    return _nonzero(int.from_bytes(_digest("rollout-ledger/session", session_id)[:8], "big"))


def attempt_span_id(session_id: str, attempt: int) -> int:
    """The 64-bit id of one attempt's span (attempts count from 1)."""
    return _nonzero(
        int.from_bytes(_digest("rollout-ledger/attempt", session_id, str(attempt))[:8], "big")
    )


def call_span_id(session_id: str, attempt: int, call_id: str) -> int:
    """The 64-bit id of one model call's span: call ids are unique within an attempt (§15)."""
    return _nonzero(
        int.from_bytes(_digest("rollout-ledger/call", session_id, str(attempt), call_id)[:8], "big")
    )
