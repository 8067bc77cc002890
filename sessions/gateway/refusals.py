"""A request the gateway refuses: its HTTP status and an OpenAI-style JSON error body."""

from __future__ import annotations

from typing import Any

from sessions.errors import LedgerError

__all__ = ["Refusal", "error_body"]


def error_body(message: str, kind: str, code: str | int | None = None) -> dict[str, Any]:
    """The error as OpenAI's clients read it (`{"error": {"message", "type", "code"}}`)."""
    return {"error": {"message": message, "type": kind, "code": code}}


class Refusal(LedgerError):
    """Refuse the request with `status`; `kind` names the problem for a program, `message` for
    a person (what was wrong and what to do)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.status)
