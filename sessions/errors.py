"""Errors a user of the ledger sees. Each message names what was wrong and what to do."""

from __future__ import annotations

from store import ConcurrencyError, LedgerError, SchemaError, StoreError

__all__ = [
    "ConcurrencyError",
    "InvalidInput",
    "InvalidTransition",
    "LedgerError",
    "ProjectionError",
    "RolloutFailure",
    "SandboxError",
    "SchemaError",
    "StoreError",
    "UnknownEventError",
]


class InvalidTransition(LedgerError):
    """A command that the session's current state does not allow; nothing was appended."""

    def __init__(
        self, session_id: str, state: str, command: str, allowed: list[str] | None = None
    ) -> None:
        hint = (
            f" (allowed in {state!r}: {', '.join(allowed)})"
            if allowed
            else " (the session is terminal)"
        )
        super().__init__(f"session {session_id!r} is {state!r}: cannot {command}{hint}")
        self.session_id = session_id
        self.state = state
        self.command = command


class InvalidInput(LedgerError, ValueError):
    """Bad input from the caller (token ids, masks, rewards, identifiers); nothing was written."""

    def __init__(self, session_id: str | None, field: str, problem: str) -> None:
        where = f"session {session_id!r}: " if session_id else ""
        super().__init__(f"{where}{field}: {problem}")
        self.session_id = session_id
        self.field = field


class RolloutFailure(LedgerError):
    """Raise from a runner to fail its session with an explicit failure reason, built-in or your
    own (lowercase, e.g. `"tool_quota"`), and optionally its origin: `"infra"` (the model cannot
    have caused it) or `"policy"`. Without an origin the ledger's metric policy, then the
    defaults, decide (a custom reason nobody declared is `policy`)."""

    reason = "runner_error"
    origin: str | None = None

    def __init__(
        self, message: str = "", *, reason: str | None = None, origin: str | None = None
    ) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        if origin is not None:
            if origin not in ("infra", "policy"):
                raise ValueError(
                    f"RolloutFailure: origin must be 'infra' or 'policy', got {origin!r}"
                )
            self.origin = origin


class SandboxError(RolloutFailure):
    """The tool/sandbox environment failed (infrastructure, not the policy): reason `sandbox_error`."""

    reason = "sandbox_error"
    origin = "infra"


class UnknownEventError(StoreError):
    """The log holds an event type or schema version this library cannot read."""


class ProjectionError(LedgerError, RuntimeError):
    """The read models and the log disagree, so rows cannot be built from them (a queue row that
    points at a missing event: the database was altered outside the library). The projector
    itself never raises it for an event it cannot project: it quarantines that event (docs/design.md §7)."""
