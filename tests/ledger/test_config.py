"""One configuration object for every way a ledger is opened: `LedgerConfig`, its fields as the
typed keywords `LedgerOptions` (and `OpenOptions`, `SessionOptions` for the calls that pass them
on), accepted by `Ledger(...)`, `Ledger.open(...)` and `SyncLedger.open(...)` alike and checked
before anything is opened."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest

from sessions import (
    CircuitBreaker,
    InProcessQueue,
    Ledger,
    LedgerConfig,
    MetricPolicy,
    PlaceholderPolicy,
    RetentionPolicy,
    RetryPolicy,
    SyncLedger,
)
from sessions.errors import ConfigError
from sessions.ledger.config import (
    ENGINE_OPTIONS,
    EngineOptions,
    LedgerOptions,
    OpenOptions,
    RunSessionOptions,
    SessionOptions,
)
from sessions.recorder import Limits


def _signature(member: Any) -> inspect.Signature:
    """A member's own signature, `self`/`cls` included, under any wrapper (a context manager's)."""
    if isinstance(member, (property, staticmethod, classmethod)):
        member = member.__func__ if not isinstance(member, property) else member.fget
    return inspect.signature(inspect.unwrap(getattr(member, "__func__", member)))


def _fields() -> dict[str, Any]:
    return {field.name: field.type for field in dataclasses.fields(LedgerConfig)}


def test_the_options_typed_dict_is_the_config_dataclass() -> None:
    """Same names, same order, same types: the keywords are the dataclass's fields."""
    assert list(LedgerOptions.__annotations__) == list(_fields())
    assert typing.get_type_hints(LedgerOptions) == typing.get_type_hints(LedgerConfig)
    assert LedgerOptions.__required_keys__ == frozenset()  # every option has a default
    assert set(OpenOptions.__annotations__) == set(_fields()) | ENGINE_OPTIONS
    assert ENGINE_OPTIONS == set(EngineOptions.__annotations__)
    assert not ENGINE_OPTIONS & set(_fields())


@pytest.mark.parametrize(
    ("entry", "explicit", "options"),
    [
        (Ledger.__init__, ["self", "engine", "settings"], "Unpack[LedgerOptions]"),
        (Ledger.open, ["cls", "url", "migrate", "settings"], "Unpack[OpenOptions]"),
        (
            SyncLedger.open,
            ["cls", "url", "migrate", "settings", "call_timeout", "open_timeout"],
            "Unpack[OpenOptions]",
        ),
    ],
    ids=["Ledger", "Ledger.open", "SyncLedger.open"],
)
def test_each_entry_point_takes_the_options_as_typed_keywords(
    entry: Any, explicit: list[str], options: str
) -> None:
    """No entry point lists an option of its own: each takes `settings` or `**options`, typed."""
    parameters = _signature(entry).parameters
    *named, rest = parameters.values()
    assert [p.name for p in named] == explicit
    assert (rest.kind, rest.annotation) == (inspect.Parameter.VAR_KEYWORD, options)
    assert parameters["settings"].annotation == "LedgerConfig | None"
    assert parameters["settings"].default is None


def _every_option() -> dict[str, Any]:
    """A value other than the default for every option but `limits` (given apart)."""
    values = {
        "run": "r-1",
        "placeholder_policy": PlaceholderPolicy(default="drop"),
        "metric_policy": MetricPolicy(default="exclude"),
        "retry_policy": RetryPolicy(max_attempts=3),
        "min_valid": 3,
        "config": {"lr": 1e-6},
        "resume": "new-config",
        "trajectory_selection": "longest",
        "sinks": (InProcessQueue(),),
        "retention": RetentionPolicy(keep_last_steps=5),
        "max_event_bytes": 1 << 20,
        "max_session_events": 100,
        "max_session_bytes": 1 << 24,
        "launch": "job-1",
        "circuit_breaker": CircuitBreaker(consecutive=7),
    }
    assert set(values) == set(_fields()) - {"limits"}
    defaults = LedgerConfig()
    assert all(getattr(defaults, name) != value for name, value in values.items())
    return values


def _opened_three_ways(url: str, **options: Any) -> list[LedgerConfig]:
    """The settings a ledger ends with when opened with `options` by each entry point."""
    import asyncio

    async def both() -> list[LedgerConfig]:
        async with Ledger.open(url, **options) as opened:
            made = Ledger(opened.engine, **options)
            return [opened.settings, made.settings]

    with SyncLedger.open(url, **options) as sync:
        synced = sync.ledger.settings
    return [*asyncio.run(both()), synced]


def test_every_entry_point_accepts_every_option_as_a_keyword_or_in_settings(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'options.db'}"
    options = _every_option()
    expected = LedgerConfig(**options)
    for settings in _opened_three_ways(url, **options):
        assert settings == expected
    for settings in _opened_three_ways(url, settings=expected):
        assert settings is expected
    # keywords beside `settings` replace its fields
    for settings in _opened_three_ways(url, settings=expected, run="r-2", min_valid=4):
        assert settings == dataclasses.replace(expected, run="r-2", min_valid=4)


def test_the_ledger_uses_what_its_settings_say(tmp_path: Path) -> None:
    options = _every_option()
    with SyncLedger.open(str(tmp_path / "used.db"), **options) as sync:
        ledger = sync.ledger
        assert (ledger.run, ledger.min_valid, ledger.resume) == ("r-1", 3, "new-config")
        assert ledger.policy is options["placeholder_policy"]
        assert ledger.metric_policy is options["metric_policy"]
        assert ledger.retry_policy is options["retry_policy"]
        assert ledger.trajectory_selection == "longest"
        assert ledger.limits == Limits(1 << 20, 100, 1 << 24)
        assert ledger.projector.sinks == list(options["sinks"])
        assert ledger.config["user"] == {"lr": 1e-6}
        assert ledger.launch == "job-1"


def test_limits_is_the_three_caps_at_once() -> None:
    folded = LedgerConfig(limits=Limits(10, 20, 30))
    assert (folded.max_event_bytes, folded.max_session_events, folded.max_session_bytes) == (
        10,
        20,
        30,
    )
    assert folded.limits is None and folded.caps == Limits(10, 20, 30)
    assert dataclasses.replace(folded, run="x").caps == Limits(10, 20, 30)
    with pytest.raises(ConfigError, match="give one of them"):
        LedgerConfig(limits=Limits(10, 20, 30), max_session_events=5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_valid": -1}, "min_valid must be an integer >= 0"),
        ({"min_valid": True}, "min_valid must be an integer >= 0"),
        ({"resume": "yes"}, "resume must be None or 'new-config'"),
        ({"trajectory_selection": "first"}, "trajectory_selection must be 'all' or 'longest'"),
        ({"max_event_bytes": 0}, "max_event_bytes must be a positive integer or None"),
        ({"max_session_events": 1.5}, "max_session_events must be a positive integer or None"),
        ({"config": {"lr": float("nan")}}, "config.lr: must be a finite number"),
        ({"limits": (1, 2, 3)}, "limits must be a sessions.recorder.Limits"),
        ({"rn": "typo"}, "unknown ledger option"),
        ({"settings": {"run": "x"}}, "settings must be a sessions.LedgerConfig"),
    ],
)
def test_a_bad_option_is_a_config_error_before_anything_is_opened(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    path = tmp_path / "never.db"
    with pytest.raises(ConfigError, match=message):
        SyncLedger.open(str(path), **options)
    assert not path.exists(), "a refused option must not create the database"
    with pytest.raises(ConfigError, match=message):
        Ledger(object(), **options)  # type: ignore[arg-type]


def test_the_session_options_are_create_sessions_keywords() -> None:
    """`session`, `run_session` and the faces pass `**identity` on to `create_session`: the typed
    dict names exactly its keywords, required where it has no default."""
    keywords = {
        p.name: p
        for p in _signature(Ledger.create_session).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    hints = {name: ref.__forward_arg__ for name, ref in SessionOptions.__annotations__.items()}
    assert hints == {name: p.annotation for name, p in keywords.items()}
    required = {name for name, p in keywords.items() if p.default is inspect.Parameter.empty}
    assert SessionOptions.__required_keys__ == required
    assert set(RunSessionOptions.__annotations__) == set(keywords) - {"timeout_s", "start"}
    assert RunSessionOptions.__required_keys__ == required
