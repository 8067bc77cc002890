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

What a runner's exception is recorded as is `sessions.runner_failure`'s. This module imports
nothing of `sessions` but the vocabulary and the errors, so the events can take their defaults
from it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sessions import vocabulary
from sessions.errors import ConfigError
from sessions.vocabulary import (
    ANY,
    CONNECTION_ERROR,
    EMPTY_OUTPUT,
    FAILURE_REASONS,
    FINALIZE_ERROR,
    INCOMPLETE_CAPTURE,
    INFRA,
    INVALID_OUTPUT,
    ORIGINS,
    ORPHANED,
    POLICY,
    RUNNER_ERROR,
    SANDBOX_ERROR,
    TIMEOUT,
    Origin,
)

__all__ = [
    "DEFAULT_ORIGINS",
    "EXCLUDE",
    "GROUP_BUDGET",
    "METRIC_DECISIONS",
    "RETRY_BUDGETS",
    "STEP_BUDGET",
    "MetricPolicy",
    "RetryPolicy",
    "ZERO",
    "check_rules",
    "match",
]

_MetricDecision = Literal["zero", "exclude"]
#: A failure is a zero in the reward means (the default).
ZERO: _MetricDecision = "zero"
#: A failure is left out of `reward/mean` and `reward/mean@k`, counted under `excluded/<reason>`.
EXCLUDE: _MetricDecision = "exclude"
#: The metric policy's choices.
METRIC_DECISIONS: tuple[_MetricDecision, ...] = (ZERO, EXCLUDE)
#: The retry budgets a retry may be refused by (`RetryPolicy.group_budget` / `step_budget`).
GROUP_BUDGET, STEP_BUDGET = "group_budget", "step_budget"
RETRY_BUDGETS = (GROUP_BUDGET, STEP_BUDGET)

#: The built-in reasons' origins: `infra` when the model cannot have caused the failure, `policy`
#: otherwise. `connection_error` (a server the runner calls refused, dropped or timed out its
#: connection, or answered 5xx / 429) is `infra`, so the default `RetryPolicy` retries it. `runner_error` is `policy`: a runner's exception is as often the model's malformed
#: tool call as the harness's bug, and a policy must not escape a zero by it; a runner that knows
#: better raises `SandboxError` or `RolloutFailure(origin="infra")`. A v1 `SessionFailed` is read
#: with these (its upcaster in `sessions.events`).
DEFAULT_ORIGINS: Mapping[str, Origin] = {
    RUNNER_ERROR: POLICY,
    TIMEOUT: POLICY,
    SANDBOX_ERROR: INFRA,
    EMPTY_OUTPUT: POLICY,
    FINALIZE_ERROR: INFRA,
    INVALID_OUTPUT: POLICY,
    CONNECTION_ERROR: INFRA,
    ORPHANED: INFRA,
    INCOMPLETE_CAPTURE: INFRA,
}
assert set(DEFAULT_ORIGINS) == set(FAILURE_REASONS)


def _origin_of(
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
                    f"{kind}: rules[{partition!r}][{key!r}] is {decision!r}; use {_either(choices)}"
                )


def _either(choices: Collection[str]) -> str:
    """`'a' or 'b'`, for a message naming what a setting takes."""
    return " or ".join(map(repr, choices))


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

    default: _MetricDecision = ZERO
    rules: Mapping[str, Mapping[str, _MetricDecision]] = field(default_factory=dict)
    origins: Mapping[str, Origin] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.default, str) or self.default not in METRIC_DECISIONS:
            raise ConfigError(
                f"metric policy: default is {self.default!r}; use {_either(METRIC_DECISIONS)}"
            )
        check_rules("metric policy", self.rules, METRIC_DECISIONS)
        _check_mapping("metric policy", "origins", self.origins)
        for reason, origin in self.origins.items():
            vocabulary.check_reason(reason, field="metric policy: origins")
            if vocabulary.origin_problem(origin) is not None:
                raise ConfigError(
                    f"metric policy: origins[{reason!r}] is {origin!r}; use {_either(ORIGINS)}"
                )

    def origin(self, reason: str, declared: Origin | None = None) -> Origin:
        return _origin_of(reason, self.origins, declared)

    def decide(self, partition: str, reason: str, origin: str) -> _MetricDecision:
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

    `group_budget` / `step_budget` bound the retries a group's sessions / a step's sessions (of a
    partition) may take together (None: no bound): a retry past a spent budget is refused, and
    the session fails recording which budget refused it (`SessionFailed.retry_refused`), so a
    group that ends below `min_valid` for it is counted as unusable by that cause. Sessions that
    retry at the same moment may each see the last retry left: a budget may be passed by as many
    retries as were in flight together.

    Only what the runner raises is retried; a cancellation (also during the wait) is a pure
    abort, and a timeout is retried only when `on` names it.
    """

    max_attempts: int = 1
    on: Collection[str] = (INFRA,)
    backoff_s: float = 0.0
    multiplier: float = 2.0
    max_backoff_s: float = 30.0
    group_budget: int | None = None
    step_budget: int | None = None

    def __post_init__(self) -> None:
        for name in RETRY_BUDGETS:
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ConfigError(
                    f"retry policy: {name} must be None (no bound) or an integer >= 0, got {value!r:.60}",
                    argument=name,
                )
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
            # only when set, so the digests of runs recorded without budgets stay what they were
            **{
                name: getattr(self, name)
                for name in RETRY_BUDGETS
                if getattr(self, name) is not None
            },
        }

    @property
    def budgeted(self) -> bool:
        """Whether a retry must ask the group's or the step's budget first."""
        return self.group_budget is not None or self.step_budget is not None


def _plain(rules: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {p: dict(sorted(by_key.items())) for p, by_key in sorted(rules.items())}
