"""What an event may hold: one declaration per event field, checked at append and at projection.

Each field names the read-model column its value flows into (`store.column_spec` derives the
type, integer range, length and encoding from the table definitions), plus what the domain adds
(a minimum, a set of choices, a forbidden character). The recorder checks every event against
it before the append — nothing is accepted that the projector cannot store — and the projector
checks every event of the log against it too, quarantining what an older or careless writer let
through (`sessions.projection.rules`). One declaration, so a column and its check cannot drift:
a field with choices is checked against its column too, so a choice the column cannot store is
refused at append, never accepted and then failed when the projector writes its row
(`tests/domain/test_storable.py` finds every field that flows into a bounded column by projecting
marked events, and checks that the field declares it).

Free text (error messages, tool output in `extra`, reward diagnostics) is never refused: NUL
characters and lone surrogates are escaped (`\\x00`, `\\udcff`) and over-long text is cut to the
column, so a failure can always be recorded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sessions import events as ev
from sessions.errors import InvalidInput
from sessions.failure_policy import METRIC_DECISIONS, RETRY_BUDGETS
from sessions.placeholder import DECISIONS
from sessions.vocabulary import MAX_NAME_LENGTH, ORIGINS, PARTITIONS, UID_FORBIDDEN
from store import ColumnSpec, column_spec

__all__ = [
    "DECLARATION",
    "Field",
    "clean_event",
    "clean_text",
    "problems",
    "session_id_problem",
    "storable_data",
]

#: The JSON-only integer fields' range (no column: the strictest backend's BIGINT).
_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)


@dataclass(frozen=True)
class Field:
    """One event field. `column`: the read-model column it is stored in (its spec decides type,
    range, length and encoding); without one, `kind` ("int", "float", "bool", "str", "json",
    "int_list", "str_list"), with `max_length` for text."""

    column: str | None = None
    kind: str | None = None
    nullable: bool | None = None
    minimum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[Any, ...] | None = None
    forbidden: str = ""
    free_text: bool = False
    int_range: tuple[int, int] | None = None
    max_length: int | None = None

    def spec(self) -> ColumnSpec:
        if self.column is not None:
            base = column_spec(self.column)
            if self.nullable is not None:
                base = dataclasses.replace(base, nullable=self.nullable)
            if self.int_range is not None:
                base = dataclasses.replace(base, int_range=self.int_range)
            return base
        kind = "json" if self.kind in ("int_list", "str_list") else self.kind
        assert kind is not None
        return ColumnSpec(
            f"({self.kind})",
            kind,
            bool(self.nullable),
            max_length=self.max_length,
            int_range=self.int_range or _INT64,
        )


#: A model call's id: a label, as long as the other ids.
_CALL_ID = Field(kind="str", minimum=1, max_length=MAX_NAME_LENGTH)
#: A weights version (verl's `global_steps`), unknown as None.
_VERSION = Field(kind="int", nullable=True, minimum=0)

#: Every field of every event type. Identity fields of SessionCreated are what a group and its
#: queue keys are made of (`IDENTITY`).
DECLARATION: dict[str, dict[str, Field]] = {
    "SessionCreated": {
        "run": Field("sessions.run", minimum=1),
        "uid": Field("sessions.uid", minimum=1, forbidden=UID_FORBIDDEN),
        "session_index": Field("sessions.session_index", minimum=0),
        "group_size": Field("sessions.group_size", minimum=1),
        "partition": Field("sessions.partition", choices=PARTITIONS),
        "global_step": Field("sessions.global_step", minimum=0),
        "data_source": Field("sessions.data_source", minimum=1),
        "runner": Field("sessions.runner", minimum=1),
        "sample_index": Field(kind="int", nullable=True, minimum=0),
        "metadata": Field(kind="json", free_text=True),
        "min_valid": Field("groups.min_valid", minimum=0),
        "launch": Field("sessions.launch", minimum=1),
    },
    "SessionStarted": {
        "attempt": Field(kind="int", nullable=True, minimum=1, int_range=_INT32),
        "timeout_s": Field(kind="float", nullable=True, minimum=0, exclusive_minimum=True),
    },
    "TrajectoryRecorded": {
        "index": Field(kind="int", minimum=0, int_range=_INT32),
        "num_turns": Field("queue_rows.num_turns", nullable=False, minimum=0),
        "prompt_len": Field("queue_rows.prompt_len", nullable=False, minimum=1),
        "response_len": Field("queue_rows.response_len", nullable=False, minimum=1),
        "has_logprobs": Field(kind="bool"),
        "trainable_tokens": Field(kind="int", nullable=True, minimum=0, int_range=_INT32),
        "materialization_reason": Field("queue_rows.materialization_reason"),
        "extra": Field(kind="json", free_text=True),
        "min_version": _VERSION,
        "max_version": _VERSION,
        "from_calls": Field(kind="str_list"),
    },
    "ModelCallStarted": {
        "call_id": _CALL_ID,
        "turn": Field(kind="int", minimum=0, int_range=_INT32),
        "sampling": Field(kind="json", free_text=True),
        "version": _VERSION,
    },
    "ModelCallRecorded": {
        "call_id": _CALL_ID,
        "prompt_shared": Field(kind="int", minimum=0, int_range=_INT32),
        "prompt_len": Field(kind="int", minimum=0, int_range=_INT32),
        "response_len": Field(kind="int", minimum=1, int_range=_INT32),
        "has_logprobs": Field(kind="bool"),
        "finish_reason": Field(kind="str", nullable=True, free_text=True, max_length=32),
        "min_version": _VERSION,
        "max_version": _VERSION,
        "latency_s": Field(kind="float", nullable=True, minimum=0),
        "server": Field(kind="str", nullable=True, free_text=True, max_length=MAX_NAME_LENGTH),
        "text": Field(kind="str", nullable=True, free_text=True),
    },
    "ModelCallFailed": {
        "call_id": _CALL_ID,
        "error_type": Field("sessions.error_type", free_text=True),
        "message": Field("sessions.message", nullable=False, free_text=True),
        "latency_s": Field(kind="float", nullable=True, minimum=0),
    },
    "RewardPosted": {
        "reward": Field("sessions.reward"),
        "info": Field(kind="json", free_text=True),
    },
    "SessionSucceeded": {
        "selected": Field(kind="int_list"),
        "trajectory_selection": Field(kind="json", choices=("all", "longest")),
        "score": Field("sessions.reward"),
        "score_source": Field(
            "sessions.score_source", choices=("reward_info", "external", "absent")
        ),
        "finished": Field(kind="bool"),
    },
    "SessionFailed": {
        "reason": Field("sessions.failure_reason", nullable=False, minimum=1),
        "error_type": Field("sessions.error_type", free_text=True),
        "message": Field("sessions.message", nullable=False, free_text=True),
        "discarded_trajectories": Field(kind="int", minimum=0, int_range=_INT32),
        "placeholder": Field(kind="json", choices=DECISIONS),
        "origin": Field("sessions.failure_origin", nullable=False, choices=ORIGINS),
        "metric": Field("sessions.metric_policy", nullable=False, choices=METRIC_DECISIONS),
        "selected": Field(kind="int_list"),
        "score": Field("sessions.reward"),
        "retry_refused": Field(
            kind="str", nullable=True, choices=(*RETRY_BUDGETS, None), max_length=32
        ),
    },
    "AttemptFailed": {
        "attempt": Field(kind="int", minimum=1, int_range=_INT32),
        "reason": Field("sessions.failure_reason", nullable=False, minimum=1),
        "origin": Field("sessions.failure_origin", nullable=False, choices=ORIGINS),
        "error_type": Field("sessions.error_type", free_text=True),
        "message": Field("sessions.message", nullable=False, free_text=True),
        "discarded_trajectories": Field(kind="int", minimum=0, int_range=_INT32),
        "retry_in_s": Field(kind="float", minimum=0),
    },
    "PlaceholderEmitted": {
        "reason": Field("queue_rows.failure_reason", nullable=False, minimum=1),
        "token_id": Field(kind="int", minimum=0, int_range=(0, 2**31 - 1)),
        "reward": Field("queue_rows.reward", nullable=False),
        "finished": Field(kind="bool"),
        "materialization_reason": Field("queue_rows.materialization_reason", nullable=False),
        "reward_info": Field(kind="json", free_text=True),
        "prompt_len": Field("queue_rows.prompt_len", nullable=False, minimum=1),
        "response_len": Field("queue_rows.response_len", nullable=False, minimum=1),
    },
    "SessionCancelled": {
        "message": Field("sessions.message", free_text=True),
    },
    "RunConfigured": {
        "digest": Field(kind="str"),
        "config": Field(kind="json"),
        "change": Field(kind="json", nullable=True),
    },
    "RunLaunched": {
        "launch": Field("events.session_id", nullable=False, minimum=1),
        "number": Field("sessions.launch", nullable=False, minimum=1),
        "resumed": Field(kind="bool"),
        "last_steps": Field(kind="json"),
    },
    "BreakerTripped": {
        "rule": Field(kind="str"),
        "tripped_at": Field(kind="int", minimum=1),
        "consecutive": Field(kind="int", minimum=0),
        "window_failures": Field(kind="int", minimum=0),
        "window_sessions": Field(kind="int", minimum=0),
        "by_reason": Field(kind="json"),
        "last_errors": Field(kind="json", free_text=True),
        "breaker": Field(kind="json"),
    },
    "PayloadsPruned": {
        "prune_id": Field(kind="str"),
        "partition": Field(kind="str"),
        "steps": Field(kind="int_list"),
        "events": Field(kind="int", minimum=0),
        "bytes": Field(kind="int", minimum=0),
        "digest": Field(kind="str"),
        "bound": Field(kind="json"),
    },
}
#: SessionCreated fields a session's read-model rows, group and queue keys are made of.
IDENTITY = ("run", "uid", "session_index", "group_size", "partition", "global_step")

_SESSION_ID = column_spec("events.session_id")
_ABSENT = object()


def _problem(name: str, field: Field, spec: ColumnSpec, value: Any) -> str | None:
    """Why `value` cannot be stored for this field (free text excepted: it is cleaned)."""
    if field.kind == "int_list":
        if not isinstance(value, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2**31 for i in value
        ):
            return f"must be a list of integers in [0, 2**31), got {value!r:.60}"
        return None
    if field.kind == "str_list":
        if not isinstance(value, list) or any(
            _CALL_ID.spec().problem(i) is not None or not i for i in value
        ):
            return f"must be a list of non-empty ids of at most {MAX_NAME_LENGTH} characters, got {value!r:.60}"
        return None
    if field.choices is not None and value not in field.choices:
        return f"must be one of {', '.join(map(repr, field.choices))}, got {value!r:.60}"
    if (
        field.kind == "json"
        and field.choices is None
        and value is not None
        and not isinstance(value, dict)
    ):
        return f"must be a mapping, got {type(value).__name__}"
    problem = spec.problem(value)
    if problem is not None or value is None:
        return problem
    if field.minimum is not None and not isinstance(value, str):
        low = field.minimum
        if value < low or (field.exclusive_minimum and value == low):
            return f"must be {'>' if field.exclusive_minimum else '>='} {low:g}, got {value!r}"
    if isinstance(value, str):
        if field.minimum is not None and len(value) < field.minimum:
            return "must not be empty"
        for char in field.forbidden:
            if char in value:
                return f"{value!r:.60} contains {char!r}; queue keys are {{uid}}_{{session_index}}_{{i}}, so use another separator"
    return None


def _fast_test(field: Field, spec: ColumnSpec, constants: dict[str, Any]) -> str:
    """A Python expression in `v`, true only for values certainly storable in this field: the
    common values (small ints, ASCII labels, finite floats, empty or plain dicts) pass without a
    function call, and everything else goes to the full check, which also words the problem."""

    def maybe_none(test: str) -> str:
        return f"(v is None or ({test}))" if spec.nullable else f"({test})"

    if field.kind == "int_list":
        return "(type(v) is list and all(type(i) is int and 0 <= i < 2147483648 for i in v))"
    if field.kind == "str_list":
        return (
            f"(type(v) is list and all(type(i) is str and 0 < len(i) <= {MAX_NAME_LENGTH} "
            "and i.isascii() and '\\x00' not in i for i in v))"
        )
    if field.choices is not None:  # None is in no set of choices
        name = f"choices_{len(constants)}"
        constants[name] = frozenset(  # a choice its column cannot store goes to the full check
            c for c in field.choices if isinstance(c, str) and spec.problem(c) is None
        )
        return f"(type(v) is str and v in {name})"
    if field.free_text and spec.kind == "json":
        return "(v is None or (type(v) is dict and (not v or plain(v))))"
    if spec.kind == "int":
        low, high = spec.int_range or (-(2**63), 2**63 - 1)
        if field.minimum is not None:
            low = max(low, math.ceil(field.minimum) + (1 if field.exclusive_minimum else 0))
        return maybe_none(f"type(v) is int and {low} <= v <= {high}")
    if spec.kind == "float":
        bound = ""
        if field.minimum is not None:
            bound = f" and v {'>' if field.exclusive_minimum else '>='} {float(field.minimum)!r}"
        return maybe_none(f"type(v) is float and isfinite(v){bound}")
    if spec.kind == "bool":
        return maybe_none("type(v) is bool")
    if spec.kind == "str":
        shortest = 0 if field.free_text else int(field.minimum or 0)
        longest = spec.max_length or 2**62
        forbidden = "".join(f" and {c!r} not in v" for c in field.forbidden)
        return maybe_none(
            f"type(v) is str and {shortest} <= len(v) <= {longest} and v.isascii() and '\\x00' not in v{forbidden}"
        )
    return "False"  # the rare rest (a run's configuration): always the full check


def _compile_fast(
    type_: str, checks: list[tuple[str, Field, ColumnSpec]]
) -> Callable[[Mapping[str, Any]], bool]:
    """One function per event type that tests every field's `_fast_test` inline: the check the
    projector runs on every event of a replay, so it costs about one call per event."""
    constants: dict[str, Any] = {"ABSENT": _ABSENT, "plain": _plain, "isfinite": math.isfinite}
    lines = [f"def fast_{type_}(d):", "    get = d.get"]
    for name, field, spec in checks:
        lines.append(f"    v = get({name!r}, ABSENT)")
        lines.append(
            f"    if v is not ABSENT and not {_fast_test(field, spec, constants)}: return False"
        )
    lines.append("    return True")
    exec("\n".join(lines), constants)  # noqa: S102 - source built above from the declaration alone
    return constants[f"fast_{type_}"]  # type: ignore[no-any-return]


def _plain(value: Any) -> bool:
    """A JSON value of ASCII strings without NUL, ints, finite floats, bools and None only."""
    kind = type(value)
    if kind is str:
        return value.isascii() and "\x00" not in value
    if kind is int or kind is bool or value is None:
        return True
    if kind is float:
        return math.isfinite(value)
    if kind is dict:
        return all(
            type(k) is str and k.isascii() and "\x00" not in k and _plain(v)
            for k, v in value.items()
        )
    if kind is list:
        return all(_plain(v) for v in value)
    return False


_Checks = list[tuple[str, Field, ColumnSpec]]
_CHECKS: dict[str, _Checks] = {
    type_: [(name, field, field.spec()) for name, field in fields.items()]
    for type_, fields in DECLARATION.items()
}
_FAST: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    type_: _compile_fast(type_, checks) for type_, checks in _CHECKS.items()
}
assert set(ev.EVENT_TYPES) == set(DECLARATION), "every event type needs its fields declared"


def _cross_check(type_: str, data: Mapping[str, Any]) -> tuple[str, str] | None:
    """What one field cannot say alone: a session's index lies inside its group."""
    if type_ == "SessionCreated":
        index, size = data.get("session_index"), data.get("group_size")
        if index is not None and size is not None and index >= size:
            return ("session_index", f"must be in [0, group_size={size}), got {index}")
    return None


def clean_text(value: str, limit: int | None = None) -> str:
    """Free text made storable: NUL and lone surrogates escaped, then cut to `limit` characters."""
    if "\x00" in value:
        value = value.replace("\x00", "\\x00")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value if limit is None or len(value) <= limit else value[:limit]


def _clean_json(value: Any) -> Any:
    """A JSON value with every string (keys too) made storable; non-finite floats become None."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {
            clean_text(str(k)) if not isinstance(k, str) else clean_text(k): _clean_json(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_clean_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _clean(field: Field, spec: ColumnSpec, value: Any) -> Any:
    if value is None:
        return None
    if spec.kind == "json":
        return _clean_json(value) if isinstance(value, (dict, list)) else value
    if isinstance(value, str):
        return clean_text(value, spec.max_length)
    return value


def problems(type_: str, data: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """`data` with its free text cleaned, and every field that still cannot be stored: (field, why).

    A field missing from `data` takes its event class's default (the decoder has already refused
    data that lacks a required field)."""
    if _FAST[type_](data):
        cross = _cross_check(type_, data)
        return data, ([cross] if cross else [])  # type: ignore[return-value]
    cleaned: dict[str, Any] | None = None
    found: list[tuple[str, str]] = []
    for name, field, spec in _CHECKS[type_]:
        value = data.get(name, _ABSENT)
        if value is _ABSENT:
            continue
        if field.free_text:
            if spec.kind == "str" and value is not None and not isinstance(value, str):
                found.append((name, f"must be a string or None, got {type(value).__name__}"))
                continue
            fixed = _clean(field, spec, value)
            if fixed is not value and fixed != value:
                if cleaned is None:
                    cleaned = dict(data)
                cleaned[name] = fixed
                value = fixed
            if spec.kind == "json" and value is not None and not isinstance(value, dict):
                found.append((name, f"must be a mapping, got {type(value).__name__}"))
            elif spec.kind == "json":
                problem = spec.problem(value)
                if problem is not None:
                    found.append((name, problem))
            continue
        problem = _problem(name, field, spec, value)
        if problem is not None:
            found.append((name, problem))
    if not found:
        cross = _cross_check(type_, data)
        if cross:
            found.append(cross)
    return (cleaned if cleaned is not None else data), found  # type: ignore[return-value]


def _python_scalar(value: Any) -> Any:
    """A numpy integer, float or bool as its Python equivalent; anything else unchanged."""
    if isinstance(value, np.generic) and not isinstance(value, (np.str_, np.bytes_)):
        return value.item()
    return value


def session_id_problem(session_id: Any) -> str | None:
    if not isinstance(session_id, str) or not session_id:
        return f"must be a non-empty string, got {session_id!r:.60}"
    return _SESSION_ID.problem(session_id)


def clean_event(session_id: str, event: ev.Event) -> ev.Event:
    """The event with its free text made storable; `InvalidInput` naming the first field that
    cannot be stored (nothing is written)."""
    return clean_event_data(session_id, event)[0]


def clean_event_data(session_id: str, event: ev.Event) -> tuple[ev.Event, dict[str, Any]]:
    """`clean_event`, and the returned event's `to_data()`, which the check has built already
    (the recorder's envelope reuses it instead of building it again)."""
    problem = session_id_problem(session_id)
    if problem is not None:
        raise InvalidInput(None, "session_id", problem)
    return storable_data(session_id, event)


def storable_data(session_id: str, event: ev.Event) -> tuple[ev.Event, dict[str, Any]]:
    """`clean_event_data` for a session id already checked (`session_id_problem`): the
    recorder checks it once per command, not once per event."""
    data = event.to_data()
    if _FAST[event.TYPE](
        data
    ):  # the usual case: every field plain (no numpy scalar) and storable as it is
        cross = _cross_check(event.TYPE, data)
        if cross is None:
            return event, data
        raise InvalidInput(session_id, *cross)
    plain = {name: _python_scalar(value) for name, value in data.items()}
    if any(plain[name] is not data[name] for name in data):
        data = plain  # numpy scalars as the Python numbers they stand for, in every field alike
        event = dataclasses.replace(event, **{k: v for k, v in plain.items() if k != "payload"})
    cleaned, found = problems(event.TYPE, data)
    if found:
        name, why = found[0]
        raise InvalidInput(session_id, name, why)
    if cleaned is data:
        return event, data
    changed = {name: value for name, value in cleaned.items() if value is not data.get(name)}
    return dataclasses.replace(event, **changed), cleaned
