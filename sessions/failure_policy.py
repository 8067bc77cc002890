"""What a failure means: its origin (infra or policy), how metrics count it, and when it is retried.

Each decision is taken when the session fails (or an attempt does) and written into that event
(`SessionFailed.origin` / `.metric`, `AttemptFailed`), so a replay reads the decision from the log
and never consults today's configuration. `docs/decisions.md` says why the defaults are what they are.

- **Origin.** `infra`: the model cannot have caused it (the sandbox died, the verifier crashed, the
  host went away): evaluation harnesses leave these out of headline figures and trainers retry
  them. `policy`: the model's own doing, or possibly so (a timeout, an empty or invalid answer, a
  runner exception, which is often a malformed tool call): it stays a zero, so a policy cannot
  learn to escape a penalty by failing. A reason nobody declared is `policy`.
- **Metric policy**, per partition and reason (or origin): `zero` (the default: a failure is a
  zero in the reward means) or `exclude` (left out of `reward/mean` and `reward/mean@k`, counted
  under `excluded/<reason>` and in coverage). `reward/mean_default_rule` is reported always.
- **Retry policy**: which reasons start another attempt of the same session, how many attempts in
  all, and how long to wait between them.
- **What a runner's exception is recorded as** (`recorded_failure`): a reason and origin the log
  can store, whatever the exception is, so any error can end its session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sessions import events as ev
from sessions import vocabulary
from sessions.errors import ConfigError, InvalidInput, RolloutFailure
from sessions.events import DEFAULT_ORIGINS as _DEFAULT_ORIGINS
from sessions.events import FAILURE_REASONS
from sessions.vocabulary import ANY, INFRA, ORIGINS, POLICY, Origin

__all__ = [
    "DEFAULT_ORIGINS",
    "MetricDecision",
    "MetricPolicy",
    "RetryPolicy",
    "check_rules",
    "match",
    "origin_of",
]

MetricDecision = Literal["zero", "exclude"]

#: The built-in reasons' origins. `runner_error` is `policy`: a runner's exception is as often the
#: model's malformed tool call as the harness's bug, and a policy must not escape a zero by it;
#: a runner that knows better raises `SandboxError` or `RolloutFailure(origin="infra")`.
DEFAULT_ORIGINS: Mapping[str, Origin] = _DEFAULT_ORIGINS  # type: ignore[assignment]
assert set(DEFAULT_ORIGINS) == set(FAILURE_REASONS)


def origin_of(
    reason: str, overrides: Mapping[str, Origin] | None = None, declared: Origin | None = None
) -> Origin:
    """A reason's origin: what the runner declared for it, else the ledger's override, else the
    default; a reason nobody declared is `policy` (a zero, never excused)."""
    if declared is not None:
        return declared
    if not isinstance(reason, str):
        return POLICY  # no reason at all: the command's own check refuses it, naming the field
    if overrides and reason in overrides:
        return overrides[reason]
    return DEFAULT_ORIGINS.get(reason, POLICY)


def match(
    rules: Mapping[str, Mapping[str, Any]], partition: str, reason: str, origin: str, default: Any
) -> Any:
    """The rule for (partition, reason): the partition's own rules before `*`'s, and within them
    the reason before its origin before `*`."""
    for p in (partition, ANY):
        by_key = rules.get(p)
        if by_key:
            for key in (reason, origin, ANY):
                if key in by_key:
                    return by_key[key]
    return default


def check_rules(
    kind: str, rules: Mapping[str, Mapping[str, Any]], choices: Collection[str]
) -> None:
    """Refuse a rule table with an unknown partition, reason or decision, naming the bad entry."""
    _check_mapping(kind, "rules", rules)
    for partition, by_key in rules.items():
        vocabulary.check_partition(partition, field=f"{kind}: rules", also=(ANY,))
        _check_mapping(kind, f"rules[{partition!r}]", by_key)
        for key, decision in by_key.items():
            vocabulary.check_reason(
                key, field=f"{kind}: rules[{partition!r}]", also=(*ORIGINS, ANY)
            )
            if not isinstance(decision, str) or decision not in choices:
                raise ConfigError(
                    f"{kind}: rules[{partition!r}][{key!r}] is {decision!r}; use {' or '.join(map(repr, choices))}"
                )


def _check_mapping(kind: str, name: str, value: object) -> None:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{kind}: {name} must be a dict, got {type(value).__name__} {value!r}", argument=name
        )


@dataclass(frozen=True)
class MetricPolicy:
    """`rules[partition][reason or origin]` -> `zero` / `exclude`; `*` matches any.

    `origins` overrides (or adds) reasons' origins, e.g. `{"runner_error": "infra"}` for a harness
    whose exceptions are never the model's. Example, infrastructure failures out of validation::

        MetricPolicy(rules={"val": {"infra": "exclude"}})
    """

    default: MetricDecision = "zero"
    rules: Mapping[str, Mapping[str, MetricDecision]] = field(default_factory=dict)
    origins: Mapping[str, Origin] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.default, str) or self.default not in ("zero", "exclude"):
            raise ConfigError(
                f"metric policy: default is {self.default!r}; use 'zero' or 'exclude'"
            )
        check_rules("metric policy", self.rules, ("zero", "exclude"))
        _check_mapping("metric policy", "origins", self.origins)
        for reason, origin in self.origins.items():
            vocabulary.check_reason(reason, field="metric policy: origins")
            if not isinstance(origin, str) or origin not in ORIGINS:
                raise ConfigError(
                    f"metric policy: origins[{reason!r}] is {origin!r}; use 'infra' or 'policy'"
                )

    def origin(self, reason: str, declared: Origin | None = None) -> Origin:
        return origin_of(reason, self.origins, declared)

    def decide(self, partition: str, reason: str, origin: str) -> MetricDecision:
        return match(self.rules, partition, reason, origin, self.default)  # type: ignore[no-any-return]

    def as_config(self) -> dict[str, Any]:
        return {
            "default": self.default,
            "rules": _plain(self.rules),
            "origins": dict(sorted(self.origins.items())),
        }


@dataclass(frozen=True)
class RetryPolicy:
    """Retry a session's failed attempt when its reason (or origin) is in `on`, up to
    `max_attempts` attempts in all, waiting `backoff_s * multiplier**(n-1)` (at most
    `max_backoff_s`) before attempt n+1. Default `on`: every infrastructure reason.

    Only what the runner raises is retried; a cancellation (also during the wait) is a pure
    abort, and a timeout is retried only when `on` names it.
    """

    max_attempts: int = 1
    on: Collection[str] = (INFRA,)
    backoff_s: float = 0.0
    multiplier: float = 2.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or not 1 <= self.max_attempts <= 1000
        ):
            raise ConfigError(
                f"retry policy: max_attempts must be an integer in [1, 1000], got {self.max_attempts!r}"
            )
        if isinstance(self.on, str):
            raise ConfigError(
                f"retry policy: on must be a collection of reasons or origins, got the string {self.on!r}; "
                f"write on=({self.on!r},)"
            )
        if isinstance(self.on, Mapping) or not isinstance(self.on, Collection):
            raise ConfigError(
                f"retry policy: on must be a collection of reasons or origins, got {self.on!r}",
                argument="on",
            )
        for key in self.on:
            vocabulary.check_reason(key, field="retry policy: on", also=ORIGINS)
        for name in ("backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= value < float("inf")
            ):
                raise ConfigError(
                    f"retry policy: {name} must be a finite number >= 0, got {value!r}"
                )
        if (
            isinstance(self.multiplier, bool)
            or not isinstance(self.multiplier, (int, float))
            or not 1 <= self.multiplier < float("inf")
        ):
            raise ConfigError(
                f"retry policy: multiplier must be a finite number >= 1, got {self.multiplier!r}"
            )

    def retries(self, reason: str, origin: str, attempt: int) -> bool:
        """Whether a failure of `attempt` (1-based) with this reason starts another attempt."""
        return attempt < self.max_attempts and (reason in self.on or origin in self.on)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed `attempt` before the next one."""
        return float(min(self.max_backoff_s, self.backoff_s * self.multiplier ** (attempt - 1)))

    def as_config(self) -> dict[str, Any]:
        return {
            "max_attempts": self.max_attempts,
            "on": sorted(self.on),
            "backoff_s": float(self.backoff_s),
            "multiplier": float(self.multiplier),
            "max_backoff_s": float(self.max_backoff_s),
        }


def _plain(rules: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {p: dict(sorted(by_key.items())) for p, by_key in sorted(rules.items())}


# ------------------------------------------------ what a runner's exception is recorded as
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
        if problem is None and declared is not None:
            if not isinstance(declared, str) or declared not in vocabulary.ORIGINS:
                problem = f"{_shown(declared)} is neither 'infra' nor 'policy'"
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
        return "runner_error"  # unless its own reason can be recorded (see recorded_failure)
    if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(error, InvalidInput) and _declared(error, "session_id")[0] is not None:
        return "invalid_output"  # a command of the session was refused: its tokens, mask, reward
    return "runner_error"  # an InvalidInput naming no session refused a name, not the output


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
