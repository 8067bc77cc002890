"""The ledger's vocabulary, declared once: partitions, failure reasons and what a name may be.

Every name a caller hands the ledger — a partition, a run, a session id, a uid, a data source, a
failure reason — follows one rule written here (docs/design.md §2), and every entry point that
takes the name calls that rule: `create_session`, a runner's `RolloutFailure` and `fail`, the
policies, `QueueConsumer`, `export_dataset`, `batch` and the metrics. So a name is accepted or
refused the same way wherever it is given, always with `InvalidInput` naming the field, what was
wrong and what to do. Pure Python: no torch, no SQL, nothing but `errors` below it (the CLI
builds its parser from it without loading the rest of the library).
"""

from __future__ import annotations

import re
from typing import Literal

from sessions.errors import InvalidInput

__all__ = [
    "ALL_SOURCES",
    "CONNECTION_ERROR",
    "EMPTY_OUTPUT",
    "FAILURE_REASONS",
    "FINALIZE_ERROR",
    "INCOMPLETE_CAPTURE",
    "INVALID_OUTPUT",
    "RUN_STREAM_PREFIX",
    "RUNNER_ERROR",
    "SANDBOX_ERROR",
    "TIMEOUT",
    "ANY",
    "INFRA",
    "MAX_NAME_LENGTH",
    "MAX_REASON_LENGTH",
    "ORIGINS",
    "ORPHANED",
    "Origin",
    "PARTITIONS",
    "POLICY",
    "UID_FORBIDDEN",
    "UNPROJECTABLE",
    "check_data_source",
    "check_label",
    "check_partition",
    "check_reason",
    "check_run",
    "check_runner_reason",
    "check_session_id",
    "check_uid",
    "origin_problem",
    "reason_problem",
]

#: The built-in failure reasons, one name each (docs/design.md §4); `sessions.failure_policy`
#: gives each its origin.
RUNNER_ERROR = "runner_error"  # the runner raised
TIMEOUT = "timeout"
SANDBOX_ERROR = "sandbox_error"  # a `SandboxError`
EMPTY_OUTPUT = "empty_output"  # `complete` without a trajectory
FINALIZE_ERROR = "finalize_error"
INVALID_OUTPUT = "invalid_output"  # the runner's tokens, mask or reward were refused
CONNECTION_ERROR = "connection_error"  # a server the runner calls (the LLM's) was unreachable
#: The built-in reason the recovery sweep fails a session left open by a dead process with.
ORPHANED = "orphaned"
#: The built-in reason a session ends with when it completes with a model call whose intent has
#: no record (fail closed: never a silently short row, docs/design.md §15).
INCOMPLETE_CAPTURE = "incomplete_capture"
FAILURE_REASONS = (
    RUNNER_ERROR,
    TIMEOUT,
    SANDBOX_ERROR,
    EMPTY_OUTPUT,
    FINALIZE_ERROR,
    INVALID_OUTPUT,
    CONNECTION_ERROR,
    ORPHANED,
    INCOMPLETE_CAPTURE,
)
#: The stream a run's configuration fingerprints are recorded in: `@run:<run>` (a session id may
#: not start with `@run:`).
RUN_STREAM_PREFIX = "@run:"

#: The two queues every session belongs to: what it trains on and what it is measured on.
PARTITIONS: tuple[str, ...] = ("train", "val")
#: In a policy's rules, the key that matches any partition or any reason.
ANY = "*"

Origin = Literal["infra", "policy"]
INFRA: Origin = "infra"
POLICY: Origin = "policy"
#: Who caused a failure (`docs/failures.md`); policy rules match them beside reasons.
ORIGINS: tuple[Origin, ...] = (INFRA, POLICY)

#: The reason the projector gives a session whose events it cannot project (docs/design.md §7).
UNPROJECTABLE = "unprojectable"
#: Names no failure may take: rules match the origins and `*` as keys, and the projector's own.
_RESERVED_REASONS = frozenset({*ORIGINS, ANY, UNPROJECTABLE})
#: Built-in reasons only the ledger records: a runner that raised one would pass for the sweep.
_SWEEP_REASONS = frozenset({ORPHANED, INCOMPLETE_CAPTURE})
#: `sessions.failure_reason` is VARCHAR(32); a reason is also a metric name part (`failed/<reason>`).
MAX_REASON_LENGTH = 32
_REASON = re.compile(rf"[a-z][a-z0-9_]{{0,{MAX_REASON_LENGTH - 1}}}")

#: Ids and labels (session id, run, uid, data source, runner) are VARCHAR(128) in every table.
MAX_NAME_LENGTH = 128
#: Queue keys are `{uid}_{session_index}_{i}` and verl splits them on `_`, so a uid has none.
UID_FORBIDDEN = "_"

#: How the all-data-sources figures are spelt in a tracker's keys (`ledger/<partition>/all/...`).
ALL_SOURCES = "all"
#: Data source names a metric key already spells: a source of that name would overwrite them.
_RESERVED_DATA_SOURCES = frozenset({ALL_SOURCES})


# ------------------------------------------------------------------ names
def _name_problem(value: object) -> str | None:
    """Why `value` cannot be an id or a label (None when it can): every table stores it as text."""
    if not isinstance(value, str):
        return (
            f"must be a non-empty string of at most {MAX_NAME_LENGTH} characters, "
            f"got {type(value).__name__} {value!r:.60}"
        )
    if not value:
        return f"must be a non-empty string of at most {MAX_NAME_LENGTH} characters, got ''"
    if len(value) > MAX_NAME_LENGTH:
        return f"{value[:20]!r}… is {len(value)} characters; at most {MAX_NAME_LENGTH}"
    if "\x00" in value:
        return f"{value!r:.60} contains NUL, which no database stores in text; remove it"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{value!r:.60} holds a lone surrogate, which is not text; fix its decoding"
    return None


def _refuse(session_id: str | None, field: str, problem: str | None) -> None:
    if problem is not None:
        raise InvalidInput(session_id, field, problem)


def check_run(run: object, *, session_id: str | None = None, field: str = "run") -> str:
    """A run name; an empty one is refused everywhere (it never means "the latest run")."""
    _refuse(session_id, field, _name_problem(run))
    return run  # type: ignore[return-value]


def check_session_id(session_id: object, *, field: str = "session_id") -> str:
    """A session id; `@run:…` names a run's configuration stream, so no session may take it."""
    _refuse(None, field, _name_problem(session_id))
    assert isinstance(session_id, str)
    if session_id.startswith(RUN_STREAM_PREFIX):
        raise InvalidInput(
            None,
            field,
            f"{session_id!r:.60} starts with {RUN_STREAM_PREFIX!r}, which names a run's "
            "configuration stream; use another session id",
        )
    return session_id


def check_uid(uid: object, *, session_id: str | None = None, field: str = "uid") -> str:
    """A group's uid (the prompt's id): a name without `_`."""
    _refuse(session_id, field, _name_problem(uid))
    assert isinstance(uid, str)
    if UID_FORBIDDEN in uid:
        raise InvalidInput(
            session_id,
            field,
            f"{uid!r:.60} contains {UID_FORBIDDEN!r}; queue keys are {{uid}}_{{session_index}}_{{i}}, "
            "so use another separator",
        )
    return uid


def check_label(value: object, field: str, *, session_id: str | None = None) -> str | None:
    """An optional short label (a runner's name): None or a name."""
    if value is None:
        return None
    problem = _name_problem(value)
    if problem is not None:
        raise InvalidInput(session_id, field, f"must be None or a name: {problem}")
    return value  # type: ignore[return-value]


def check_data_source(
    value: object, *, session_id: str | None = None, field: str = "data_source"
) -> str | None:
    """A data source: None (none given) or a name the metric keys do not already spell."""
    check_label(value, field, session_id=session_id)
    if value in _RESERVED_DATA_SOURCES:
        raise InvalidInput(
            session_id,
            field,
            f"{value!r} is reserved: the metrics spell the figures over all data sources "
            f"`ledger/<partition>/{ALL_SOURCES}/<metric>`, which a source of that name would "
            "overwrite; name the data source otherwise",
        )
    return value  # type: ignore[return-value]


def check_partition(
    partition: object,
    *,
    session_id: str | None = None,
    field: str = "partition",
    also: tuple[str, ...] = (),
) -> str:
    """One of `PARTITIONS`, spelt exactly; `also` names what the field accepts beside them (a
    policy's rules also take `*`)."""
    if not isinstance(partition, str) or partition not in (*PARTITIONS, *also):
        raise InvalidInput(
            session_id,
            field,
            f"{partition!r:.60} is not a partition; use "
            f"{' or '.join(map(repr, (*PARTITIONS, *also)))}",
        )
    return partition


# ---------------------------------------------------------------- reasons
def reason_problem(reason: object, *, runner: bool = False) -> str | None:
    """Why `reason` cannot name a failure (None when it can): a built-in reason, or a custom
    lowercase name that is not reserved. `runner`: as a runner gives it, which may not take a
    reason only the ledger records (`_SWEEP_REASONS`)."""
    if not isinstance(reason, str):
        return f"a failure reason is a string, got {type(reason).__name__} {reason!r:.60}"
    if runner and reason in _SWEEP_REASONS:
        return (
            f"{reason!r} is recorded by the recovery sweep only; give your failure its own reason"
        )
    if reason in FAILURE_REASONS:
        return None
    if reason in _RESERVED_REASONS:
        return (
            f"{reason!r} is reserved (the origins 'infra'/'policy', '*' and the projector's "
            f"{UNPROJECTABLE!r})"
        )
    if not _REASON.fullmatch(reason):
        return (
            f"{reason!r:.60} is not a reason name: use lowercase letters, digits and '_', starting "
            f"with a letter, at most {MAX_REASON_LENGTH} characters"
        )
    return None


def origin_problem(origin: object) -> str | None:
    """Why `origin` cannot say who caused a failure (None when it can): one of `ORIGINS`."""
    if isinstance(origin, str) and origin in ORIGINS:
        return None
    return f"{origin!r:.60} is not an origin; use {' or '.join(map(repr, ORIGINS))}"


def check_reason(
    reason: object,
    *,
    session_id: str | None = None,
    field: str = "reason",
    also: tuple[str, ...] = (),
) -> str:
    """A failure reason as the ledger records it; `also` names what the field accepts beside a
    reason (a policy's rules also take the origins and `*`)."""
    if isinstance(reason, str) and reason in also:
        return reason
    problem = reason_problem(reason)
    if problem is not None:
        hint = f"; or use {', '.join(map(repr, also))}" if also else ""
        raise InvalidInput(
            session_id, field, f"{problem}{hint}; built-in reasons: {', '.join(FAILURE_REASONS)}"
        )
    return reason  # type: ignore[return-value]


def check_runner_reason(reason: object, *, field: str = "reason") -> str:
    """A failure reason as a runner gives it (`RolloutFailure(reason=...)`): any reason the ledger
    records but the sweep's own."""
    problem = reason_problem(reason, runner=True)
    if problem is not None:
        ours = ", ".join(r for r in FAILURE_REASONS if r not in _SWEEP_REASONS)
        raise InvalidInput(None, field, f"{problem}; built-in reasons: {ours}")
    return reason  # type: ignore[return-value]
