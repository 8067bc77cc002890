"""The session state machine (docs/design.md §3): transition table, diagram, and property tests.

Random command sequences — valid and invalid order — run against an independent reference
model of the design, twice: through the pure deciders of `sessions.aggregate` (fast, many
examples) and through the real recorder on a SQLite store (fewer examples).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import aggregate as agg
from sessions import events as ev
from sessions import machine, tokens
from sessions.errors import InvalidTransition
from sessions.placeholder import PlaceholderPolicy

# The design's table (docs/design.md §3), written out independently of sessions.machine.
DESIGN_TABLE = {
    ("created", "start"): "running",
    ("created", "fail"): "failed",
    ("created", "cancel"): "cancelled",
    ("running", "start_call"): "running",  # a model call: intent, then record or failure (§15)
    ("running", "record_call"): "running",
    ("running", "fail_call"): "running",
    ("running", "record_trajectory"): "running",
    ("running", "post_reward"): "running",
    ("running", "complete"): "succeeded",
    ("running", "fail"): "failed",
    ("running", "cancel"): "cancelled",
    # retries: a failed attempt is superseded and the session waits for its next start
    ("running", "retry"): "retrying",
    ("retrying", "start"): "running",
    ("retrying", "fail"): "failed",
    ("retrying", "cancel"): "cancelled",
}
TERMINAL = {"succeeded", "failed", "cancelled"}
POLICIES = {
    "default": PlaceholderPolicy(),
    "drop": PlaceholderPolicy(default="drop"),
    "partial": PlaceholderPolicy(default="keep_partial", prompt_length=3, response_length=2),
}


# ------------------------------------------------------------------ the table and the diagram
def test_machine_table_is_the_designed_one() -> None:
    assert machine.TABLE == DESIGN_TABLE
    assert set(machine.STATES) == {
        "created",
        "running",
        "retrying",
        "succeeded",
        "failed",
        "cancelled",
    }
    assert machine.TERMINAL_STATES == TERMINAL
    for state in TERMINAL:
        assert machine.allowed(state) == []
    assert machine.allowed("created") == ["start", "fail", "cancel"]


@pytest.mark.parametrize(
    "state", ["created", "running", "retrying", "succeeded", "failed", "cancelled"]
)
@pytest.mark.parametrize("command", list(machine.COMMANDS))
def test_next_state_follows_the_table_or_names_session_state_and_command(
    state: str, command: str
) -> None:
    if (state, command) in DESIGN_TABLE:
        assert machine.next_state("s-1", state, command) == DESIGN_TABLE[(state, command)]
        return
    with pytest.raises(InvalidTransition) as info:
        machine.next_state("s-1", state, command)
    error = info.value
    assert (error.session_id, error.state, error.command) == ("s-1", state, command)
    assert "s-1" in str(error) and state in str(error) and command in str(error)


def _mermaid_edges(diagram: str) -> set[tuple[str, str, str]]:
    edges = set()
    for line in diagram.splitlines():
        match = re.match(r"\s*(\w+)\s*-->\s*(\w+)\s*:\s*(.+?)\s*$", line)
        if match:
            source, dest, labels = match.groups()
            for label in labels.split("|"):
                edges.add((source, label.strip(), dest))
    return edges


def test_mermaid_diagram_has_every_state_and_transition() -> None:
    diagram = machine.mermaid()
    assert "stateDiagram" in diagram
    for state in machine.STATES:
        assert re.search(rf"\b{state}\b", diagram), f"state {state} missing from the diagram"
    drawn = _mermaid_edges(diagram)
    expected = {(source, trigger, dest) for (source, trigger), dest in machine.TABLE.items()}
    assert drawn == expected
    assert expected == {(s, t, d) for (s, t), d in DESIGN_TABLE.items()}


async def test_sessions_do_not_bind_models_to_the_shared_machine(sqlite_url: str) -> None:
    from sessions import Ledger

    async with Ledger.open(sqlite_url) as ledger:
        for i in range(3):
            handle = await ledger.create_session(
                f"m{i}", uid="u", session_index=i, group_size=3, partition="val"
            )
            await handle.cancel()
    assert machine.MACHINE.models == []


# ------------------------------------------------------------------ the reference model
@dataclass
class Model:
    """What the design says a session looks like after a sequence of commands."""

    state: str
    partition: str
    policy: PlaceholderPolicy
    #: the current attempt's trajectories: (index in the stream, prompt_len, response_len)
    trajectories: list[tuple[int, int, int]] = field(default_factory=list)
    recorded: int = 0
    reward_info: dict[str, Any] = field(default_factory=dict)
    last_reward: float | None = None
    reward_posted: bool = False
    failure_reason: str | None = None
    score: float | None = None
    score_source: str | None = None
    selected: list[int] = field(default_factory=list)
    placeholders: int = 0
    decision: str | None = None
    attempt: int = 0
    retries: list[str] = field(default_factory=list)
    superseded: int = 0

    def valid(self, command: str) -> bool:
        return (self.state, command) in DESIGN_TABLE

    def apply(self, cmd: tuple[Any, ...]) -> None:
        name = cmd[0]
        assert self.valid(name)
        if name == "start":
            self.state = "running"
            self.attempt += 1
        elif name == "retry":
            self.state = "retrying"
            self.retries.append(cmd[1])
            self.superseded += len(self.trajectories)
            self.trajectories, self.reward_info, self.last_reward, self.reward_posted = (
                [],
                {},
                None,
                False,
            )
        elif name == "record_trajectory":
            self.trajectories.append((self.recorded, cmd[1], cmd[2]))
            self.recorded += 1
        elif name == "post_reward":
            self.last_reward, self.reward_posted = cmd[1], True
            self.reward_info.update(cmd[2])
            self.reward_info["reward"] = cmd[1]
        elif name == "complete":
            score, selection = cmd[1], cmd[2]
            if not self.trajectories:
                self._fail("empty_output")
                return
            self.state = "succeeded"
            self.selected = self._select(selection)
            if score is not None:
                self.score, self.score_source = score, "external"
            elif self.last_reward is not None:
                self.score, self.score_source = self.last_reward, "reward_info"
            else:
                self.score, self.score_source = None, "absent"
        elif name == "fail":
            self._fail(cmd[1])
        elif name == "cancel":
            self.state = "cancelled"

    def _select(self, selection: str) -> list[int]:
        if selection == "all":
            return [index for index, _p, _r in self.trajectories]
        best = max(p + r for _i, p, r in self.trajectories)
        return [max(index for index, p, r in self.trajectories if p + r == best)]

    def _fail(self, reason: str) -> None:
        self.state = "failed"
        self.failure_reason = reason
        decision = self.policy.default  # the test policies have no rules
        if decision == "keep_partial":
            if self.trajectories and self.reward_posted and self.last_reward is not None:
                self.selected, self.score = self._select("all"), self.last_reward
            else:
                decision = "emit"
        self.decision = decision
        self.placeholders = 1 if decision == "emit" else 0


commands = st.one_of(
    st.tuples(st.just("start")),
    st.tuples(
        st.just("record_trajectory"), st.integers(1, 6), st.integers(1, 6), st.integers(0, 4)
    ),
    st.tuples(
        st.just("post_reward"),
        st.one_of(st.none(), st.floats(-2, 2, allow_nan=False)),
        st.dictionaries(st.sampled_from(["acc", "steps", "lang"]), st.integers(0, 9), max_size=2),
    ),
    st.tuples(
        st.just("complete"),
        st.one_of(st.none(), st.floats(0, 1)),
        st.sampled_from(["all", "longest"]),
    ),
    st.tuples(st.just("fail"), st.sampled_from(ev.FAILURE_REASONS)),
    st.tuples(st.just("retry"), st.sampled_from(("sandbox_error", "runner_error", "tool_quota"))),
    st.tuples(st.just("cancel")),
)
scenarios = st.fixed_dictionaries(
    {
        "started": st.booleans(),
        "partition": st.sampled_from(["train", "val"]),
        "policy": st.sampled_from(sorted(POLICIES)),
        "commands": st.lists(commands, max_size=12),
    }
)


def _trajectory_event(
    index: int, prompt_len: int, response_len: int, num_turns: int
) -> ev.TrajectoryRecorded:
    arrays = tokens.TokenArrays(
        np.arange(1, prompt_len + 1),
        np.arange(100, 100 + response_len),
        np.ones(response_len, dtype=np.uint8),
        None,
    )
    return ev.TrajectoryRecorded(
        index=index,
        num_turns=num_turns,
        prompt_len=prompt_len,
        response_len=response_len,
        has_logprobs=False,
        payload=tokens.encode(arrays),
    )


def check_against_model(
    events: list[ev.Event], view: agg.SessionView, model: Model, policy_name: str
) -> None:
    """The invariants of docs/design.md §3–5 on one session's stream and folded view."""
    types = [e.TYPE for e in events]
    terminal_at = [i for i, t in enumerate(types) if t in ev.TERMINAL_EVENTS]
    assert len(terminal_at) <= 1, f"more than one terminal event: {types}"
    if terminal_at:
        tail = types[terminal_at[0] + 1 :]
        # nothing after the terminal event but the failed session's placeholder
        assert tail in ([], ["PlaceholderEmitted"]), types
        if tail:
            assert types[terminal_at[0]] == "SessionFailed"
    placeholders = types.count("PlaceholderEmitted")

    assert view.state == model.state
    assert view.terminal == (model.state in TERMINAL)
    assert [t.index for t in view.trajectories] == [index for index, _p, _r in model.trajectories]
    assert view.version == len(events)
    # attempts: one per start; each retry supersedes exactly the attempt's trajectories
    assert view.attempt == model.attempt == types.count("SessionStarted")
    assert [e.reason for e in events if isinstance(e, ev.AttemptFailed)] == model.retries
    assert [e.attempt for e in events if isinstance(e, ev.AttemptFailed)] == list(
        range(1, len(model.retries) + 1)
    )
    assert view.superseded == model.superseded
    indices = [e.index for e in events if isinstance(e, ev.TrajectoryRecorded)]
    assert indices == list(range(len(indices))), "trajectory indices count every attempt's"
    if model.state == "failed":
        assert types.count("SessionFailed") == 1
        assert view.failure_reason == model.failure_reason
        assert placeholders == model.placeholders == view.placeholder_emitted
        failed = next(e for e in events if isinstance(e, ev.SessionFailed))
        assert failed.placeholder == model.decision
        assert failed.origin == ev.DEFAULT_ORIGINS[model.failure_reason] and failed.metric == "zero"
        if (
            model.decision == "keep_partial"
        ):  # the final attempt's trajectories with its reward; never a superseded one
            assert (
                failed.selected == view.selected == model.selected and failed.score == model.score
            )
            assert set(failed.selected) <= {index for index, _p, _r in model.trajectories}
        assert failed.discarded_trajectories == len(model.trajectories) - len(failed.selected)
        if placeholders:
            emitted = events[-1]
            assert isinstance(emitted, ev.PlaceholderEmitted)
            assert (
                emitted.reason == model.failure_reason
                and emitted.reward == 0.0
                and emitted.finished is False
            )
            assert emitted.materialization_reason == "session_failed"
            assert emitted.reward_info == {**model.reward_info, "reward": 0.0, "finished": False}
            assert (emitted.prompt_len, emitted.response_len) == (
                model.policy.prompt_length,
                model.policy.response_length,
            )
    else:
        assert placeholders == 0 and view.placeholder_emitted == 0
        assert view.failure_reason is None
    if model.state == "cancelled":
        assert types[-1] == "SessionCancelled"
    if model.state == "succeeded":
        assert types[-1] == "SessionSucceeded"
        assert view.selected == model.selected
        assert view.score == model.score and view.score_source == model.score_source
        assert model.trajectories, "succeeded without a trajectory"
    assert view.reward_info == model.reward_info
    assert view.reward_posted == model.reward_posted


# ------------------------------------------------------------------ pure, in memory
@settings(max_examples=300, deadline=None)
@given(scenario=scenarios)
def test_deciders_against_the_reference_model(scenario: dict[str, Any]) -> None:
    policy = POLICIES[scenario["policy"]]
    sid = "s-pure"
    log: list[ev.Event] = [
        ev.SessionCreated(
            run="r",
            uid="u",
            session_index=0,
            group_size=1,
            partition=scenario["partition"],
            global_step=0,
        )
    ]
    if scenario["started"]:
        log.append(ev.SessionStarted())
    live = agg.fold(sid, log)
    model = Model(
        state=live.state,
        partition=scenario["partition"],
        policy=policy,
        attempt=int(scenario["started"]),
    )

    for cmd in scenario["commands"]:
        name = cmd[0]
        state_before, length_before = live.state, len(log)
        try:
            if name == "start":
                decided = agg.decide_start(live)
            elif name == "retry":
                decided = agg.decide_retry(
                    live, cmd[1], ev.DEFAULT_ORIGINS.get(cmd[1], "policy"), message="flaky"
                )
            elif name == "record_trajectory":
                decided = agg.decide_trajectory(live, _trajectory_event(live.recorded, *cmd[1:]))
            elif name == "post_reward":
                decided = agg.decide_reward(live, cmd[1], dict(cmd[2]))
            elif name == "complete":
                decided = agg.decide_complete(live, policy, score=cmd[1], selection=cmd[2])
            elif name == "fail":
                decided = agg.decide_fail(live, policy, cmd[1], message="boom")
            else:
                decided = agg.decide_cancel(live)
        except InvalidTransition as error:
            assert not model.valid(name), f"{name} rejected in {state_before}"
            assert (error.session_id, error.state, error.command) == (sid, state_before, name)
            assert len(log) == length_before and live.state == state_before
            continue
        assert model.valid(name), f"{name} accepted in {state_before}"
        assert decided, "an accepted command decides at least one event"
        log.extend(decided)
        for event in decided:
            live.apply(event)
        model.apply(cmd)

    check_against_model(log, live, model, scenario["policy"])
    assert agg.fold(sid, log) == live


def test_complete_without_trajectory_is_an_empty_output_failure() -> None:
    view = agg.fold(
        "s",
        [
            ev.SessionCreated(
                run="r", uid="u", session_index=0, group_size=1, partition="val", global_step=0
            ),
            ev.SessionStarted(),
            ev.RewardPosted(reward=1.0, info={"acc": 1.0}),
        ],
    )
    decided = agg.decide_complete(view, PlaceholderPolicy())
    assert [e.TYPE for e in decided] == ["SessionFailed", "PlaceholderEmitted"]
    assert decided[0].reason == "empty_output" and decided[1].reason == "empty_output"
    for event in decided:
        view.apply(event)
    assert view.state == "failed" and view.failure_reason == "empty_output"


def test_placeholder_policy_rules_per_partition_and_reason() -> None:
    policy = PlaceholderPolicy(
        rules={"train": {"sandbox_error": "drop"}, "*": {"orphaned": "drop"}}
    )
    base = [
        ev.SessionCreated(
            run="r", uid="u", session_index=0, group_size=1, partition="train", global_step=0
        ),
        ev.SessionStarted(),
    ]
    train = agg.fold("t", base)
    val = agg.fold(
        "v",
        [
            ev.SessionCreated(
                run="r", uid="u", session_index=0, group_size=1, partition="val", global_step=0
            )
        ],
    )
    assert [e.TYPE for e in agg.decide_fail(train, policy, "sandbox_error")] == ["SessionFailed"]
    assert [e.TYPE for e in agg.decide_fail(train, policy, "timeout")] == [
        "SessionFailed",
        "PlaceholderEmitted",
    ]
    assert [e.TYPE for e in agg.decide_fail(val, policy, "sandbox_error")] == [
        "SessionFailed",
        "PlaceholderEmitted",
    ]
    assert [e.TYPE for e in agg.decide_fail(val, policy, "orphaned")] == ["SessionFailed"]
    with pytest.raises(ValueError):
        PlaceholderPolicy(rules={"test": {"timeout": "drop"}})
    with pytest.raises(ValueError):
        PlaceholderPolicy(rules={"train": {"timeout": "keep"}})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "reason", ["Bad Luck", "infra", "policy", "*", "unprojectable", "", "x" * 33, 7]
)
def test_a_reason_that_cannot_name_a_failure_is_rejected(reason: Any) -> None:
    from sessions.errors import InvalidInput

    view = agg.fold(
        "s",
        [
            ev.SessionCreated(
                run="r", uid="u", session_index=0, group_size=1, partition="val", global_step=0
            )
        ],
    )
    with pytest.raises(InvalidInput, match="reason"):
        agg.decide_fail(view, PlaceholderPolicy(), reason)
    assert view.state == "created"


def test_a_custom_reason_is_a_policy_failure_unless_declared() -> None:
    view = agg.fold(
        "s",
        [
            ev.SessionCreated(
                run="r", uid="u", session_index=0, group_size=1, partition="val", global_step=0
            )
        ],
    )
    assert agg.decide_fail(view, PlaceholderPolicy(), "tool_quota")[0].origin == "policy"
    assert (
        agg.decide_fail(view, PlaceholderPolicy(), "tool_quota", origin="infra")[0].origin
        == "infra"
    )


# ------------------------------------------------------------------ through the real SQLite store
@dataclass
class Harness:
    loop: asyncio.AbstractEventLoop
    ledgers: dict[str, Any]
    counter: int = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)


@pytest.fixture
def sqlite_harness(sqlite_url: str) -> Iterator[Harness]:
    """One SQLite file and a private event loop shared by every hypothesis example of a test."""
    from sessions import Ledger

    loop = asyncio.new_event_loop()
    opener = Ledger.open(sqlite_url)
    ledger = loop.run_until_complete(opener.__aenter__())
    # one run per policy: a run's configuration is fingerprinted, so two policies cannot share one
    others = {
        name: Ledger(ledger.engine, run=f"run-{name}", placeholder_policy=POLICIES[name])
        for name in POLICIES
        if name != "default"
    }
    try:
        yield Harness(loop, {"default": ledger, **others})
    finally:
        for other in others.values():
            loop.run_until_complete(other.close())
        loop.run_until_complete(opener.__aexit__(None, None, None))
        loop.close()


async def _run_on_store(ledger: Any, sid: str, scenario: dict[str, Any]) -> None:
    store = ledger.store
    handle = await ledger.create_session(  # a group of its own per example: one group holds one session_index 0
        sid,
        uid=f"u-{sid}",
        session_index=0,
        group_size=1,
        partition=scenario["partition"],
        global_step=0,
        start=scenario["started"],
    )
    model = Model(
        state=handle.state,
        partition=scenario["partition"],
        policy=ledger.policy,
        attempt=int(scenario["started"]),
    )
    for cmd in scenario["commands"]:
        name = cmd[0]
        state_before = handle.state
        version_before = await store.stream_version(sid)
        length_before = len(await store.read_stream(sid))
        position_before = await store.last_position()
        try:
            if name == "start":
                await handle.start()
            elif name == "retry":
                await handle.retry(cmd[1], message="flaky")
            elif name == "record_trajectory":
                _, p, r, turns = cmd
                await handle.record_trajectory(
                    prompt_ids=list(range(1, p + 1)),
                    response_ids=list(range(100, 100 + r)),
                    num_turns=turns,
                )
            elif name == "post_reward":
                await handle.post_reward(cmd[1], **cmd[2])
            elif name == "complete":
                await handle.complete(score=cmd[1], trajectory_selection=cmd[2])
            elif name == "fail":
                await handle.fail(cmd[1], message="boom")
            else:
                await handle.cancel("stop")
        except InvalidTransition as error:
            assert not model.valid(name), f"{name} rejected in {state_before}"
            assert (error.session_id, error.state, error.command) == (sid, state_before, name)
            assert await store.stream_version(sid) == version_before == handle.version
            assert len(await store.read_stream(sid)) == length_before
            assert await store.last_position() == position_before
            assert handle.state == state_before
            continue
        assert model.valid(name), f"{name} accepted in {state_before}"
        model.apply(cmd)
        assert await store.stream_version(sid) == handle.version > version_before

    stored = await store.read_stream(sid)
    decoded = [ev.decode(s) for s in stored]
    assert [d.version for d in decoded] == list(range(1, len(decoded) + 1))
    folded = agg.fold(sid, (d.event for d in decoded))
    assert folded == handle.view
    check_against_model([d.event for d in decoded], folded, model, scenario["policy"])
    assert (await ledger.load_session(sid)).view == handle.view


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scenario=scenarios)
def test_recorder_on_sqlite_against_the_reference_model(
    sqlite_harness: Harness, scenario: dict[str, Any]
) -> None:
    sqlite_harness.counter += 1
    sid = f"prop-{sqlite_harness.counter}"
    sqlite_harness.run(_run_on_store(sqlite_harness.ledgers[scenario["policy"]], sid, scenario))
