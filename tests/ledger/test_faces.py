"""Options and faces written once: one `LedgerConfig` for every way a ledger is opened,
and every face of the ledger and of a session (`SyncLedger`, `SyncSession`, `SessionProxy`, the
trackers' `log_step` / `log_step_sync`) with the parameters of the async original.

The members and parameters compared are derived from the classes (`inspect`), never listed here;
what a face leaves out or adds on purpose is listed, with the reason beside it."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest

from sessions import (
    InProcessQueue,
    Ledger,
    LedgerConfig,
    MetricPolicy,
    PlaceholderPolicy,
    RetentionPolicy,
    RetryPolicy,
    SessionHandle,
    SessionProxy,
    SyncLedger,
    SyncSession,
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


# ------------------------------------------------------------------ one configuration object
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


# ------------------------------------------------------------------ typed faces
#: Parameters a face adds to its original's, and why.
FACE_ONLY = {
    # the loop thread's own bounds: how long any call, and the opening, may take
    (SyncLedger, "open"): {"call_timeout", "open_timeout"},
}
#: Parameters whose annotation differs on a face, and why.
FACE_TYPED = {
    # the runner is handed the face's session (a SessionProxy), not the loop-bound SessionHandle
    ("run_session", "runner"),
}
#: `Ledger` members with no awaitable (`a`-prefixed) twin on `SyncLedger`, and why: opening and
#: closing are the face's own business (`SyncLedger.open` / `close`, from any thread), and a
#: handle for another event loop comes from `asession` / `arun_session` (a `SessionProxy`), so
#: `create_session` / `load_session` have a blocking face only.
NO_AWAITABLE_TWIN = {"open", "close", "create_session", "load_session"}

FACES = [(SyncLedger, Ledger), (SyncSession, SessionHandle), (SessionProxy, SessionHandle)]


def _public(cls: type) -> dict[str, Any]:
    """A class's public members as declared (properties, functions, classmethods), own and inherited."""
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):
        members.update(
            (name, value) for name, value in vars(klass).items() if not name.startswith("_")
        )
    return members


def _parameters(face: type, name: str, member: Any) -> list[tuple[str, Any, Any, Any]]:
    """(name, kind, default, annotation) of each parameter, what a face may differ in left out."""
    out = []
    for parameter in _signature(member).parameters.values():
        if parameter.name in FACE_ONLY.get((face, name), ()):
            continue
        typed = (name, parameter.name) not in FACE_TYPED
        out.append(
            (
                parameter.name,
                parameter.kind,
                parameter.default,
                parameter.annotation if typed else "(the face's own)",
            )
        )
    return out


def _is_async(member: Any) -> bool:
    function = inspect.unwrap(getattr(member, "__func__", member))
    return inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)


@pytest.mark.parametrize(("face", "original"), FACES, ids=lambda cls: cls.__name__)
def test_every_face_has_every_member_of_its_original_with_its_parameters(
    face: type, original: type
) -> None:
    originals, faces = _public(original), _public(face)
    assert len(originals) >= 10  # the derivation sees the members
    missing = sorted(originals.keys() - faces.keys())
    assert not missing, f"{face.__name__} lacks {missing} of {original.__name__}"
    for name, member in originals.items():
        mine = faces[name]
        if isinstance(member, property):
            assert isinstance(mine, property), f"{face.__name__}.{name} is not a property"
            continue
        assert callable(getattr(face, name)), f"{face.__name__}.{name}"
        assert _parameters(face, name, mine) == _parameters(original, name, member), (
            f"{face.__name__}.{name} takes other parameters than {original.__name__}.{name}"
        )
        awaitable = face is SessionProxy
        assert _is_async(mine) == awaitable, f"{face.__name__}.{name} should block: {awaitable}"


def test_the_ledgers_awaitable_twins_have_its_parameters() -> None:
    """`SyncLedger.a<name>` for every `Ledger` member but the listed ones, awaitable, same parameters."""
    members = _public(Ledger)
    twins = {name for name in _public(SyncLedger) if name.startswith("a") and name[1:] in members}
    assert {f"a{name}" for name in members.keys() - NO_AWAITABLE_TWIN} == twins
    for twin in twins:
        name = twin[1:]
        mine = _public(SyncLedger)[twin]
        assert _is_async(mine), twin
        assert _parameters(SyncLedger, name, mine) == _parameters(Ledger, name, members[name]), twin


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


# ------------------------------------------------------------------ log_step, written once
class _Memory:
    """A tracker that keeps what it is given."""

    name = "memory"

    def __init__(self) -> None:
        self.written: list[tuple[Any, bool, bool]] = []

    def has_logged(self, key: Any) -> bool:
        return any(content.key == key for content, _, _ in self.written)

    def write(self, content: Any, *, scalars: bool = True, failed_sessions: bool = True) -> str:
        self.written.append((content, scalars, failed_sessions))
        return "logged"


def test_log_step_sync_takes_log_steps_parameters() -> None:
    """One declaration: the synchronous face has the async one's parameters, the ledger's type
    apart, and every keyword of the step's read (`collect_step`) is one of them."""
    from sessions.trackers import collect_step, log_step, log_step_sync

    mine, theirs = inspect.signature(log_step_sync), inspect.signature(log_step)
    assert mine.parameters["ledger"].annotation == "SyncLedger"
    assert theirs.parameters["ledger"].annotation == "Ledger"
    assert list(mine.parameters.values())[1:] == list(theirs.parameters.values())[1:]
    read = {
        p.name
        for p in inspect.signature(collect_step).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert read <= set(theirs.parameters)


def test_both_log_step_faces_pass_every_option_on(tmp_path: Path) -> None:
    import asyncio

    from sessions.trackers import log_step, log_step_sync
    from tests.projection.test_settled import _ended_step

    with SyncLedger.open(str(tmp_path / "log.db"), run="r") as sync:
        sync._call(_ended_step(sync.ledger), "setup")
        blocking, awaited = _Memory(), _Memory()
        options = dict(trackers=[blocking], per_reason=1, max_failed=2, scalars=False)
        done = log_step_sync(sync, "train", 0, **options)
        with pytest.raises(TypeError, match="per_reasons"):
            log_step_sync(sync, "train", 0, trackers=[_Memory()], per_reasons=1)
        with pytest.raises(TypeError, match="trackers"):
            log_step_sync(sync, "train", 0)

        async def on_loop() -> Any:
            return await log_step(sync.ledger, "train", 0, **{**options, "trackers": [awaited]})

        again = sync._call(on_loop(), "log_step")
    for logged, tracker in ((done, blocking), (again, awaited)):
        assert logged.trackers == {"memory": "logged"} and logged.scalars == {}
        [(content, scalars, failed)] = tracker.written
        assert (scalars, failed, content.per_reason, len(content.failed)) == (False, True, 1, 1)
        assert content.key == ("r", "train", 0)
    assert asyncio.iscoroutinefunction(log_step) and not asyncio.iscoroutinefunction(log_step_sync)
