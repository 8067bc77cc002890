"""`LedgerConfig`: every option a ledger is opened with, declared once, with its default and check.

`Ledger(engine, ...)`, `Ledger.open(url, ...)` and `SyncLedger.open(url, ...)` all take either
`settings=LedgerConfig(...)` or the same names as keywords (`**options`, typed by `LedgerOptions`
/ `OpenOptions`, so an editor shows them); keywords given beside `settings` replace its fields.
The checks run when the config is built, before anything is opened, and raise `ConfigError`.
`SessionOptions` / `RunSessionOptions` do the same for `create_session`'s keywords, which
`session`, `run_session` and the sync faces pass on.

`LedgerOptions` repeats the dataclass's fields as a `TypedDict` (the keywords' types; a
`TypedDict` cannot hold defaults, the dataclass does): `tests/ledger/test_config.py` checks the two agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from sessions import events as ev
from sessions.errors import ConfigError, InvalidInput
from sessions.failure_policy import MetricPolicy, RetryPolicy
from sessions.placeholder import PlaceholderPolicy
from sessions.queues.sinks import QueueSink
from sessions.recorder import MAX_EVENT_BYTES, MAX_SESSION_BYTES, MAX_SESSION_EVENTS, Limits
from sessions.runs import fingerprint, launches
from sessions.runs.breaker import CircuitBreaker
from sessions.runs.retention import RetentionPolicy

__all__ = [
    "DEFAULT_RUN",
    "ENGINE_OPTIONS",
    "EngineOptions",
    "LedgerConfig",
    "LedgerOptions",
    "OpenOptions",
    "RunSessionOptions",
    "SessionOptions",
    "resolve",
]

#: The run a ledger records into when none is named.
DEFAULT_RUN = "default"
#: Which of a session's trajectories become batch rows: every one, or the longest only.
_TRAJECTORY_SELECTIONS = ("all", "longest")


@dataclass(frozen=True)
class LedgerConfig:
    """A ledger's options: the run it records into, what a failure means, the run's fingerprint,
    the size caps, where projected rows go.

    Failure semantics (`docs/failures.md`): `placeholder_policy` (emit / drop / keep_partial,
    placeholder lengths), `metric_policy` (zero / exclude, reasons' origins), `retry_policy` (the
    default for `run_session`), `min_valid` (GRPO groups with fewer valid members give no
    signal); None is the default policy. With `config` (your trainer's settings, JSON-like) they
    make the run's fingerprint: recorded by the first ledger that writes to the run, and a later
    ledger with another one is refused (`RunConfigMismatch`) unless `resume="new-config"`.

    `max_event_bytes` / `max_session_events` / `max_session_bytes` cap what a session may record
    (None: no cap). `limits` gives the three as one `Limits` instead; it is folded into them (so
    it reads back None) and may not be given with any of them. `sinks` receive the projected
    rows before each page commits. `retention` (a `RetentionPolicy`, or its fields as a dict)
    is the run's size policy, recorded in its configuration; `prune(policy=True)` applies it.
    `launch` names this launch of the job, the same in all its processes (default: the
    `ROLLOUT_LEDGER_LAUNCH` environment variable, else none): a run opened by a later launch
    fails the earlier launches' open sessions and counts a step it re-runs on its own sessions
    only (`sessions.runs.launches`, docs/design.md §14). `circuit_breaker` (a `CircuitBreaker`,
    its fields as a dict, or None for none) halts the run when its failures say a dependency is
    down (`sessions.runs.breaker`, docs/failures.md); recorded in the run's configuration.
    """

    run: str = DEFAULT_RUN
    placeholder_policy: PlaceholderPolicy | None = None
    metric_policy: MetricPolicy | None = None
    retry_policy: RetryPolicy | None = None
    min_valid: int = ev.DEFAULT_MIN_VALID
    config: Mapping[str, Any] | None = None
    resume: str | None = None
    trajectory_selection: str = "all"
    sinks: Sequence[QueueSink] = ()
    max_event_bytes: int | None = MAX_EVENT_BYTES
    max_session_events: int | None = MAX_SESSION_EVENTS
    max_session_bytes: int | None = MAX_SESSION_BYTES
    limits: Limits | None = None
    retention: RetentionPolicy | Mapping[str, Any] | None = None
    launch: str | None = None
    circuit_breaker: CircuitBreaker | Mapping[str, Any] | None = CircuitBreaker()

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the defaults and folds are set once, here
        breaker = self.circuit_breaker
        if isinstance(breaker, Mapping):
            known = {f.name for f in dataclasses.fields(CircuitBreaker)}
            unknown = sorted(set(breaker) - known)
            if unknown:
                raise ConfigError(
                    f"circuit_breaker: unknown keys {unknown}; its keys are {sorted(known)}",
                    argument="circuit_breaker",
                )
            set_(self, "circuit_breaker", CircuitBreaker(**breaker))
        elif breaker is not None and not isinstance(breaker, CircuitBreaker):
            raise ConfigError(
                f"circuit_breaker must be a CircuitBreaker, its fields as a dict, or None (no "
                f"breaker), got {breaker!r:.80}",
                argument="circuit_breaker",
            )
        if self.retention is not None and not isinstance(self.retention, RetentionPolicy):
            set_(self, "retention", RetentionPolicy.from_config(self.retention))
        for name, kind in (
            ("placeholder_policy", PlaceholderPolicy),
            ("metric_policy", MetricPolicy),
            ("retry_policy", RetryPolicy),
        ):  # `is None`, not `or`: a wrong value is refused below, never taken for the default
            if getattr(self, name) is None:
                set_(self, name, kind())
        for name, kind in (
            ("placeholder_policy", PlaceholderPolicy),
            ("metric_policy", MetricPolicy),
            ("retry_policy", RetryPolicy),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(
                    f"{name} must be a {kind.__name__} or None (the default), "
                    f"got {getattr(self, name)!r}",
                    argument=name,
                )
        if isinstance(self.sinks, (str, bytes, Mapping)) or not isinstance(
            self.sinks, (Sequence, set, frozenset)
        ):
            raise ConfigError(
                f"sinks must be a list of queue sinks, got {self.sinks!r}", argument="sinks"
            )
        set_(self, "sinks", tuple(self.sinks))
        if self.limits is not None:
            self._fold_limits(self.limits)
        min_valid = self.min_valid
        if (
            isinstance(min_valid, bool)
            or not isinstance(min_valid, int)
            or not 0 <= min_valid < 2**31
        ):
            raise ConfigError(
                f"min_valid must be an integer >= 0, got {min_valid!r}", argument="min_valid"
            )
        if self.resume is not None and not (
            isinstance(self.resume, str) and self.resume == fingerprint.NEW_CONFIG
        ):
            raise ConfigError(
                f"resume must be None or {fingerprint.NEW_CONFIG!r}, got {self.resume!r}",
                argument="resume",
            )
        if (
            not isinstance(self.trajectory_selection, str)
            or self.trajectory_selection not in _TRAJECTORY_SELECTIONS
        ):
            raise ConfigError(
                f"trajectory_selection must be 'all' or 'longest', got {self.trajectory_selection!r}",
                argument="trajectory_selection",
            )
        self.caps  # noqa: B018 - Limits checks the three caps (ConfigError)
        launches.check_launch(self.launch)
        try:
            fingerprint.canonical(self.config or {})
        except InvalidInput as error:
            raise ConfigError(
                f"{error}; `config` is your trainer's settings as JSON-like values, recorded in "
                "the run's fingerprint",
                argument="config",
            ) from error

    def _fold_limits(self, limits: Limits) -> None:
        caps = ("max_event_bytes", "max_session_events", "max_session_bytes")
        if not isinstance(limits, Limits):
            raise ConfigError(
                f"limits must be a sessions.recorder.Limits, got {type(limits).__name__}",
                argument="limits",
            )
        given = [name for name in caps if getattr(self, name) != _DEFAULTS[name]]
        if given:
            raise ConfigError(
                f"limits= and {', '.join(given)}= both set the size caps; give one of them",
                argument="limits",
            )
        for name in caps:
            object.__setattr__(self, name, getattr(limits, name))
        object.__setattr__(self, "limits", None)

    @property
    def caps(self) -> Limits:
        """The size caps a session's commands are checked against."""
        return Limits(self.max_event_bytes, self.max_session_events, self.max_session_bytes)

    def fingerprinted(self) -> dict[str, Any]:
        """What the run's fingerprint covers (`sessions.runs.fingerprint`): the policies, the selection,
        `min_valid` and your `config`, as plain JSON."""
        assert self.placeholder_policy and self.metric_policy and self.retry_policy
        return {
            "placeholder": self.placeholder_policy.as_config(),
            "metrics": self.metric_policy.as_config(),
            "retry": self.retry_policy.as_config(),
            "trajectory_selection": self.trajectory_selection,
            "min_valid": self.min_valid,
            "user": fingerprint.canonical(self.config or {}),
            # Only when set, so the digests of runs recorded without one stay what they were.
            **(
                {"retention": self.retention.as_config()}
                if isinstance(self.retention, RetentionPolicy) and not self.retention.empty
                else {}
            ),
            **(
                {"breaker": self.circuit_breaker.as_config()}
                if isinstance(self.circuit_breaker, CircuitBreaker)
                else {}
            ),
        }


_DEFAULTS = {field.name: field.default for field in dataclasses.fields(LedgerConfig)}


class LedgerOptions(TypedDict, total=False):
    """`LedgerConfig`'s fields as keywords (see there for what each means and its default)."""

    run: str
    placeholder_policy: PlaceholderPolicy | None
    metric_policy: MetricPolicy | None
    retry_policy: RetryPolicy | None
    min_valid: int
    config: Mapping[str, Any] | None
    resume: str | None
    trajectory_selection: str
    sinks: Sequence[QueueSink]
    max_event_bytes: int | None
    max_session_events: int | None
    max_session_bytes: int | None
    limits: Limits | None
    retention: RetentionPolicy | Mapping[str, Any] | None
    launch: str | None
    circuit_breaker: CircuitBreaker | Mapping[str, Any] | None


class EngineOptions(TypedDict, total=False):
    """How `open` makes the database engine: `sqlite_busy_timeout` (seconds a SQLite write waits
    for another process's lock; default 30), `require_ledger` (refuse a SQLite file that is not
    a ledger at head, before connecting), `engine_options` (any other SQLAlchemy engine keyword,
    e.g. `{"pool_size": 20}`), `share_database` (let migrating make the ledger in a database that
    already holds another application's tables; refused otherwise)."""

    sqlite_busy_timeout: float | None
    require_ledger: bool
    engine_options: Mapping[str, Any] | None
    share_database: bool


class OpenOptions(LedgerOptions, EngineOptions, total=False):
    """What `Ledger.open` and `SyncLedger.open` take as keywords beside `url`, `migrate` and
    `settings`: the ledger's options and the engine's."""


class _SessionIdentity(TypedDict):
    """The keywords every session is created with (none has a default)."""

    uid: str
    session_index: int
    group_size: int
    partition: str


class RunSessionOptions(_SessionIdentity, total=False):
    """`Ledger.create_session`'s keywords that `run_session` passes on: the session's identity
    and labels (its `timeout_s` is `run_session`'s own `timeout`)."""

    global_step: int | None
    run: str | None
    data_source: str | None
    runner: str | None
    sample_index: int | None
    metadata: dict[str, Any] | None
    attempt: int | None


class SessionOptions(RunSessionOptions, total=False):
    """Every keyword of `Ledger.create_session`: what `Ledger.session` and the sync faces' session
    calls pass on to it."""

    timeout_s: float | None
    start: bool


#: `EngineOptions`' keys: what `open` hands the engine rather than the ledger.
ENGINE_OPTIONS = frozenset(EngineOptions.__annotations__)


def resolve(settings: LedgerConfig | None, options: Mapping[str, Any]) -> LedgerConfig:
    """One `LedgerConfig` from what an entry point was given: `settings`, its fields replaced by
    the keywords given beside it, or the keywords alone. An unknown keyword is a `ConfigError`
    naming the known ones (a typo would otherwise be ignored or reach the engine)."""
    unknown = sorted(options.keys() - _DEFAULTS.keys())
    if unknown:
        raise ConfigError(
            f"unknown ledger option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(_DEFAULTS)} (and, when opening, {', '.join(sorted(ENGINE_OPTIONS))})",
            argument=unknown[0],
        )
    if settings is None:
        return LedgerConfig(**options)
    if not isinstance(settings, LedgerConfig):
        raise ConfigError(
            f"settings must be a sessions.LedgerConfig, got {type(settings).__name__}; pass a "
            "LedgerConfig(...) or its fields as keywords",
            argument="settings",
        )
    return dataclasses.replace(settings, **options) if options else settings
