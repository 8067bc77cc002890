"""The embedded recorder on both backends: failures, cancellation, timeouts, input validation,
terminal sessions, rewards (docs/design.md §3–5, §12).

Every test of this module shares one database per backend (creating a PostgreSQL database per
test dominates the run time), so each test names its sessions through `ids(...)`, which makes
them unique, and checks "nothing was written" against the log position before and after.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

from sessions import InvalidInput, InvalidTransition, RolloutFailure, SandboxError
from sessions import aggregate as agg
from sessions import events as ev
from sessions.recorder import failure_reason


@pytest.fixture
async def ledger(module_db_url: str) -> AsyncIterator[Any]:
    from sessions import Ledger

    async with Ledger.open(module_db_url) as opened:
        yield opened


@pytest.fixture
def ids() -> Callable[[str], str]:
    """Session ids unique to this test (the module's database is shared)."""
    token = uuid.uuid4().hex[:8]
    return lambda name: f"{name}-{token}"


def kw(**overrides: Any) -> dict[str, Any]:
    """Identity keywords of a session in a group of its own: a fresh uid per call. A group is
    (run, partition, global_step, uid) and refuses a second session with the same index, so the
    sessions of this module (one shared database) must not share a uid."""
    return {
        "uid": f"u{uuid.uuid4().hex[:12]}",
        "session_index": 0,
        "group_size": 1,
        "partition": "val",
        "global_step": 0,
        **overrides,
    }


async def stream(ledger: Any, sid: str) -> list[ev.Event]:
    return [ev.decode(s).event for s in await ledger.store.read_stream(sid)]


async def types(ledger: Any, sid: str) -> list[str]:
    return [e.TYPE for e in await stream(ledger, sid)]


async def assert_fold_matches(ledger: Any, handle: Any) -> None:
    assert agg.fold(handle.session_id, await stream(ledger, handle.session_id)) == handle.view


# ------------------------------------------------------------------ exception -> reason
class CustomError(Exception):
    pass


REASON_CASES = [
    (lambda: RuntimeError("kaboom"), "runner_error"),
    (lambda: KeyError("missing"), "runner_error"),
    (lambda: CustomError("custom"), "runner_error"),
    (lambda: TimeoutError("too slow"), "timeout"),
    (lambda: asyncio.TimeoutError(), "timeout"),
    (lambda: SandboxError("container died"), "sandbox_error"),
    (lambda: InvalidInput("s", "response_mask", "values must be 0 or 1"), "invalid_output"),
    (lambda: RolloutFailure("finalizer crashed", reason="finalize_error"), "finalize_error"),
    (lambda: RolloutFailure("no reason given"), "runner_error"),
    (lambda: SandboxError("explicit", reason="timeout"), "timeout"),
]
REASON_IDS = [
    "RuntimeError",
    "KeyError",
    "custom",
    "TimeoutError",
    "asyncio.TimeoutError",
    "SandboxError",
    "InvalidInput",
    "RolloutFailure-finalize",
    "RolloutFailure-default",
    "SandboxError-explicit",
]


@pytest.mark.parametrize(("make", "reason"), REASON_CASES, ids=REASON_IDS)
def test_failure_reason_maps_each_exception(make: Any, reason: str) -> None:
    assert failure_reason(make()) == reason


def test_rollout_failure_reason_is_per_instance() -> None:
    explicit = RolloutFailure("x", reason="empty_output")
    assert explicit.reason == "empty_output"
    assert (
        RolloutFailure("y").reason == "runner_error" and SandboxError("z").reason == "sandbox_error"
    )


@pytest.mark.parametrize(
    ("make", "reason"),
    [REASON_CASES[i] for i in (0, 3, 4, 5, 7)],
    ids=[REASON_IDS[i] for i in (0, 3, 4, 5, 7)],
)
async def test_session_context_records_the_failure_and_reraises(
    ledger: Any, make: Any, reason: str, ids: Any
) -> None:
    error = make()
    with pytest.raises(type(error)) as info:
        async with ledger.session(ids("s-fail"), **kw()) as s:
            await s.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4])
            await s.post_reward(0.9, acc=1.0)
            raise error
    assert info.value is error, "the runner's own exception must be re-raised"
    events = await stream(ledger, ids("s-fail"))
    assert [e.TYPE for e in events] == [
        "SessionCreated",
        "SessionStarted",
        "TrajectoryRecorded",
        "RewardPosted",
        "SessionFailed",
        "PlaceholderEmitted",
    ]
    failed, placeholder = events[-2], events[-1]
    assert isinstance(failed, ev.SessionFailed) and isinstance(placeholder, ev.PlaceholderEmitted)
    assert failed.reason == reason == placeholder.reason
    assert failed.error_type == type(error).__qualname__
    assert failed.message == (str(error) or repr(error))
    assert failed.discarded_trajectories == 1
    assert s.state == "failed" and s.view.failure_reason == reason
    assert placeholder.reward == 0.0 and placeholder.finished is False
    assert placeholder.reward_info == {"acc": 1.0, "reward": 0.0, "finished": False}
    await assert_fold_matches(ledger, s)


async def test_invalid_input_raised_inside_a_session_fails_it_as_invalid_output(
    ledger: Any, ids: Any
) -> None:
    with pytest.raises(InvalidInput) as info:
        async with ledger.session(ids("s-bad-output"), **kw()) as s:
            await s.record_trajectory(prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 2])
    assert info.value.field == "response_mask"
    assert await types(ledger, ids("s-bad-output")) == [
        "SessionCreated",
        "SessionStarted",
        "SessionFailed",
        "PlaceholderEmitted",
    ]
    failed = (await stream(ledger, ids("s-bad-output")))[2]
    assert isinstance(failed, ev.SessionFailed)
    assert failed.reason == "invalid_output" and failed.error_type == "InvalidInput"
    assert "response_mask" in failed.message
    assert s.state == "failed"


async def test_session_context_completes_on_normal_exit(ledger: Any, ids: Any) -> None:
    async with ledger.session(ids("s-ok"), **kw()) as s:
        await s.record_trajectory(
            prompt_ids=[1, 2, 3], response_ids=[4, 5], response_mask=[1, 0], num_turns=2
        )
        await s.post_reward(1.0, acc=1.0)
    assert s.state == "succeeded"
    succeeded = (await stream(ledger, ids("s-ok")))[-1]
    assert isinstance(succeeded, ev.SessionSucceeded)
    assert (
        succeeded.selected == [0]
        and succeeded.score == 1.0
        and succeeded.score_source == "reward_info"
    )
    await assert_fold_matches(ledger, s)


async def test_session_context_without_trajectory_is_an_empty_output_failure(
    ledger: Any, ids: Any
) -> None:
    async with ledger.session(ids("s-empty"), **kw()) as s:
        await s.post_reward(1.0)
    assert s.state == "failed" and s.view.failure_reason == "empty_output"
    events = await stream(ledger, ids("s-empty"))
    assert [e.TYPE for e in events][-2:] == ["SessionFailed", "PlaceholderEmitted"]
    assert events[-2].reason == "empty_output"  # type: ignore[attr-defined]
    assert "SessionSucceeded" not in [e.TYPE for e in events]


async def test_session_context_respects_an_explicit_end(ledger: Any, ids: Any) -> None:
    async with ledger.session(ids("s-explicit"), **kw()) as s:
        await s.record_trajectory(prompt_ids=[1], response_ids=[2])
        await s.fail("sandbox_error", message="tool crashed")
    async with ledger.session(ids("s-explicit-error"), **kw()) as t:
        await t.cancel("not needed")
    # an exception after the session ended is re-raised but records nothing more
    with pytest.raises(RuntimeError):
        async with ledger.session(ids("s-after-end"), **kw()) as u:
            await u.record_trajectory(prompt_ids=[1], response_ids=[2])
            await u.complete()
            raise RuntimeError("late")
    assert (await types(ledger, ids("s-explicit")))[-2:] == ["SessionFailed", "PlaceholderEmitted"]
    assert s.view.failure_reason == "sandbox_error"
    assert (await types(ledger, ids("s-explicit-error")))[-1] == "SessionCancelled"
    assert (await types(ledger, ids("s-after-end")))[-1] == "SessionSucceeded"
    assert u.state == "succeeded"


# ------------------------------------------------------------------ run_session
async def test_run_session_records_failures_without_raising(ledger: Any, ids: Any) -> None:
    boom = RuntimeError("runner exploded")

    async def crashing(handle: Any) -> None:
        await handle.record_trajectory(prompt_ids=[1], response_ids=[2])
        raise boom

    async def sandboxed(handle: Any) -> None:
        raise SandboxError("no sandbox")

    async def good(handle: Any) -> None:
        await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3])
        await handle.post_reward(0.5, acc=0.5)

    async def explicit(handle: Any) -> None:
        await handle.fail("finalize_error", message="reward model down")

    outcome = await ledger.run_session(crashing, ids("r-crash"), **kw())
    assert (outcome.session_id, outcome.state, outcome.failure_reason) == (
        ids("r-crash"),
        "failed",
        "runner_error",
    )
    assert outcome.error is boom and not outcome.succeeded
    outcome = await ledger.run_session(sandboxed, ids("r-sandbox"), **kw())
    assert (outcome.state, outcome.failure_reason) == ("failed", "sandbox_error")
    outcome = await ledger.run_session(good, ids("r-good"), **kw())
    assert outcome.succeeded and outcome.failure_reason is None and outcome.error is None
    outcome = await ledger.run_session(explicit, ids("r-explicit"), **kw())
    assert (outcome.state, outcome.failure_reason) == ("failed", "finalize_error")
    for sid in (ids("r-crash"), ids("r-sandbox"), ids("r-explicit")):
        names = await types(ledger, sid)
        assert names.count("SessionFailed") == 1 and names.count("PlaceholderEmitted") == 1, (
            sid,
            names,
        )
    assert (await types(ledger, ids("r-good")))[-1] == "SessionSucceeded"


async def test_run_session_timeout_records_timeout_and_returns(ledger: Any, ids: Any) -> None:
    reached_end = False

    async def slow(handle: Any) -> None:
        nonlocal reached_end
        await handle.record_trajectory(prompt_ids=[1], response_ids=[2])
        await asyncio.sleep(10)
        reached_end = True

    began = time.monotonic()
    outcome = await ledger.run_session(slow, ids("r-slow"), timeout=0.05, **kw())
    elapsed = time.monotonic() - began
    assert elapsed < 5, f"the timeout did not interrupt the runner ({elapsed:.1f}s)"
    assert not reached_end
    assert (outcome.state, outcome.failure_reason) == ("failed", "timeout")
    assert isinstance(outcome.error, TimeoutError)
    events = await stream(ledger, ids("r-slow"))
    assert [e.TYPE for e in events] == [
        "SessionCreated",
        "SessionStarted",
        "TrajectoryRecorded",
        "SessionFailed",
        "PlaceholderEmitted",
    ]
    started, failed = events[1], events[3]
    assert isinstance(started, ev.SessionStarted) and started.timeout_s == 0.05
    assert (
        isinstance(failed, ev.SessionFailed)
        and failed.reason == "timeout"
        and failed.discarded_trajectories == 1
    )


async def test_timeout_during_appends_keeps_the_handle_in_step_with_the_log(
    ledger: Any, ids: Any
) -> None:
    handles: list[Any] = []

    async def busy(handle: Any) -> None:
        handles.append(handle)
        for i in range(100_000):
            await handle.record_trajectory(prompt_ids=[1, i + 1], response_ids=[2])

    outcome = await ledger.run_session(busy, ids("r-busy"), timeout=0.2, **kw())
    assert (outcome.state, outcome.failure_reason) == ("failed", "timeout")
    events = await stream(ledger, ids("r-busy"))
    recorded = sum(isinstance(e, ev.TrajectoryRecorded) for e in events)
    assert recorded >= 1
    failed = events[-2]
    assert isinstance(failed, ev.SessionFailed) and failed.discarded_trajectories == recorded
    assert [e.index for e in events if isinstance(e, ev.TrajectoryRecorded)] == list(
        range(recorded)
    )
    await assert_fold_matches(ledger, handles[0])


# ------------------------------------------------------------------ cancellation
async def test_cancelling_a_session_context_records_cancelled_and_reraises(
    ledger: Any, ids: Any
) -> None:
    inside = asyncio.Event()
    handles: list[Any] = []

    async def work() -> None:
        async with ledger.session(ids("c-ctx"), **kw()) as s:
            handles.append(s)
            await s.record_trajectory(prompt_ids=[1], response_ids=[2])
            inside.set()
            await asyncio.sleep(10)

    task = asyncio.ensure_future(work())
    await asyncio.wait_for(inside.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    names = await types(ledger, ids("c-ctx"))
    assert names == ["SessionCreated", "SessionStarted", "TrajectoryRecorded", "SessionCancelled"]
    assert handles[0].state == "cancelled"
    cancelled = (await stream(ledger, ids("c-ctx")))[-1]
    assert isinstance(cancelled, ev.SessionCancelled) and "CancelledError" in (
        cancelled.message or ""
    )
    await assert_fold_matches(ledger, handles[0])


async def test_cancelling_run_session_records_cancelled_and_reraises(ledger: Any, ids: Any) -> None:
    inside = asyncio.Event()
    handles: list[Any] = []

    async def runner(handle: Any) -> None:
        handles.append(handle)
        inside.set()
        await asyncio.sleep(10)

    task = asyncio.ensure_future(ledger.run_session(runner, ids("c-run"), timeout=30, **kw()))
    await asyncio.wait_for(inside.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    names = await types(ledger, ids("c-run"))
    assert names == ["SessionCreated", "SessionStarted", "SessionCancelled"]
    assert "PlaceholderEmitted" not in names and "SessionFailed" not in names
    assert handles[0].state == "cancelled"


async def test_cancellation_during_appends_keeps_the_handle_in_step_with_the_log(
    ledger: Any, ids: Any
) -> None:
    """Cancel a runner that appends non-stop: whatever committed is in the view, and nothing more."""
    handles: list[Any] = []
    progress = asyncio.Event()

    async def busy(handle: Any) -> None:
        handles.append(handle)
        for i in range(1000):
            await handle.record_trajectory(prompt_ids=[1, i + 1], response_ids=[2])
            if i == 3:
                progress.set()

    for attempt in range(3):
        sid = ids(f"c-busy-{attempt}")
        handles.clear()
        progress.clear()
        task = asyncio.ensure_future(ledger.run_session(busy, sid, **kw()))
        await asyncio.wait_for(progress.wait(), 5)
        for _ in range(attempt):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        names = await types(ledger, sid)
        assert names[-1] == "SessionCancelled" and names.count("SessionCancelled") == 1
        assert "SessionFailed" not in names and "PlaceholderEmitted" not in names
        await assert_fold_matches(ledger, handles[0])


# ------------------------------------------------------------------ input validation
BAD_IDENTITIES = [
    ("uid", {"uid": "prompt_7"}),
    ("uid", {"uid": ""}),
    ("session_index", {"session_index": 4, "group_size": 4}),
    ("session_index", {"session_index": -1}),
    ("group_size", {"group_size": 0}),
    ("partition", {"partition": "test"}),
    ("global_step", {"global_step": -1}),
    ("run", {"run": ""}),
    ("session_id", {"session_id": ""}),
    ("session_id", {"session_id": "x" * 129}),
    ("metadata", {"metadata": {"t": float("nan")}}),
]


async def test_invalid_identities_are_rejected_and_nothing_is_written(
    ledger: Any, ids: Any
) -> None:
    position = await ledger.store.last_position()
    for field, overrides in BAD_IDENTITIES:
        kwargs = kw(**{"group_size": 4, **overrides})
        sid = kwargs.pop("session_id", ids("s-id"))
        with pytest.raises(InvalidInput) as info:
            await ledger.create_session(sid, **kwargs)
        assert isinstance(info.value, ValueError)
        assert info.value.field == field, (field, overrides, str(info.value))
        assert field in str(info.value)
    # run_session and session() validate the same way, before running anything
    ran = False

    async def runner(handle: Any) -> None:
        nonlocal ran
        ran = True

    with pytest.raises(InvalidInput, match="uid"):
        await ledger.run_session(runner, ids("s-id"), **kw(uid="a_b"))
    with pytest.raises(InvalidInput, match="partition"):
        async with ledger.session(ids("s-id"), **kw(partition="test")):
            ran = True
    assert not ran
    assert await ledger.store.last_position() == position


BAD_TRAJECTORIES = [
    ("prompt_ids", {"prompt_ids": [1, -1]}),
    ("prompt_ids", {"prompt_ids": []}),
    ("prompt_ids", {"prompt_ids": [[1, 2], [3, 4]]}),
    ("prompt_ids", {"prompt_ids": [1.5, 2.0]}),
    ("prompt_ids", {"prompt_ids": ["a", "b"]}),
    ("response_ids", {"response_ids": [2**31]}),
    ("response_ids", {"response_ids": [2**40, 3]}),
    ("response_ids", {"response_ids": []}),
    ("response_mask", {"response_mask": [1]}),
    ("response_mask", {"response_mask": [1, 1, 1]}),
    ("response_mask", {"response_mask": [1, 2]}),
    ("response_mask", {"response_mask": [0, -1]}),
    ("response_logprobs", {"response_logprobs": [0.0, float("nan")]}),
    ("response_logprobs", {"response_logprobs": [-0.5]}),
    ("num_turns", {"num_turns": -1}),
    ("extra", {"extra": {"x": float("inf")}}),
]


async def test_invalid_trajectories_and_rewards_are_rejected_and_nothing_is_written(
    ledger: Any, ids: Any
) -> None:
    handle = await ledger.create_session(ids("s-inputs"), **kw())
    version, position = handle.version, await ledger.store.last_position()
    good = {"prompt_ids": [1, 2], "response_ids": [3, 4]}
    for field, overrides in BAD_TRAJECTORIES:
        with pytest.raises(InvalidInput) as info:
            await handle.record_trajectory(**{**good, **overrides})
        assert info.value.field == field, (field, overrides, str(info.value))
        assert field in str(info.value) and ids("s-inputs") in str(info.value)
    for bad in (float("nan"), float("inf"), -math.inf, "1.0", True, np.float32("nan")):
        with pytest.raises(InvalidInput) as info:
            await handle.post_reward(bad)  # type: ignore[arg-type]
        assert info.value.field == "reward", bad
    with pytest.raises(InvalidInput, match="info"):
        await handle.post_reward(1.0, acc=float("nan"))
    with pytest.raises(InvalidInput, match="score"):
        await handle.complete(score=float("nan"))
    with pytest.raises(InvalidInput, match="trajectory_selection"):
        await handle.complete(trajectory_selection="best")
    with pytest.raises(InvalidInput, match="reason"):
        await handle.fail("Bad Luck")  # a custom reason is a lowercase name
    assert handle.version == version and handle.state == "running"
    assert await ledger.store.stream_version(ids("s-inputs")) == version
    assert await ledger.store.last_position() == position
    # the session is still usable: valid input of several kinds goes through
    await handle.record_trajectory(
        prompt_ids=np.array([0, 2**31 - 1]),
        response_ids=[5.0, 6.0],
        response_mask=np.array([True, False]),
        response_logprobs=[-0.5, -0.25],
    )
    await handle.post_reward(np.float64(0.5))
    assert await handle.complete() == "succeeded"
    await assert_fold_matches(ledger, handle)


async def test_torch_tensors_are_accepted(ledger: Any, ids: Any) -> None:
    torch = pytest.importorskip("torch")
    handle = await ledger.create_session(ids("s-torch"), **kw())
    await handle.record_trajectory(
        prompt_ids=torch.tensor([1, 2, 3]),
        response_ids=torch.tensor([4, 5]),
        response_mask=torch.tensor([1, 0]),
    )
    arrays = (await stream(ledger, ids("s-torch")))[-1].arrays()  # type: ignore[attr-defined]
    assert arrays.prompt_ids.tolist() == [1, 2, 3] and arrays.response_mask.tolist() == [1, 0]


async def test_duplicate_session_id_is_rejected_and_nothing_is_written(
    ledger: Any, ids: Any
) -> None:
    dup = ids("dup")
    identity = kw()
    first = await ledger.create_session(dup, **identity)
    await first.record_trajectory(prompt_ids=[1], response_ids=[2])
    position = await ledger.store.last_position()
    # the same id again, in another group or in its own (same slot): the id is what is refused
    for again in (kw(), identity):
        for start in (True, False):
            with pytest.raises(InvalidInput) as info:
                await ledger.create_session(dup, **again, start=start)
            assert info.value.field == "session_id" and dup in str(info.value)
    assert await ledger.store.last_position() == position
    await first.complete()
    position = await ledger.store.last_position()
    with pytest.raises(InvalidInput, match="session_id"):
        await ledger.run_session(lambda h: asyncio.sleep(0), dup, **kw())
    assert await ledger.store.last_position() == position
    stored = await ledger.store.read_stream(dup)
    assert [e.type for e in stored] == [
        "SessionCreated",
        "SessionStarted",
        "TrajectoryRecorded",
        "SessionSucceeded",
    ]
    assert all(e.uid == identity["uid"] for e in stored)


async def test_load_session_of_an_unknown_id_is_invalid_input(ledger: Any, ids: Any) -> None:
    with pytest.raises(InvalidInput, match="no such session"):
        await ledger.load_session(ids("never-created"))


# ------------------------------------------------------------------ terminal sessions
async def _terminal_sessions(ledger: Any, ids: Any) -> dict[str, Any]:
    succeeded = await ledger.create_session(ids("t-succeeded"), **kw())
    await succeeded.record_trajectory(prompt_ids=[1], response_ids=[2])
    await succeeded.complete()
    failed = await ledger.create_session(ids("t-failed"), **kw())
    await failed.fail("timeout")
    cancelled = await ledger.create_session(ids("t-cancelled"), **kw(), start=False)
    await cancelled.cancel()
    return {"succeeded": succeeded, "failed": failed, "cancelled": cancelled}


COMMANDS_ON_HANDLE: dict[str, Any] = {
    "start": lambda h: h.start(),
    "record_trajectory": lambda h: h.record_trajectory(prompt_ids=[1], response_ids=[2]),
    "post_reward": lambda h: h.post_reward(1.0),
    "complete": lambda h: h.complete(),
    "fail": lambda h: h.fail("runner_error"),
    "cancel": lambda h: h.cancel(),
}


async def test_commands_on_terminal_sessions_raise_and_append_nothing(
    ledger: Any, ids: Any
) -> None:
    handles = await _terminal_sessions(ledger, ids)
    position = await ledger.store.last_position()
    for state, handle in handles.items():
        assert handle.state == state and handle.terminal
        reloaded = await ledger.load_session(handle.session_id)
        for command, call in COMMANDS_ON_HANDLE.items():
            for target in (handle, reloaded):
                with pytest.raises(InvalidTransition) as info:
                    await call(target)
                error = info.value
                assert (error.session_id, error.state, error.command) == (
                    handle.session_id,
                    state,
                    command,
                )
                message = str(error)
                assert handle.session_id in message and state in message and command in message
        with pytest.raises(InvalidTransition):
            await handle.fail_with(RuntimeError("late"))
        assert handle.state == state
    assert await ledger.store.last_position() == position


async def test_commands_from_created_state(ledger: Any, ids: Any) -> None:
    handle = await ledger.create_session(ids("t-created"), **kw(), start=False)
    assert handle.state == "created"
    for command in ("record_trajectory", "post_reward", "complete"):
        with pytest.raises(InvalidTransition) as info:
            await COMMANDS_ON_HANDLE[command](handle)
        assert (info.value.state, info.value.command) == ("created", command)
    await handle.start(attempt=2, timeout_s=3.0)
    started = (await stream(ledger, ids("t-created")))[-1]
    assert started == ev.SessionStarted(attempt=2, timeout_s=3.0)
    await handle.record_trajectory(prompt_ids=[1], response_ids=[2])
    assert await handle.complete() == "succeeded"
    # a session that failed before it started still gets its placeholder
    never = await ledger.create_session(ids("t-never-started"), **kw(), start=False)
    await never.fail("sandbox_error")
    assert await types(ledger, ids("t-never-started")) == [
        "SessionCreated",
        "SessionFailed",
        "PlaceholderEmitted",
    ]


# ------------------------------------------------------------------ rewards
async def test_reward_info_merges_across_reward_events(ledger: Any, ids: Any) -> None:
    handle = await ledger.create_session(ids("rw-merge"), **kw())
    await handle.record_trajectory(prompt_ids=[1], response_ids=[2])
    await handle.post_reward(0.5, acc=1.0, lang="py")
    await handle.post_reward(0.75, steps=3)
    await handle.post_reward(0.75, acc=0.0, tests={"passed": 2})
    expected = {"acc": 0.0, "lang": "py", "steps": 3, "tests": {"passed": 2}, "reward": 0.75}
    assert handle.view.reward_info == expected
    posted = [e for e in await stream(ledger, ids("rw-merge")) if isinstance(e, ev.RewardPosted)]
    assert [p.info for p in posted] == [
        {"acc": 1.0, "lang": "py"},
        {"steps": 3},
        {"acc": 0.0, "tests": {"passed": 2}},
    ]
    await assert_fold_matches(ledger, handle)
    # a failure afterwards keeps the diagnostics on the placeholder, reward and finished forced
    await handle.fail("finalize_error")
    placeholder = (await stream(ledger, ids("rw-merge")))[-1]
    assert isinstance(placeholder, ev.PlaceholderEmitted)
    assert placeholder.reward_info == {**expected, "reward": 0.0, "finished": False}
    assert placeholder.reward == 0.0 and placeholder.token_id == ledger.policy.token_id


async def test_absent_reward_stays_distinct_from_zero(ledger: Any, ids: Any) -> None:
    async def session(sid: str, *rewards: float | None, score: float | None = None) -> Any:
        handle = await ledger.create_session(sid, **kw())
        await handle.record_trajectory(prompt_ids=[1], response_ids=[2])
        for reward in rewards:
            await handle.post_reward(reward)
        await handle.complete(score=score)
        return handle

    zero = await session(ids("rw-zero"), 0.0)
    never = await session(ids("rw-never"))
    none = await session(ids("rw-none"), None)
    external = await session(ids("rw-external"), 0.5, score=0.0)
    overwritten = await session(ids("rw-last-none"), 1.0, None)
    assert (zero.view.score, zero.view.score_source) == (0.0, "reward_info")
    assert zero.view.reward == 0.0 and zero.view.reward_posted
    assert (never.view.score, never.view.score_source) == (None, "absent")
    assert never.view.reward is None and not never.view.reward_posted
    assert (none.view.score, none.view.score_source) == (None, "absent")
    assert none.view.reward_posted and none.view.reward_info == {"reward": None}
    assert (external.view.score, external.view.score_source) == (0.0, "external")
    assert overwritten.view.score_source == "absent"
    for handle in (zero, never, none, external, overwritten):
        succeeded = (await stream(ledger, handle.session_id))[-1]
        assert isinstance(succeeded, ev.SessionSucceeded)
        assert (succeeded.score, succeeded.score_source) == (
            handle.view.score,
            handle.view.score_source,
        )
        await assert_fold_matches(ledger, handle)


async def test_failure_message_is_truncated(ledger: Any, ids: Any) -> None:
    async def runner(handle: Any) -> None:
        raise RuntimeError("x" * 5000)

    await ledger.run_session(runner, ids("msg-long"), **kw())
    failed = [e for e in await stream(ledger, ids("msg-long")) if isinstance(e, ev.SessionFailed)][
        0
    ]
    assert len(failed.message) == ev.MESSAGE_LIMIT and failed.message == "x" * ev.MESSAGE_LIMIT


async def test_failure_fields_fit_the_read_model_columns(ledger: Any, ids: Any) -> None:
    """A huge exception class name must not produce an event the sessions table cannot hold."""
    from store.schema.tables import sessions as sessions_table

    long_error = type("E" * 300, (Exception,), {})

    async def runner(handle: Any) -> None:
        raise long_error("m" * 600)

    outcome = await ledger.run_session(runner, ids("long-error"), **kw())
    assert outcome.state == "failed"
    failed = [
        e for e in await stream(ledger, ids("long-error")) if isinstance(e, ev.SessionFailed)
    ][0]
    assert failed.error_type is not None and failed.error_type.startswith("EEEE")
    assert len(failed.error_type) <= sessions_table.c.error_type.type.length
    assert len(failed.message) <= sessions_table.c.message.type.length
    handle = await ledger.create_session(ids("long-error-type"), **kw())
    await handle.fail("runner_error", error_type="X" * 1000)
    assert len(handle.view.error_type or "") <= sessions_table.c.error_type.type.length
