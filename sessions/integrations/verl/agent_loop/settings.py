"""What the ledger agent loop needs to know, read from the verl job's own config (docs/design.md §13).

A verl job is one Hydra config that every Ray worker receives whole, so the ledger's settings
travel in it as one more section, added with Hydra's ``+`` syntax::

    +ledger.url=postgresql://host/rollouts   # where every worker records (SQLite: one node only)
    +ledger.timeout=600                       # seconds per attempt of an agent loop (default: none)
    +ledger.max_attempts=2                    # the run's RetryPolicy (default: one attempt)
    +ledger.reward_keys='{acc: 0.0}'          # a placeholder's reward keys, when it cannot learn them
    +ledger.launch=job-20261206-1             # this start of the job (default: main_ppo's, or Ray's)
    +ledger.circuit_breaker='{consecutive: 10}'  # when failures halt the run (null: never)

Each key falls back to an environment variable (``ROLLOUT_LEDGER_DB``, ``ROLLOUT_LEDGER_RUN``, ...),
then to a default. The run defaults to verl's ``trainer.experiment_name``; the placeholder token
to the tokenizer's pad token, so a placeholder row is what verl's own padding would put there.
The trainer side reads the same section (``sessions.integrations.verl.trainer``), so both sides
open the run with the same configuration and its fingerprint agrees.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sessions.errors import ConfigError
from sessions.events import DEFAULT_MIN_VALID
from sessions.failure_policy import RetryPolicy
from sessions.placeholder import PlaceholderPolicy
from sessions.runs.breaker import CircuitBreaker
from sessions.vocabulary import INFRA

__all__ = ["CONFIG_SECTION", "LedgerSettings", "URL_SETTING", "ray_launch"]

#: The top-level config section the settings live in (``+ledger.url=...``).
CONFIG_SECTION = "ledger"
#: How an error names the database setting (the config key, or its environment fallback).
URL_SETTING = "+ledger.url (or $ROLLOUT_LEDGER_DB)"
#: Environment fallbacks, by setting.
_ENV = {
    "url": "ROLLOUT_LEDGER_DB",
    "run": "ROLLOUT_LEDGER_RUN",
    "timeout": "ROLLOUT_LEDGER_TIMEOUT",
    "max_attempts": "ROLLOUT_LEDGER_MAX_ATTEMPTS",
    "launch": "ROLLOUT_LEDGER_LAUNCH",
}
_KEYS = (
    "url",
    "run",
    "timeout",
    "max_attempts",
    "retry_on",
    "backoff_s",
    "min_valid",
    "placeholder_token_id",
    "placeholder_prompt_length",
    "placeholder_response_length",
    "reward_keys",
    "launch",
    "circuit_breaker",
)


@dataclass(frozen=True)
class LedgerSettings:
    """The ledger a verl job records into and how it treats a failed agent loop.

    ``url``: the database every worker process opens (``postgresql://...`` when the workers span
    nodes; a SQLite file serves the processes of one node). ``run``: the ledger run the job's
    sessions belong to. ``timeout``: seconds per attempt of the inner agent loop and its reward
    (None: no limit). ``max_attempts`` / ``retry_on`` / ``backoff_s``: the run's ``RetryPolicy``.
    ``min_valid``: GRPO groups with fewer valid members get no signal (the trainer side zeroes
    them). ``placeholder_*``: the placeholder's token and lengths (docs/design.md §5).
    ``reward_keys``: the reward function's extra keys, each with the value a placeholder carries
    (``{acc: 0.0, pred: ""}``; ``{}``: none), for a loop whose placeholder cannot learn them
    before its first success (None: learned, see ``loop.LedgerAgentLoop``).
    """

    url: str
    run: str
    timeout: float | None = None
    max_attempts: int = 1
    retry_on: tuple[str, ...] = (INFRA,)
    backoff_s: float = 0.0
    min_valid: int = DEFAULT_MIN_VALID
    placeholder_token_id: int = 0
    placeholder_prompt_length: int = 1
    placeholder_response_length: int = 1
    reward_keys: tuple[tuple[str, Any], ...] | None = None
    #: this launch of the job, the same in every worker (docs/design.md §14): the trainer's
    #: ``main_ppo`` writes a fresh one into the config; else the Ray job's (`ray_launch`)
    launch: str | None = None
    #: the run's circuit breaker (``+ledger.circuit_breaker='{consecutive: 10}'``; null: none)
    circuit_breaker: CircuitBreaker | None = CircuitBreaker()
    #: what `Ledger.open` gets on top (tests: engine options); not part of the job config
    open_kwargs: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(f"ledger.url must be a database URL, got {self.url!r}")
        if self.timeout is not None and not (
            isinstance(self.timeout, (int, float)) and self.timeout > 0
        ):
            raise ConfigError(f"ledger.timeout must be seconds > 0 or null, got {self.timeout!r}")
        self.retry_policy()  # checks max_attempts, retry_on, backoff_s
        self.placeholder_policy()  # checks the token and lengths
        if self.reward_keys is not None:
            _reward_keys(dict(self.reward_keys))

    def retry_policy(self) -> RetryPolicy:
        """The run's ``RetryPolicy``: which failed attempts of an agent loop run again."""
        return RetryPolicy(
            max_attempts=self.max_attempts, on=tuple(self.retry_on), backoff_s=self.backoff_s
        )

    def placeholder_policy(self) -> PlaceholderPolicy:
        """The placeholder a failed agent loop becomes, in the ledger and in verl's batch alike."""
        return PlaceholderPolicy(
            token_id=self.placeholder_token_id,
            prompt_length=self.placeholder_prompt_length,
            response_length=self.placeholder_response_length,
        )

    def ledger_options(self) -> dict[str, Any]:
        """Keywords for ``Ledger.open(url, **options)`` (the same on every side of the job)."""
        return {
            "run": self.run,
            "retry_policy": self.retry_policy(),
            "placeholder_policy": self.placeholder_policy(),
            "min_valid": self.min_valid,
            "launch": self.launch,
            "circuit_breaker": self.circuit_breaker,
            **self.open_kwargs,
        }

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        pad_token_id: int | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> LedgerSettings:
        """Settings from a verl trainer config (an OmegaConf ``DictConfig`` or a mapping).

        ``pad_token_id``: the tokenizer's, the placeholder token unless the config names one.
        """
        section = _section(config)
        unknown = sorted(set(section) - set(_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown ledger setting(s) {unknown}; the {CONFIG_SECTION} section takes {list(_KEYS)}"
            )

        def pick(key: str, default: Any) -> Any:
            if section.get(key) is not None:
                return section[key]
            env = _ENV.get(key)
            if env and environ.get(env):
                return environ[env]
            return default

        url = pick("url", None)
        if url is None:
            raise ConfigError(
                "the ledger agent loop needs a database: add +ledger.url=postgresql://... (or a SQLite "
                f"file for one node) to the verl command, or set {_ENV['url']}"
            )
        run = pick("run", None) or _experiment_name(config)
        timeout = pick("timeout", None)
        token = pick("placeholder_token_id", None)
        if token is None:
            token = pad_token_id if pad_token_id is not None else 0
        return cls(
            url=str(url),
            run=str(run),
            timeout=None if timeout in (None, "", "null", "none") else _number(timeout, "timeout"),
            max_attempts=int(_number(pick("max_attempts", 1), "max_attempts")),
            retry_on=_names(pick("retry_on", (INFRA,))),
            backoff_s=_number(pick("backoff_s", 0.0), "backoff_s"),
            min_valid=int(_number(pick("min_valid", DEFAULT_MIN_VALID), "min_valid")),
            placeholder_token_id=int(token),
            placeholder_prompt_length=int(pick("placeholder_prompt_length", 1)),
            placeholder_response_length=int(pick("placeholder_response_length", 1)),
            reward_keys=_reward_keys(section.get("reward_keys")),
            launch=_text(pick("launch", None)) or ray_launch(),
            circuit_breaker=_breaker(section),
        )

    def placeholder_reward_keys(self) -> dict[str, Any] | None:
        """The declared reward keys with a placeholder's values, or None when none are declared."""
        return None if self.reward_keys is None else dict(self.reward_keys)


def ray_launch() -> str | None:
    """This process's Ray job as a launch id, the same in every worker of one job and new when
    the job starts again (a resumed run): the Ray session (the cluster's start, named by its
    time) and the job's id within it. None outside Ray."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    # The session names one start of the cluster (by its time); the job id counts from 1 in it.
    return f"ray:{context.get_session_name()}:{context.get_job_id()}"[:128]


def _text(value: Any) -> str | None:
    """A setting's text, None for an empty or null value."""
    if value is None or str(value).strip().lower() in ("", "null", "none"):
        return None
    return str(value)


def _section(config: Any) -> dict[str, Any]:
    """The ``ledger`` section as a plain dict ({} when the job has none)."""
    raw = config.get(CONFIG_SECTION) if hasattr(config, "get") else None
    if raw is None:
        return {}
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(raw):
            raw = OmegaConf.to_container(raw, resolve=True)
    except ImportError:  # a plain mapping from a test or a script
        pass
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"the {CONFIG_SECTION} config section must be a mapping, got {type(raw).__name__}"
        )
    return dict(raw)


def _experiment_name(config: Any) -> str:
    """verl's ``trainer.experiment_name``: one verl experiment is one ledger run by default."""
    trainer = config.get("trainer") if hasattr(config, "get") else None
    name = trainer.get("experiment_name") if trainer is not None else None
    if not name:
        raise ConfigError(
            "no ledger run: set +ledger.run=NAME (or trainer.experiment_name) in the verl command"
        )
    return str(name)


def _reward_keys(value: Any) -> tuple[tuple[str, Any], ...] | None:
    """``+ledger.reward_keys``: a mapping of each extra key the reward function returns to the
    value a placeholder carries for it (a number, a bool, a string or null); ``{}`` or ``[]``:
    the reward function returns none."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and not value:
        return ()
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"ledger.reward_keys must map each extra key of the reward function to a placeholder's "
            f"value, e.g. +ledger.reward_keys='{{acc: 0.0, pred: \"\"}}' ({{}} for none), got {value!r}"
        )
    pairs = []
    for key, example in value.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"ledger.reward_keys: a key must be a name, got {key!r}")
        if example is not None and not isinstance(example, (bool, int, float, str)):
            raise ConfigError(
                f"ledger.reward_keys[{key!r}] must be a number, a bool, a string or null (the "
                f"value a failed run's row carries), got {example!r}"
            )
        pairs.append((key, example))
    return tuple(pairs)


def _breaker(section: Mapping[str, Any]) -> CircuitBreaker | None:
    """``+ledger.circuit_breaker``: the rule's fields as a mapping (the others default), or null
    for no breaker; absent: the default rule."""
    if "circuit_breaker" not in section:
        return CircuitBreaker()
    value = section["circuit_breaker"]
    if value is None or value in ("null", "none", "None"):
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(
            "ledger.circuit_breaker must be the breaker's fields, e.g. "
            f"+ledger.circuit_breaker='{{consecutive: 10, window: null}}', or null for none; got {value!r:.80}"
        )
    known = {"consecutive", "window", "max_share", "origins", "reasons"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(
            f"ledger.circuit_breaker: unknown keys {unknown}; its keys are {sorted(known)}"
        )
    fields = dict(value)
    for key in ("origins", "reasons"):
        if key in fields:
            fields[key] = _names(fields[key])
    return CircuitBreaker(**fields)


def _names(value: Any) -> tuple[str, ...]:
    """Reasons or origins, from a list or from a comma-separated string (an environment value)."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return tuple(str(part) for part in value)


def _number(value: Any, key: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"ledger.{key} must be a number, got {value!r}") from None
