"""What a runner raises to fail its session, and what any exception it raises is recorded as.

A runner names its failure by raising `RolloutFailure(reason=..., origin=...)` (or `SandboxError`
and `ServerConnectionError`, `infra` failures); the reason and origin are checked where it is raised, against the rules of
`sessions.vocabulary`. Whatever else a runner raises, `recorded_failure` turns it into a reason
and origin the log can store, with the error's text and type, and never raises itself — so any
error can end its session (docs/design.md §4). A server that could not be reached (a refused or
dropped connection, a client's transport timeout, an HTTP 5xx) is `connection_error`, an `infra`
reason the default retry policy retries (`is_connection_error`, docs/failures.md). Here, not in `sessions.errors`: the errors module
sits below the vocabulary and imports nothing of `sessions`, while this one checks names with it.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from typing import Any

from sessions import events as ev
from sessions import vocabulary
from sessions.errors import InvalidArgument, InvalidInput, LedgerError
from sessions.vocabulary import (
    CONNECTION_ERROR,
    INFRA,
    INVALID_OUTPUT,
    RUNNER_ERROR,
    SANDBOX_ERROR,
    TIMEOUT,
)

__all__ = [
    "RecordedFailure",
    "RolloutFailure",
    "SandboxError",
    "ServerConnectionError",
    "error_text",
    "failure_origin",
    "failure_reason",
    "is_connection_error",
    "recorded_failure",
    "type_name",
]


class RolloutFailure(LedgerError):
    """Raise from a runner to fail its session with an explicit failure reason, built-in or your
    own (lowercase, e.g. `"tool_quota"`), and optionally its origin: `"infra"` (the model cannot
    have caused it) or `"policy"`. Without an origin the ledger's metric policy, then the
    defaults, decide (a custom reason nobody declared is `policy`).

    The reason is checked here, at the raise site (docs/design.md §4): a malformed one, one over 32
    characters, a reserved one (`infra`, `policy`, `*`, `unprojectable`) or `orphaned` (the
    recovery sweep's) raises `InvalidInput` naming `reason`, with this failure's message kept in
    its text. Should a subclass bypass this check, `run_session` still records the failure, as
    `runner_error` (`recorded_failure`)."""

    reason = RUNNER_ERROR
    origin: str | None = None

    def __init__(
        self, message: str = "", *, reason: str | None = None, origin: str | None = None
    ) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        try:
            vocabulary.check_runner_reason(self.reason)  # at the raise site, not at the failure
        except InvalidInput as refused:  # the failure it was to record is named, not lost
            shown = f"{message!r:.200}" if isinstance(message, str) else type(message).__name__
            refused.args = (f"{refused.args[0]} (raising RolloutFailure({shown}))",)
            raise
        if origin is not None:
            problem = vocabulary.origin_problem(origin)
            if problem is not None:
                raise InvalidArgument(f"RolloutFailure: origin {problem}", argument="origin")
            self.origin = origin


class SandboxError(RolloutFailure):
    """The tool/sandbox environment failed (infrastructure, not the policy): reason `sandbox_error`."""

    reason = SANDBOX_ERROR
    origin = INFRA


class ServerConnectionError(RolloutFailure):
    """A server the runner calls (the LLM server, a tool's service) could not be reached, dropped
    the connection, timed out in transport or answered 5xx / 429: reason `connection_error`, origin
    `infra`, so the default `RetryPolicy(on=("infra",))` retries it. The client errors of the
    usual libraries are recorded so without it (`is_connection_error`); raise it for one they miss.
    """

    reason = CONNECTION_ERROR
    origin = INFRA


#: Transport errors of the clients a runner talks to its servers with, as (module, attribute
#: path): the LLM server and tools over HTTP (aiohttp, httpx, requests, urllib3, openai's SDK) and
#: verl's rollout servers, which are Ray actors (an actor that died or cannot be reached). Read
#: only from modules already imported: an error of a library is raised only once it is loaded.
_TRANSPORT_ERRORS: tuple[tuple[str, str], ...] = (
    ("aiohttp", "ClientConnectionError"),  # refused, reset, disconnected, ServerTimeoutError
    ("httpx", "TransportError"),  # ConnectError, ReadTimeout, RemoteProtocolError, ...
    ("requests", "exceptions.ConnectionError"),
    ("requests", "exceptions.Timeout"),
    ("urllib3", "exceptions.ProtocolError"),
    ("urllib3", "exceptions.NewConnectionError"),
    ("urllib3", "exceptions.TimeoutError"),
    ("openai", "APIConnectionError"),  # and APITimeoutError
    ("ray", "exceptions.RayActorError"),  # ActorDiedError, ActorUnavailableError
)
#: HTTP client errors that carry a status, with where each keeps it: a 5xx, 408 or 429 answer is
#: the server's state, not the request's (a 4xx other than those is the runner's request).
_HTTP_STATUS_ERRORS: tuple[tuple[str, str, str], ...] = (
    ("aiohttp", "ClientResponseError", "status"),
    ("httpx", "HTTPStatusError", "response.status_code"),
    ("requests", "exceptions.HTTPError", "response.status_code"),
    ("openai", "APIStatusError", "status_code"),
)
_SERVER_SIDE_STATUS = frozenset({408, 429})


def _loaded(module: str, path: str) -> Any:
    """`module.path` when `module` is imported and has it, else None (never imports anything)."""
    value: Any = sys.modules.get(module)
    for part in path.split("."):
        if value is None:
            return None
        value = getattr(value, part, None)
    return value if isinstance(value, type) else None


def _status(error: BaseException, path: str) -> Any:
    value: Any = error
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def is_connection_error(error: BaseException) -> bool:
    """Whether `error` says a server the runner calls was unreachable or failed in transport:
    Python's `ConnectionError` (refused, reset, aborted, broken pipe), a transport error of the
    HTTP clients runners use (`_TRANSPORT_ERRORS`; their timeouts too), an HTTP answer 5xx, 408 or
    429, or an error raised `from` one of these. A plain `TimeoutError` is not: it is the
    session's own `timeout`. Never raises."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        try:
            if _one_connection_error(current):
                return True
        except Exception:  # noqa: BLE001 - an odd error object is simply not a connection error
            return False
        cause = getattr(current, "__cause__", None)  # anything may be raised at us, not only errors
        current = cause if isinstance(cause, BaseException) else None
    return False


def _one_connection_error(error: BaseException) -> bool:
    if isinstance(error, ConnectionError):
        return True
    for module, path in _TRANSPORT_ERRORS:
        kind = _loaded(module, path)
        if kind is not None and isinstance(error, kind):
            return True
    for module, path, where in _HTTP_STATUS_ERRORS:
        kind = _loaded(module, path)
        if kind is not None and isinstance(error, kind):
            status = _status(error, where)
            if isinstance(status, int) and (status >= 500 or status in _SERVER_SIDE_STATUS):
                return True
    return False


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
        if problem is None and declared is not None and vocabulary.origin_problem(declared):
            problem = f"{_shown(declared)} is not one of {', '.join(vocabulary.ORIGINS)}"
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
        return RUNNER_ERROR  # unless its own reason can be recorded (see recorded_failure)
    if is_connection_error(error):  # before TimeoutError: a client's transport timeout is one too
        return CONNECTION_ERROR
    if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        return TIMEOUT
    if isinstance(error, InvalidInput) and _declared(error, "session_id")[0] is not None:
        return INVALID_OUTPUT  # a command of the session was refused: its tokens, mask, reward
    return RUNNER_ERROR  # an InvalidInput naming no session refused a name, not the output


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
