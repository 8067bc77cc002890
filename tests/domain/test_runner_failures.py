"""A runner's failure is always recordable (docs/design.md §4, §12).

`RolloutFailure` refuses a reason the log cannot take where it is raised; and whatever a runner
raises — an exception whose reason was set past that check, whose `str()` or `repr()` raises, a
`BaseException` of its own — `run_session` records a failed, settled session and returns its
outcome, never raising. Only an abort (a cancellation, Ctrl-C, `sys.exit()`) cancels the session
and propagates.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import InvalidInput, Ledger, RetryPolicy, RolloutFailure, SandboxError, vocabulary
from sessions import events as ev
from sessions.recorder import error_text, recorded_failure
from tests.conftest import backend_of

KW: dict[str, Any] = {"session_index": 0, "group_size": 1, "partition": "val"}
EXAMPLES = {"sqlite": 60, "postgres": 15}
BaseGroup: Any = getattr(builtins, "BaseExceptionGroup", None)


# ------------------------------------------------------------------ at the raise site
@pytest.mark.parametrize(
    "reason",
    [
        "Tool-Quota",  # malformed
        "x" * 33,  # over 32 characters
        "unprojectable",  # the projector's
        "infra",
        "policy",
        "*",  # rule keys
        "orphaned",  # the recovery sweep's only
        "",
        7,
    ],
)
def test_rollout_failure_refuses_an_unstorable_reason_where_it_is_raised(reason: Any) -> None:
    with pytest.raises(InvalidInput) as refused:
        RolloutFailure("quota exhausted", reason=reason)
    assert refused.value.field == "reason" and refused.value.session_id is None
    text = str(refused.value)
    assert text.startswith("reason:") and "quota exhausted" in text, text
    if reason == "orphaned":
        assert "recovery sweep" in text


def test_a_valid_reason_and_origin_are_kept() -> None:
    failure = RolloutFailure("q", reason="tool_quota", origin="infra")
    assert (failure.reason, failure.origin) == ("tool_quota", "infra")
    recorded = recorded_failure(failure)
    assert (recorded.reason, recorded.origin, recorded.message) == ("tool_quota", "infra", "q")


# ------------------------------------------------------------------ hostile exceptions
@dataclass(frozen=True)
class Hostile:
    """How to build one exception a runner raises."""

    base: type[BaseException]
    name: str
    message: str
    bypass: bool  # skip the class's own __init__ (and so RolloutFailure's check)
    reason: Any  # a class attribute of a RolloutFailure subclass; ... = none set
    origin: Any
    reason_raises: bool  # `reason` is a property that raises
    str_mode: str  # "plain", "raises", "not_str", "empty"
    repr_raises: bool
    grouped: bool  # wrapped in an exception group

    def build(self) -> BaseException:
        namespace: dict[str, Any] = {}
        if self.reason is not ...:
            namespace["reason"] = self.reason
        if self.origin is not ...:
            namespace["origin"] = self.origin
        if self.reason_raises:
            namespace["reason"] = property(lambda _: 1 / 0)
        if self.str_mode == "raises":
            namespace["__str__"] = lambda _: (_ for _ in ()).throw(ValueError("no str"))
        elif self.str_mode == "not_str":
            namespace["__str__"] = lambda _: 42
        elif self.str_mode == "empty":
            namespace["__str__"] = lambda _: ""
        if self.repr_raises:
            namespace["__repr__"] = lambda _: (_ for _ in ()).throw(RuntimeError("no repr"))
        cls = type(self.name, (self.base,), namespace)
        if self.bypass or issubclass(self.base, InvalidInput):
            error = cls.__new__(cls)
            BaseException.__init__(error, self.message)
        else:
            try:
                error = cls(self.message)
            except Exception as refused:  # noqa: BLE001 - RolloutFailure's check (or a reason
                error = refused  # property that raises): what the runner then raises
        if self.grouped and BaseGroup is not None:
            return BaseGroup("the runner's tasks failed", [error])
        return error


BASES: list[type[BaseException]] = [
    Exception,
    RuntimeError,
    ValueError,
    KeyError,
    TimeoutError,
    OSError,
    InvalidInput,
    RolloutFailure,
    SandboxError,
    BaseException,  # a BaseException of the runner's own: a failure, not an abort
]
#: Reasons a RolloutFailure subclass may carry: the edges of the vocabulary, then anything.
REASONS = st.one_of(
    st.just(...),
    st.sampled_from(
        [
            *ev.FAILURE_REASONS,
            "orphaned",
            "unprojectable",
            "infra",
            "policy",
            "*",
            "Tool-Quota",
            "x" * 33,
            "tool_quota",
            "",
            "a\x00b",
            None,
            0,
            b"runner_error",
        ]
    ),
    st.text(max_size=40),
)
ORIGINS = st.one_of(
    st.just(...), st.sampled_from(["infra", "policy", "model", "", None, 1]), st.text(max_size=8)
)
MESSAGES = st.one_of(
    st.text(max_size=60),
    st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=20),  # NUL, surrogates
    st.text(st.sampled_from("ab\x1b\u202e"), min_size=600, max_size=2000),  # longer than kept
)
NAMES = st.text(
    st.characters(min_codepoint=1, max_codepoint=0x10FFFF, exclude_categories=("Cs",)),
    min_size=1,
    max_size=200,
)


@st.composite
def hostile(draw: st.DrawFn) -> Hostile:
    base = draw(st.sampled_from(BASES))
    failure = issubclass(base, RolloutFailure)
    return Hostile(
        base=base,
        name=draw(st.one_of(st.sampled_from(["Quota", "E"]), NAMES)),
        message=draw(MESSAGES),
        bypass=draw(st.booleans()),
        reason=draw(REASONS) if failure else ...,
        origin=draw(ORIGINS) if failure else ...,
        reason_raises=failure and draw(st.booleans()) and draw(st.booleans()),
        str_mode=draw(st.sampled_from(["plain", "plain", "raises", "not_str", "empty"])),
        repr_raises=draw(st.booleans()),
        grouped=draw(st.integers(0, 5)) == 0,
    )


@settings(max_examples=400, deadline=None)
@given(spec=hostile())
def test_any_exception_becomes_a_storable_failure(spec: Hostile) -> None:
    """`recorded_failure` never raises and always gives a reason the ledger records from a runner,
    an origin or None, and text; a reason the log can take is kept, and so is the error's text."""
    error = spec.build()
    failure = recorded_failure(error)
    assert vocabulary.reason_problem(failure.reason, runner=True) is None, failure
    assert failure.origin in (None, *vocabulary.ORIGINS)
    assert type(failure.message) is str and failure.message
    assert failure.error_type == type(error).__qualname__
    text = error_text(error)
    assert type(text) is str and text
    if isinstance(error, RolloutFailure) and not spec.reason_raises:
        reason = error.reason
        if isinstance(reason, str) and vocabulary.reason_problem(reason, runner=True) is None:
            assert failure.reason == reason
        else:
            assert failure.reason == "runner_error" and "reason refused" in failure.message
    # the error's own text comes first, whole or cut to leave room for the note
    assert failure.message.startswith(text[: ev.MESSAGE_LIMIT - 310])


# ------------------------------------------------------------------ through run_session
@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for every example of the module (hypothesis calls the test synchronously)."""
    running = asyncio.new_event_loop()
    yield running
    running.close()


_steps = itertools.count()


async def _run_one(ledger: Ledger, spec: Hostile, record_first: bool, attempts: int) -> None:
    step = next(_steps)
    sid = f"hostile-{uuid.uuid4().hex[:10]}"

    async def runner(handle: Any) -> None:
        if record_first:
            await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3])
        raise spec.build()

    retry = RetryPolicy(max_attempts=attempts, on=("infra", "policy"))
    outcome = await ledger.run_session(
        runner, sid, uid=f"u{step}", global_step=step, timeout=30, retry=retry, **KW
    )
    assert outcome.state == "failed", outcome
    assert outcome.attempts == attempts and outcome.error is not None
    assert vocabulary.reason_problem(outcome.failure_reason, runner=True) is None
    stored = await ledger.load_session(sid)
    assert (stored.state, stored.view.failure_reason) == ("failed", outcome.failure_reason)
    # its group settled: the step's batch is its placeholder, not a timeout
    batch = await ledger.batch("val", step, timeout=10)
    assert batch.batch_size[0] == 1 and bool(batch["is_placeholder"][0])


def test_whatever_a_runner_raises_ends_in_a_failed_settled_session(
    module_db_url: str, loop: asyncio.AbstractEventLoop
) -> None:
    backend = backend_of(module_db_url)

    async def example(spec: Hostile, record_first: bool, attempts: int) -> None:
        async with Ledger.open(module_db_url) as ledger:
            await _run_one(ledger, spec, record_first, attempts)

    @settings(
        max_examples=EXAMPLES[backend],
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(spec=hostile(), record_first=st.booleans(), attempts=st.sampled_from([1, 1, 2]))
    def check(spec: Hostile, record_first: bool, attempts: int) -> None:
        loop.run_until_complete(example(spec, record_first, attempts))

    check()


async def test_the_issues_cases_are_recorded_as_runner_error(tmp_path: Path) -> None:
    """The exact runners the issue reported: each fails its session, none raises."""

    class Bypassed(RolloutFailure):
        reason = "Tool-Quota"

        def __init__(self, message: str) -> None:
            Exception.__init__(self, message)

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("no")

    cases = {
        "constructed": lambda: RolloutFailure("quota", reason="Tool-Quota"),
        "bypassed": lambda: Bypassed("quota"),
        "orphaned": lambda: Bypassed.__new__(Bypassed),
        "unprintable": lambda: Unprintable("hidden"),
    }
    async with Ledger.open(tmp_path / "ledger.db") as ledger:
        for step, (name, make) in enumerate(cases.items()):

            async def runner(handle: Any, make: Any = make, name: str = name) -> None:
                error = make()
                if name == "orphaned":
                    BaseException.__init__(error, "swept?")
                    error.reason = "orphaned"
                raise error

            outcome = await ledger.run_session(
                runner, name, uid=name, global_step=step, timeout=5, **KW
            )
            assert (outcome.state, outcome.failure_reason) == ("failed", "runner_error"), name
            message = (await ledger.load_session(name)).view.message
            wanted = {
                "constructed": "(raising RolloutFailure('quota'))",
                "bypassed": "quota [rollout-ledger: reason refused, runner_error recorded: 'Tool-Quota'",
                "orphaned": "swept? [rollout-ledger: reason refused, runner_error recorded: 'orphaned' is recorded by the recovery sweep only",
                "unprintable": "(its str() raised ValueError)",
            }[name]
            assert wanted in message, message


# ------------------------------------------------------------------ aborts
async def test_a_cancellation_the_runner_raises_cancels_and_propagates(tmp_path: Path) -> None:
    async def runner(handle: Any) -> None:
        raise asyncio.CancelledError

    async with Ledger.open(tmp_path / "ledger.db") as ledger:
        with pytest.raises(asyncio.CancelledError):
            await ledger.run_session(runner, "c", uid="c", global_step=0, timeout=5, **KW)
        handle = await ledger.load_session("c")
        assert handle.state == "cancelled"
        assert (await ledger.batch("val", 0, timeout=5)).batch_size[0] == 0  # settled, no row


ABORT_KINDS: dict[str, Any] = {
    "ctrl-c": KeyboardInterrupt,
    "exit": SystemExit,
    "closed": GeneratorExit,
}
if BaseGroup is not None:
    ABORT_KINDS["group"] = lambda: BaseGroup("tasks", [ValueError("v"), KeyboardInterrupt()])


@pytest.mark.parametrize("timeout", [None, 5.0])
@pytest.mark.parametrize("kind", list(ABORT_KINDS.values()), ids=list(ABORT_KINDS))
def test_ctrl_c_and_exit_cancel_the_session_then_propagate(
    tmp_path: Path, kind: Any, timeout: float | None
) -> None:
    """The process is going down: the session is recorded cancelled (its group settles, it is no
    failure of the runner) before the exception goes on, even out of `asyncio.run`."""
    path = tmp_path / "ledger.db"

    async def runner(handle: Any) -> None:
        await handle.record_trajectory(prompt_ids=[1], response_ids=[2])
        raise kind()

    async def main() -> None:
        async with Ledger.open(path) as ledger:
            await ledger.run_session(runner, "k", uid="k", global_step=0, timeout=timeout, **KW)

    expected = kind if isinstance(kind, type) else BaseGroup
    with pytest.raises(expected):
        asyncio.run(main())

    async def read() -> tuple[str, int]:
        async with Ledger.open(path) as ledger:
            handle = await ledger.load_session("k")
            return handle.state, (await ledger.batch("val", 0, timeout=5)).batch_size[0]

    assert asyncio.run(read()) == ("cancelled", 0)


async def test_a_runner_base_exception_of_its_own_is_a_failure(db_url: str) -> None:
    class Halt(BaseException):
        pass

    async def runner(handle: Any) -> None:
        raise Halt("the tool said stop")

    async with Ledger.open(db_url) as ledger:
        outcome = await ledger.run_session(runner, "h", uid="h", global_step=0, timeout=5, **KW)
        assert (outcome.state, outcome.failure_reason) == ("failed", "runner_error")
        assert isinstance(outcome.error, Halt)
        assert (await ledger.load_session("h")).view.message == "the tool said stop"
