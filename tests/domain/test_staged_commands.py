"""Staged commands (docs/design.md §4): a handle of `Ledger.session` or `Ledger.run_session`
acknowledges `record_trajectory` and `post_reward` without a round trip and appends their events
with the session's next durable command, in that command's one append.

What must hold, on both backends: the session costs two appends whatever it records; the log
and the handle's view agree once the session ended, and the log holds the same events as an
unstaged session's; until then the log stands at the last durable command (`durable_version`);
an append that carried staged events and failed leaves the log without any of them, and the
handle folds itself again from the log before its next command decides anything.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import Ledger, StoreError
from sessions import aggregate as agg
from sessions import events as ev
from store.log import event_store
from tests.domain.test_recorder import kw

SETTINGS = settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
#: what a runner records: trajectories and a reward, in any order
COMMANDS = st.lists(st.sampled_from(["trajectory", "reward"]), max_size=5)


@pytest.fixture
async def ledger(module_db_url: str) -> AsyncIterator[Ledger]:
    async with Ledger.open(module_db_url) as opened:
        yield opened


def counting(ledger: Ledger) -> list[int]:
    """The number of events of each session append the store is handed from now on (the run's
    configuration, recorded before the first session, is no session's)."""
    sizes: list[int] = []
    submit = ledger.store.submit

    def counted(session_id: str, expected: int, new_events: Any) -> Any:
        if not session_id.startswith("@run:"):
            sizes.append(len(new_events))
        return submit(session_id, expected, new_events)

    ledger.store.submit = counted  # type: ignore[method-assign]
    return sizes


async def stream(ledger: Ledger, sid: str) -> list[ev.Event]:
    return [ev.decode(s).event for s in await ledger.store.read_stream(sid)]


async def issue(handle: Any, commands: list[str], seen: Callable[[], Any] | None = None) -> None:
    for n, name in enumerate(commands):
        if name == "trajectory":
            await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4 + n])
        else:
            await handle.post_reward(float(n), step=n)
        if seen is not None:
            await seen()


def expected(commands: list[str]) -> list[str]:
    names = {"trajectory": "TrajectoryRecorded", "reward": "RewardPosted"}
    recorded = [names[c] for c in commands]
    if "TrajectoryRecorded" in recorded:
        return ["SessionCreated", "SessionStarted", *recorded, "SessionSucceeded"]
    return ["SessionCreated", "SessionStarted", *recorded, "SessionFailed", "PlaceholderEmitted"]


@SETTINGS
@given(commands=COMMANDS, through=st.sampled_from(["session", "run_session"]))
async def test_a_session_appends_twice_and_the_log_is_what_an_unstaged_one_holds(
    ledger: Ledger, commands: list[str], through: str
) -> None:
    sid = f"s-{uuid.uuid4().hex[:10]}"
    sizes = counting(ledger)
    handles: list[Any] = []

    async def only_durable_in_the_log() -> None:
        handle = handles[0]
        stored = await stream(ledger, sid)
        assert len(stored) == handle.durable_version == 2 < handle.version

    if through == "session":
        async with ledger.session(sid, **kw()) as handle:
            handles.append(handle)
            await issue(handle, commands, only_durable_in_the_log)
    else:

        async def runner(handle: Any) -> None:
            handles.append(handle)
            await issue(handle, commands, only_durable_in_the_log)

        await ledger.run_session(runner, sid, **kw())
    handle = handles[0]
    stored = await stream(ledger, sid)
    assert [e.TYPE for e in stored] == expected(commands)
    assert agg.fold(sid, stored) == handle.view
    assert handle.durable_version == handle.version == len(stored)
    assert len(sizes) == 2, f"appends of {sizes} events: the staged commands rode on the end's"
    assert sizes[1] == len(stored) - 2

    # the same commands on an unstaged handle: one append each, the same events
    other = f"u-{uuid.uuid4().hex[:10]}"
    sizes.clear()
    unstaged = await ledger.create_session(other, **kw())
    await issue(unstaged, commands)
    await unstaged.complete()
    assert [e.TYPE for e in await stream(ledger, other)] == expected(commands)
    assert len(sizes) == 2 + len(commands)


async def test_flush_makes_the_staged_commands_durable(ledger: Ledger) -> None:
    sid = f"s-{uuid.uuid4().hex[:10]}"
    async with ledger.session(sid, **kw()) as handle:
        await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4])
        await handle.post_reward(1.0)
        assert [e.TYPE for e in await stream(ledger, sid)] == ["SessionCreated", "SessionStarted"]
        await handle.flush()
        assert handle.durable_version == handle.version == 4
        assert agg.fold(sid, await stream(ledger, sid)) == handle.view
        await handle.flush()  # nothing staged: no append
        assert len(await stream(ledger, sid)) == 4


async def test_a_failed_append_of_staged_commands_leaves_none_and_the_handle_refolds(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = f"s-{uuid.uuid4().hex[:10]}"
    handle = await ledger.create_session(sid, **kw())
    handle._stage = True  # as `Ledger.session` makes it
    await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4])
    await handle.post_reward(1.0)
    assert handle.view.recorded == 1 and handle.view.reward_posted

    original = event_store.EventStore._commit_together

    async def refused(store: Any, batch: Any, careful: bool) -> Any:
        raise ValueError("the driver refused a value")  # not transient: no retry

    monkeypatch.setattr(event_store.EventStore, "_commit_together", refused)
    with pytest.raises(StoreError, match="refused a value"):
        await handle.complete()
    monkeypatch.setattr(event_store.EventStore, "_commit_together", original)
    assert [e.TYPE for e in await stream(ledger, sid)] == ["SessionCreated", "SessionStarted"]

    # the next command decides against the log, where no trajectory was recorded
    state = await handle.complete()
    stored = await stream(ledger, sid)
    assert state == "failed" and handle.view.recorded == 0 and not handle.view.reward_posted
    assert [e.TYPE for e in stored] == [
        "SessionCreated",
        "SessionStarted",
        "SessionFailed",
        "PlaceholderEmitted",
    ]
    assert agg.fold(sid, stored) == handle.view
