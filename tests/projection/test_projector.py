"""The projector (docs/design.md §5–7): rows, placeholders, group tags, metrics, exactly-once under faults,
concurrent projectors, `Ledger.batch` waiting, follow mode.

Scenarios are driven through the real recorder (`Ledger.session` as a context manager: normal
exit completes, an exception fails, cancellation cancels), one asyncio task per session, with
the interleaving of their commands chosen by a seeded random generator. Expectations come from
the scenario plan (rows, tags, states) and from the raw event log (metrics, via the brute-force
oracle in `tests/projection/test_metrics.py`), never from the projector's own output.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from sessions import Ledger, PlaceholderPolicy, SandboxError
from sessions import events as ev
from sessions.projection.projector import Projector
from sessions.queues.sinks import InProcessQueue
from store import create_engine
from store import read_models as rm
from store.schema.tables import checkpoints, groups, metric_counts, queue_rows, sessions
from tests.conftest import backend_of, wipe
from tests.projection.test_metrics import assert_metrics_match, read_events, stored_metrics

FAILURE_REASON = {
    "error": "runner_error",
    "sandbox": "sandbox_error",
    "timeout": "timeout",
    "empty": "empty_output",
}
POLICIES: dict[str, PlaceholderPolicy] = {
    "emit": PlaceholderPolicy(),
    "drop": PlaceholderPolicy(rules={"*": {"*": "drop"}}),
    "mixed": PlaceholderPolicy(rules={"train": {"sandbox_error": "drop", "empty_output": "drop"}}),
}
TOKEN_ID = 0  # PlaceholderPolicy's default token


def emits(policy: str, partition: str, reason: str) -> bool:
    """The placeholder decision each named policy should make (written out, not asked of the code)."""
    if policy == "emit":
        return True
    if policy == "drop":
        return False
    return not (partition == "train" and reason in ("sandbox_error", "empty_output"))


# ------------------------------------------------------------------------------------------
# scenarios
# ------------------------------------------------------------------------------------------


@dataclass
class Traj:
    prompt: list[int]
    response: list[int]
    mask: list[int]


@dataclass
class SessionPlan:
    sid: str
    index: int
    trajectories: list[Traj]
    rewards: list[float | None]
    end: str  # complete | empty | error | sandbox | timeout | cancel | open | absent
    selection: str | None  # None: the ledger's default, by leaving the context normally

    @property
    def state(self) -> str | None:
        if self.end == "absent":
            return None
        return {"complete": "succeeded", "cancel": "cancelled", "open": "running"}.get(
            self.end, "failed"
        )

    @property
    def reason(self) -> str | None:
        return FAILURE_REASON.get(self.end)

    @property
    def reward(self) -> float | None:
        return self.rewards[-1] if self.rewards else None

    @property
    def terminal(self) -> bool:
        return self.end not in ("open", "absent")


@dataclass
class GroupPlan:
    run: str
    uid: str
    partition: str
    step: int | None
    source: str | None
    size: int
    sessions: list[SessionPlan]

    @property
    def settled(self) -> bool:
        return all(s.terminal for s in self.sessions)

    @property
    def exists(self) -> bool:
        """A group is known to the ledger once one of its sessions was created."""
        return any(s.end != "absent" for s in self.sessions)


@dataclass
class Scenario:
    groups: list[GroupPlan]
    policy: str = "emit"
    default_selection: str = "all"
    seed: int = 0

    def sessions(self) -> list[tuple[GroupPlan, SessionPlan]]:
        return [(g, s) for g in self.groups for s in g.sessions]

    def buckets(self) -> set[tuple[str, str, int | None]]:
        return {(g.run, g.partition, g.step) for g in self.groups if g.exists}


ENDS = ["complete"] * 8 + ["error", "sandbox", "timeout", "empty", "cancel", "open", "absent"]
REWARDS = [1.0, 0.5, 0.25, -0.5, 2.0, 0.0, None]


def random_scenario(
    rnd: random.Random,
    *,
    min_groups: int = 1,
    max_groups: int = 5,
    ends: list[str] = ENDS,
    policy: str = "emit",
) -> Scenario:
    groups_: list[GroupPlan] = []
    for g in range(rnd.randint(min_groups, max_groups)):
        size = rnd.randint(1, 4)
        uid = f"g{g}"
        plans = []
        for i in range(size):
            end = rnd.choice(ends)
            count = 0 if end == "empty" else rnd.randint(1 if end == "complete" else 0, 3)
            trajectories = []
            for _ in range(count):
                n = rnd.randint(1, 5)
                trajectories.append(
                    Traj(
                        [rnd.randint(1, 99) for _ in range(rnd.randint(1, 4))],
                        [rnd.randint(1, 99) for _ in range(n)],
                        [rnd.randint(0, 1) for _ in range(n)],
                    )
                )
            rewards = [rnd.choice(REWARDS) for _ in range(rnd.randint(0, 2))]
            plans.append(
                SessionPlan(
                    f"{uid}-s{i}",
                    i,
                    trajectories,
                    rewards,
                    end,
                    rnd.choice([None, "all", "longest"]),
                )
            )
        groups_.append(
            GroupPlan(
                rnd.choice(["r1", "r2"]),
                uid,
                rnd.choice(["train", "val"]),
                rnd.choice([0, 1, None]),
                rnd.choice(["gsm8k", "swe", None]),
                size,
                plans,
            )
        )
    return Scenario(groups_, policy, rnd.choice(["all", "longest"]), rnd.randrange(2**32))


class Actor:
    """One session as its own task inside `ledger.session(...)`; commands arrive one at a time."""

    def __init__(self, ledger: Ledger, group: GroupPlan, plan: SessionPlan) -> None:
        self.ledger, self.group, self.plan = ledger, group, plan
        self.inbox: asyncio.Queue[tuple[tuple[Any, ...], asyncio.Future[None] | None]] = (
            asyncio.Queue()
        )
        self.task: asyncio.Task[None] | None = None
        self.handle: Any = (
            None  # sessions left open use a plain handle: no task, nothing to clean up
        )
        self.raised: BaseException | None = None

    def ops(self, rnd: random.Random) -> list[tuple[Any, ...]]:
        body: list[tuple[Any, ...]] = [("traj", t) for t in self.plan.trajectories]
        for reward in self.plan.rewards:  # rewards land anywhere among the trajectories
            body.insert(rnd.randint(0, len(body)), ("reward", reward))
        body = _keep_reward_order(body, self.plan.rewards)
        end = self.plan.end
        tail: list[tuple[Any, ...]] = []
        if end in ("complete", "empty"):
            tail = [("complete", self.plan.selection)]
        elif end == "error":
            tail = [("raise", RuntimeError("tool parser crashed"))]
        elif end == "sandbox":
            tail = [("raise", SandboxError("sandbox OOM-killed"))]
        elif end == "timeout":
            tail = [("raise", TimeoutError("turn timed out"))]
        elif end == "cancel":
            tail = [("cancel",)]
        return [("create",), *body, *tail]

    def _identity(self) -> dict[str, Any]:
        g = self.group
        return dict(
            uid=g.uid,
            session_index=self.plan.index,
            group_size=g.size,
            partition=g.partition,
            global_step=g.step,
            data_source=g.source,
            run=g.run,
        )

    async def _main(self, ready: asyncio.Future[None]) -> None:
        try:
            async with self.ledger.session(self.plan.sid, **self._identity()) as handle:
                ready.set_result(None)
                while True:
                    op, done = await self.inbox.get()
                    if op[0] == "traj":
                        t: Traj = op[1]
                        await handle.record_trajectory(
                            prompt_ids=t.prompt,
                            response_ids=t.response,
                            response_mask=t.mask,
                            num_turns=1,
                        )
                    elif op[0] == "reward":
                        await handle.post_reward(op[1])
                    elif op[0] == "complete":
                        if op[1] is not None:
                            await handle.complete(trajectory_selection=op[1])
                        return  # leaving the context completes the session (if still running)
                    elif op[0] == "raise":
                        self.raised = op[1]
                        raise op[1]
                    assert done is not None
                    done.set_result(None)
        except Exception as error:
            if error is not self.raised:
                raise

    async def do(self, op: tuple[Any, ...]) -> None:
        loop = asyncio.get_running_loop()
        if self.plan.end == "open":
            if op[0] == "create":
                self.handle = await self.ledger.create_session(self.plan.sid, **self._identity())
            elif op[0] == "traj":
                t: Traj = op[1]
                await self.handle.record_trajectory(
                    prompt_ids=t.prompt, response_ids=t.response, response_mask=t.mask
                )
            else:
                await self.handle.post_reward(op[1])
            return
        if op[0] == "create":
            ready: asyncio.Future[None] = loop.create_future()
            self.task = asyncio.create_task(self._main(ready))
            await self._until(ready)
        elif op[0] in ("traj", "reward"):
            done: asyncio.Future[None] = loop.create_future()
            self.inbox.put_nowait((op, done))
            await self._until(done)
        elif op[0] in ("complete", "raise"):
            self.inbox.put_nowait((op, None))
            assert self.task is not None
            await self.task
        elif op[0] == "cancel":
            assert self.task is not None
            self.task.cancel()
            await asyncio.wait([self.task])
            assert self.task.cancelled()

    async def _until(self, future: asyncio.Future[None]) -> None:
        assert self.task is not None
        await asyncio.wait({future, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not future.done():
            self.task.result()  # raises what ended the actor
            raise AssertionError(f"session {self.plan.sid} ended before its command ran")


def _keep_reward_order(
    body: list[tuple[Any, ...]], rewards: list[float | None]
) -> list[tuple[Any, ...]]:
    """Rewards were inserted at random places; put them back in posting order (the last one wins)."""
    it = iter(rewards)
    return [("reward", next(it)) if op[0] == "reward" else op for op in body]


async def play(ledger: Ledger, scenario: Scenario, *, project_between: bool = True) -> list[Actor]:
    """Run the scenario's sessions with a seeded interleaving; projector steps sprinkled in between.

    Sessions planned to stay open are left running (plain handles, no task behind them).
    """
    rnd = random.Random(scenario.seed)
    actors = [Actor(ledger, g, s) for g, s in scenario.sessions() if s.end != "absent"]
    pending = {id(a): (a, a.ops(rnd)) for a in actors}
    while pending:
        chosen = rnd.sample(list(pending.values()), rnd.randint(1, min(4, len(pending))))
        await asyncio.gather(*(actor.do(ops.pop(0)) for actor, ops in chosen))  # appended together
        for actor, ops in chosen:
            if not ops:
                del pending[id(actor)]
        if project_between and rnd.random() < 0.3:
            for _ in range(rnd.randint(1, 3)):
                await ledger.projector.step()
    return actors


# ------------------------------------------------------------------------------------------
# checks
# ------------------------------------------------------------------------------------------


async def all_queue_rows(engine: Any) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        return [
            dict(r)
            for r in (await conn.execute(select(queue_rows).order_by(queue_rows.c.id))).mappings()
        ]


async def step_batch(ledger: Ledger, run: str, partition: str, step: int | None) -> Any:
    """The padded batch of a step's rows as they stand (what `Ledger.batch` builds, without waiting)."""
    from sessions.batches import build_padded
    from sessions.batches.rows import materialise

    async with ledger.engine.connect() as conn:
        queue = await rm.queue_rows_for(conn, run, partition, step)
        sources = await rm.source_events(conn, [q["source_position"] for q in queue])
    return build_padded(materialise(queue, sources))


def check_rows(
    scenario: Scenario, queue: list[dict[str, Any]]
) -> dict[tuple[str, str, str], tuple[SessionPlan, Traj | None, float]]:
    """Queue rows == the plan's rows; returns (run, partition, key) -> (plan, trajectory or None, reward)."""
    rows = [q for q in queue if q["kind"] == "row"]
    keys = [(q["run"], q["partition"], q["key"]) for q in rows]
    assert len(keys) == len(set(keys)), "duplicate queue rows"
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for q in rows:
        by_session[q["session_id"]].append(q)
    known = {s.sid for _g, s in scenario.sessions()}
    assert set(by_session) <= known, f"rows for unknown sessions {set(by_session) - known}"
    expected: dict[tuple[str, str, str], tuple[SessionPlan, Traj | None, float]] = {}
    placeholders = failed_emitting = 0
    for g, s in scenario.sessions():
        got = by_session.get(s.sid, [])
        if s.state == "succeeded":
            reward = 0.0 if s.reward is None else s.reward
            selection = s.selection or scenario.default_selection
            if selection == "all":
                indices = list(range(len(s.trajectories)))
                assert sorted(q["key"] for q in got) == sorted(
                    f"{g.uid}_{s.index}_{t}" for t in indices
                ), s.sid
            else:
                longest = max(len(t.prompt) + len(t.response) for t in s.trajectories)
                candidates = {
                    t
                    for t, tr in enumerate(s.trajectories)
                    if len(tr.prompt) + len(tr.response) == longest
                }
                assert len(got) == 1, f"{s.sid}: 'longest' selects one row, got {len(got)}"
                assert int(got[0]["key"].rsplit("_", 1)[1]) in candidates, s.sid
            for q in got:
                t = int(q["key"].rsplit("_", 1)[1])
                assert not q["is_placeholder"] and q["reward"] == reward, s.sid
                expected[(g.run, g.partition, q["key"])] = (s, s.trajectories[t], reward)
        elif s.state == "failed" and emits(scenario.policy, g.partition, s.reason or ""):
            failed_emitting += 1
            assert [q["key"] for q in got] == [f"{g.uid}_{s.index}_0"], (
                f"{s.sid}: one placeholder row"
            )
            q = got[0]
            assert q["is_placeholder"] and q["reward"] == 0.0, s.sid
            assert (
                q["failure_reason"] == s.reason and q["materialization_reason"] == "session_failed"
            ), s.sid
            placeholders += 1
            expected[(g.run, g.partition, q["key"])] = (s, None, 0.0)
        else:  # dropped failures, cancelled, open and never-created sessions have no row
            assert got == [], f"{s.sid} ({s.end}) must have no row"
    assert sum(q["is_placeholder"] for q in rows) == placeholders == failed_emitting
    if scenario.policy == "drop":
        assert placeholders == 0
    return expected


def check_batch_rows(
    batch: Any, expected: dict[tuple[str, str, str], tuple[SessionPlan, Traj | None, float]]
) -> None:
    from sessions.batches import non_tensor

    keys = list(
        zip(non_tensor(batch, "run"), non_tensor(batch, "partition"), non_tensor(batch, "key"))
    )
    P = batch["prompts"].shape[1]
    for i, key in enumerate(keys):
        plan, traj, reward = expected[key]
        pl, rl = int(batch["prompt_length"][i]), int(batch["response_length"][i])
        attention = batch["attention_mask"][i].tolist()
        assert attention == [0] * (P - pl) + [1] * (pl + rl) + [0] * (len(attention) - P - rl), key
        last = int(batch["attention_mask"][i, P:].sum()) - 1  # the last attended response token
        scores = batch["rm_scores"][i].tolist()
        assert scores[last] == pytest.approx(reward, abs=1e-6), key
        assert all(v == 0.0 for j, v in enumerate(scores) if j != last), key
        mask = batch["response_mask"][i].tolist()
        if traj is None:
            assert bool(batch["is_placeholder"][i]), key
            assert (pl, rl) == (1, 1) and sum(mask) == 0 and sum(attention) == 2, key
            assert attention[P - 1] == attention[P] == 1, key
            assert int(batch["prompts"][i, -1]) == TOKEN_ID == int(batch["responses"][i, 0]), key
        else:
            assert not bool(batch["is_placeholder"][i]), key
            assert batch["prompts"][i, P - pl :].tolist() == traj.prompt, key
            assert batch["responses"][i, :rl].tolist() == traj.response, key
            assert mask == traj.mask + [0] * (len(mask) - rl), key
        assert non_tensor(batch, "session_id")[i] == plan.sid


async def check_tags(ledger: Ledger, scenario: Scenario, queue: list[dict[str, Any]]) -> None:
    positions: dict[str, list[int]] = defaultdict(
        list
    )  # session -> positions of its settling events
    for r in await read_events(ledger.engine):
        if r.type in ev.TERMINAL_EVENTS or r.type == "PlaceholderEmitted":
            positions[r.session_id].append(r.position or 0)
    produced = [q["produced_position"] for q in queue]
    assert produced == sorted(produced), "queue order must follow the log"
    tags = [q for q in queue if q["kind"] == "tag"]
    for g in scenario.groups:
        mine = [q for q in tags if (q["run"], q["uid"]) == (g.run, g.uid)]
        if not g.settled:
            assert mine == [], f"group {g.uid} tagged before all {g.size} sessions are terminal"
            continue
        assert len(mine) == 1, f"group {g.uid}: expected one tag, got {len(mine)}"
        tag = mine[0]
        status = "finished" if any(s.state == "succeeded" for s in g.sessions) else "failure"
        assert (
            tag["key"] == g.uid
            and tag["tags"]["status"] == status
            and tag["partition"] == g.partition
        )
        rows = [q for q in queue if q["kind"] == "row" and (q["run"], q["uid"]) == (g.run, g.uid)]
        assert all(q["id"] < tag["id"] for q in rows), f"group {g.uid}: tag before one of its rows"
        settle = max(p for s in g.sessions for p in positions[s.sid])
        assert tag["produced_position"] >= settle, (
            f"group {g.uid}: tagged at {tag['produced_position']} before position {settle}"
        )


async def check_read_models(ledger: Ledger, scenario: Scenario) -> None:
    async with ledger.engine.connect() as conn:
        states = dict((await conn.execute(select(sessions.c.session_id, sessions.c.state))).all())
        status = {
            (r, u): s
            for r, u, s in (
                await conn.execute(select(groups.c.run, groups.c.uid, groups.c.status))
            ).all()
        }
    assert states == {s.sid: s.state for _g, s in scenario.sessions() if s.state is not None}
    for g in scenario.groups:
        if not g.exists:
            assert (g.run, g.uid) not in status
        elif not g.settled:
            assert status[(g.run, g.uid)] == "pending"
        else:
            assert status[(g.run, g.uid)] == (
                "finished" if any(s.state == "succeeded" for s in g.sessions) else "failure"
            )


async def check_everything(
    ledger: Ledger, scenario: Scenario, sink: InProcessQueue | None = None
) -> None:
    queue = await all_queue_rows(ledger.engine)
    expected = check_rows(scenario, queue)
    await check_tags(ledger, scenario, queue)
    await check_read_models(ledger, scenario)
    oracle = await assert_metrics_match(ledger.engine)
    from sessions.batches import non_tensor

    for run, partition, step in sorted(scenario.buckets(), key=repr):
        settled = all(
            g.settled
            for g in scenario.groups
            if g.exists and (g.run, g.partition, g.step) == (run, partition, step)
        )
        if settled:
            batch = await ledger.batch(partition, step, run=run, timeout=0)
        else:
            with pytest.raises(TimeoutError, match="unsettled"):
                await ledger.batch(partition, step, run=run, timeout=0)
            batch = await step_batch(ledger, run, partition, step)
        check_batch_rows(batch, expected)
        # reward/mean is verl's critic/score/mean of this batch: rm_scores.sum(-1) over rows with a response
        score = batch["rm_scores"].sum(-1).double()
        attended = batch["response_length"] > 0
        sources = non_tensor(batch, "data_source")
        for source in {None, *sources}:
            scope = oracle.get((run, partition, step, source), {})
            picked = [
                i
                for i in range(len(sources))
                if attended[i] and (source is None or sources[i] == source)
            ]
            if picked:
                assert scope["reward/mean"] == pytest.approx(float(score[picked].mean())), (
                    run,
                    partition,
                    step,
                    source,
                )
            else:
                assert "reward/mean" not in scope
    if sink is not None:
        for run, partition in {(g.run, g.partition) for g in scenario.groups}:
            db_rows = [q for q in queue if (q["run"], q["partition"]) == (run, partition)]
            assert [i.key for i in sink.items(run, partition)] == [
                q["key"] for q in db_rows if q["kind"] == "row"
            ]
            assert [i.key for i in sink.items(run, partition, tags=True)] == [
                q["key"] for q in db_rows if q["kind"] == "tag"
            ]
            for item in sink.items(run, partition):
                plan, _traj, reward = expected[(run, partition, item.key)]
                assert (
                    item.row is not None
                    and item.row.reward == reward
                    and item.row.meta["session_id"] == plan.sid
                )
            for item in sink.items(run, partition, tags=True):
                assert (
                    item.tags["status"] in ("finished", "failure")
                    and item.tags["is_prompt"] is True
                )


# ------------------------------------------------------------------------------------------
# 1. property: random outcomes, interleavings, page sizes, policies
# ------------------------------------------------------------------------------------------


#: Examples per backend: a PostgreSQL example costs several times a SQLite one (round trips per
#: append and page), so it runs fewer to keep the suite's wall time in check.
EXAMPLES = {"sqlite": 25, "postgres": 10}


def test_projection_properties(module_db_url: str) -> None:
    """Random scenarios, interleavings, page sizes and policies; one database per backend, wiped per example."""

    @settings(
        max_examples=EXAMPLES[backend_of(module_db_url)],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        rnd=st.randoms(use_true_random=False),
        page_size=st.integers(1, 7),
        policy=st.sampled_from(["emit", "emit", "drop", "mixed"]),
    )
    def projection_properties(rnd: random.Random, page_size: int, policy: str) -> None:
        scenario = random_scenario(rnd, policy=policy)

        async def main(url: str) -> None:
            await wipe(url)
            sink = InProcessQueue()
            async with Ledger.open(
                url,
                placeholder_policy=POLICIES[policy],
                trajectory_selection=scenario.default_selection,
                sinks=[sink],
            ) as ledger:
                ledger.projector.page_size = page_size
                await play(ledger, scenario)
                await ledger.project()
                await check_everything(ledger, scenario, sink)

        asyncio.run(main(module_db_url))

    projection_properties()


async def test_failed_and_placeholder_split_across_pages(db_url: str) -> None:
    """page_size 1 puts every SessionFailed and its PlaceholderEmitted in different pages."""
    plan = [
        SessionPlan("a-s0", 0, [Traj([1], [2, 3], [1, 1])], [1.0], "complete", None),
        SessionPlan("a-s1", 1, [], [], "error", None),
        SessionPlan("a-s2", 2, [Traj([1], [2], [1])], [], "sandbox", None),
    ]
    scenario = Scenario(
        [
            GroupPlan("r1", "a", "val", 0, "gsm8k", 3, plan),
            GroupPlan(
                "r1", "b", "val", 0, "gsm8k", 1, [SessionPlan("b-s0", 0, [], [], "timeout", None)]
            ),
        ]
    )
    async with Ledger.open(db_url) as ledger:
        ledger.projector.page_size = 1
        await play(ledger, scenario, project_between=False)
        stepped = 0
        while (await ledger.projector.step()).events:
            stepped += 1
        assert stepped == len(await read_events(ledger.engine))
        await check_everything(ledger, scenario)


# ------------------------------------------------------------------------------------------
# 2. restart after a failure at every step of the page transaction
# ------------------------------------------------------------------------------------------

FAULT_SCENARIO = Scenario(
    [
        GroupPlan(
            "r1",
            "g1",
            "val",
            0,
            "gsm8k",
            3,
            [
                SessionPlan(
                    "g1-s0",
                    0,
                    [Traj([5, 6], [7, 8, 9], [1, 0, 1]), Traj([5], [7], [1])],
                    [1.0],
                    "complete",
                    "all",
                ),
                SessionPlan("g1-s1", 1, [Traj([5], [6, 7], [1, 1])], [], "error", None),
                SessionPlan("g1-s2", 2, [Traj([5, 6], [8], [1])], [0.5], "complete", None),
            ],
        ),
        GroupPlan(
            "r1",
            "g2",
            "val",
            0,
            "swe",
            2,
            [
                SessionPlan("g2-s0", 0, [], [], "sandbox", None),
                SessionPlan("g2-s1", 1, [Traj([4], [4, 4], [0, 1])], [0.25], "timeout", None),
            ],
        ),
        GroupPlan(
            "r1",
            "g3",
            "train",
            0,
            "gsm8k",
            3,
            [
                SessionPlan("g3-s0", 0, [Traj([1, 2, 3], [4], [1])], [], "complete", None),
                SessionPlan("g3-s1", 1, [Traj([1], [2], [1])], [], "cancel", None),
                SessionPlan("g3-s2", 2, [], [], "empty", None),
            ],
        ),
        GroupPlan(
            "r1",
            "g4",
            "train",
            1,
            None,
            2,
            [
                SessionPlan(
                    "g4-s0",
                    0,
                    [Traj([1], [2, 3], [1, 1]), Traj([1], [2, 3, 4, 5], [1, 0, 0, 1])],
                    [0.25],
                    "complete",
                    "longest",
                ),
                SessionPlan("g4-s1", 1, [Traj([9], [9], [1])], [0.75], "complete", None),
            ],
        ),
        GroupPlan(
            "r2",
            "g5",
            "val",
            1,
            "gsm8k",
            2,
            [
                SessionPlan("g5-s0", 0, [Traj([3], [3], [1])], [2.0], "complete", None),
                SessionPlan("g5-s1", 1, [Traj([3], [3], [1])], [], "open", None),
            ],
        ),
    ],
    seed=11,
)
#: The queue as the plan above defines it (by hand): per (run, partition), rows and tags in order of settling.
FAULT_KEYS = {
    ("r1", "val"): {"g1_0_0", "g1_0_1", "g1_1_0", "g1_2_0", "g1", "g2_0_0", "g2_1_0", "g2"},
    ("r1", "train"): {"g3_0_0", "g3_2_0", "g3", "g4_0_1", "g4_1_0", "g4"},
    ("r2", "val"): {"g5_0_0"},
}


class Injected(RuntimeError):
    pass


STEPS = (
    "get_checkpoint:after",
    "events_after:before",
    "load_sessions:before",
    "load_groups:before",
    "load_metrics:before",
    "trajectory_events:before",
    "next_queue_id:before",
    "save_rows:before",
    "save_rows:after",
    "save_metrics:before",
    "save_metrics:after",
    "insert_queue_rows:before",
    "insert_queue_rows:after",
    "source_events:before",
    "materialise:before",
    "sink.put:before",
    "sink.put:after",
    "set_checkpoint:before",
    "set_checkpoint:after",
)


class Faults:
    """Fails every step of the page transaction `rounds` times, at most `per_page` times per page.

    A page attempt fails at the first step it reaches that still has failures to give, so
    successive pages fail at successively later steps; "before" a call the statement never ran,
    "after" it ran inside the transaction that the failure rolls back.
    """

    def __init__(self, rounds: int, per_page: int = 2) -> None:
        self.per_page = per_page
        self.remaining = {step: rounds for step in STEPS}
        self.fired: list[tuple[int, str]] = []
        self.page = -1

    def fire(self, name: str, when: str) -> None:
        step = f"{name}:{when}"
        if (
            self.remaining[step]
            and sum(page == self.page for page, _ in self.fired) < self.per_page
        ):
            self.remaining[step] -= 1
            self.fired.append((self.page, step))
            raise Injected(f"injected failure {when} {name} (page from position {self.page})")

    def wrap_async(self, name: str, real: Callable[..., Any], *, after: bool) -> Callable[..., Any]:
        async def guarded(*args: Any, **kwargs: Any) -> Any:
            self.fire(name, "before")
            result = await real(*args, **kwargs)
            if after:
                self.fire(name, "after")
            return result

        return guarded

    def wrap_checkpoint(self, real: Callable[..., Any]) -> Callable[..., Any]:
        async def guarded(*args: Any, **kwargs: Any) -> Any:
            result = await real(*args, **kwargs)
            self.page = result  # a page attempt begins
            self.fire("get_checkpoint", "after")
            return result

        return guarded

    def wrap_sync(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.fire(name, "before")
            return real(*args, **kwargs)

        return guarded


class FaultySink:
    def __init__(self, inner: InProcessQueue, faults: Faults) -> None:
        self.inner = inner
        self.put = faults.wrap_async("sink.put", inner.put, after=True)


@pytest.fixture(scope="module")
def fault_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FAULT_SCENARIO log, recorded once, never projected; tests copy it."""
    path = tmp_path_factory.mktemp("faults") / "template.db"

    async def record() -> None:
        async with Ledger.open(f"sqlite+aiosqlite:///{path}") as ledger:
            await play(ledger, FAULT_SCENARIO, project_between=False)

    asyncio.run(record())
    return path


def _copy(template: Path, folder: Path, name: str) -> str:
    target = folder / f"{name}.db"
    shutil.copyfile(template, target)
    return f"sqlite+aiosqlite:///{target}"


async def snapshot(engine: Any) -> dict[str, Any]:
    async with engine.connect() as conn:
        queue = [
            {k: v for k, v in dict(r).items() if k != "id"}
            for r in (await conn.execute(select(queue_rows).order_by(queue_rows.c.id))).mappings()
        ]
        session_rows = [
            dict(r)
            for r in (
                await conn.execute(select(sessions).order_by(sessions.c.session_id))
            ).mappings()
        ]
        group_rows = [
            dict(r)
            for r in (
                await conn.execute(select(groups).order_by(groups.c.run, groups.c.uid))
            ).mappings()
        ]
        metrics = sorted(
            (
                r["run"],
                r["partition"],
                -1 if r["global_step"] is None else r["global_step"],
                r["data_source"] or "",
                r["metric"],
                r["value"],
            )
            for r in (await conn.execute(select(metric_counts))).mappings()
        )
        checkpoint = (await conn.execute(select(checkpoints.c.name, checkpoints.c.position))).all()
    return {
        "queue": queue,
        "sessions": session_rows,
        "groups": group_rows,
        "metrics": metrics,
        "checkpoint": checkpoint,
    }


def sink_snapshot(sink: InProcessQueue) -> dict[tuple[str, str], list[Any]]:
    out: dict[tuple[str, str], list[Any]] = {}
    for run, partition in FAULT_KEYS:
        items = sink.items(run, partition) + sink.items(run, partition, tags=True)
        out[(run, partition)] = [
            (i.key, i.global_step, dict(i.tags))
            if i.row is None
            else (
                i.key,
                i.global_step,
                dict(i.tags),
                i.row.reward,
                i.row.is_placeholder,
                i.row.prompt_ids.tolist(),
                i.row.response_ids.tolist(),
                i.row.response_mask.tolist(),
                dict(i.row.meta),
            )
            for i in items
        ]
    return out


# SQLite only: the faults are injected above the driver (store.read_models, the sink), the same code on both backends.
async def test_restart_after_failure_at_every_step(
    fault_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sessions.batches.rows as rows_module

    # the uninterrupted run, on its own database
    baseline_engine = create_engine(_copy(fault_template, tmp_path, "baseline"))
    baseline_sink = InProcessQueue()
    try:
        await Projector(baseline_engine, sinks=[baseline_sink]).run()
        expected = await snapshot(baseline_engine)
    finally:
        await baseline_engine.dispose()
    for (
        run,
        partition,
    ), keys in FAULT_KEYS.items():  # the baseline itself matches the hand-written plan
        got = [
            q["key"] for q in expected["queue"] if (q["run"], q["partition"]) == (run, partition)
        ]
        assert sorted(got) == sorted(keys), (run, partition)

    faults = Faults(rounds=2)
    page_sizes = (
        1,
        3,
        2,
    )  # each restart pages differently, so failures hit different page boundaries
    monkeypatch.setattr(rm, "get_checkpoint", faults.wrap_checkpoint(rm.get_checkpoint))
    for name, after in [
        ("events_after", False),
        ("next_queue_id", False),
        ("load_sessions", False),
        ("load_groups", False),
        ("load_metrics", False),
        ("trajectory_events", False),
        ("save_rows", True),
        ("save_metrics", True),
        ("insert_queue_rows", True),
        ("source_events", False),
        ("set_checkpoint", True),
    ]:
        monkeypatch.setattr(rm, name, faults.wrap_async(name, getattr(rm, name), after=after))
    monkeypatch.setattr(
        rows_module, "materialise", faults.wrap_sync("materialise", rows_module.materialise)
    )

    engine = create_engine(_copy(fault_template, tmp_path, "faulty"))
    sink = InProcessQueue()
    failures = 0
    try:
        while True:
            page_size = page_sizes[failures % len(page_sizes)]
            projector = Projector(
                engine, sinks=[FaultySink(sink, faults)], page_size=page_size
            )  # a restart
            try:
                await projector.run()
                break
            except Injected:
                failures += 1
        got = await snapshot(engine)
    finally:
        await engine.dispose()

    assert not any(faults.remaining.values()), (
        f"steps that never failed: {[k for k, v in faults.remaining.items() if v]}"
    )
    assert failures == len(faults.fired) == 2 * len(STEPS)
    for part in ("queue", "sessions", "groups", "metrics", "checkpoint"):
        assert got[part] == expected[part], f"{part} differs from the uninterrupted run"
    # the in-process sink: every key exactly once, same order, same content as without faults
    assert sink_snapshot(sink) == sink_snapshot(baseline_sink)
    for (run, partition), keys in FAULT_KEYS.items():
        present = [
            i.key for i in sink.items(run, partition) + sink.items(run, partition, tags=True)
        ]
        assert sorted(present) == sorted(keys)


# ------------------------------------------------------------------------------------------
# 3. two projectors on one database
# ------------------------------------------------------------------------------------------


async def test_two_projectors_concurrently(db_url: str) -> None:
    """Two projectors (separate engines, as in two processes) tail one log while sessions are recorded."""
    scenario = random_scenario(
        random.Random(3),
        min_groups=10,
        max_groups=10,
        ends=["complete"] * 6 + ["error", "sandbox", "timeout", "empty", "cancel", "open"],
    )
    async with Ledger.open(db_url, trajectory_selection=scenario.default_selection) as ledger:
        recorded = asyncio.Event()

        async def record() -> None:
            await play(ledger, scenario, project_between=False)
            recorded.set()

        async def tail(projector: Projector) -> int:
            projected = 0
            while not recorded.is_set():
                projected += await projector.run()
                await asyncio.sleep(0.02)
            return projected + await projector.run()

        first, second = create_engine(db_url), create_engine(db_url)
        try:
            _, a, b = await asyncio.gather(
                record(), tail(Projector(first, page_size=2)), tail(Projector(second, page_size=3))
            )
        finally:
            await first.dispose()
            await second.dispose()
        total = len(await read_events(ledger.engine))
        assert a + b == total, (
            f"projected {a} + {b} events of {total}: a page was projected twice or skipped"
        )
        queue = await all_queue_rows(ledger.engine)
        identities = [(q["run"], q["partition"], q["key"]) for q in queue]
        assert len(identities) == len(set(identities))
        await check_everything(ledger, scenario)


# ------------------------------------------------------------------------------------------
# 4. Ledger.batch waits for unsettled groups, with a deadline
# ------------------------------------------------------------------------------------------


async def _open_group(ledger: Ledger) -> Any:
    kw = dict(uid="slow", group_size=2, partition="val", global_step=0)
    async with ledger.session("slow-0", session_index=0, **kw) as s:
        await s.record_trajectory(prompt_ids=[1], response_ids=[2, 3])
        await s.post_reward(1.0)
    return await ledger.create_session("slow-1", session_index=1, **kw)


async def test_batch_times_out_on_an_open_session_then_returns(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        handle = await _open_group(ledger)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError, match="unsettled") as caught:
            await ledger.batch("val", 0, timeout=0.2, poll_interval=0.05)
        assert loop.time() - started < 5
        assert "val" in str(caught.value) and "step 0" in str(caught.value)

        waiting = asyncio.create_task(ledger.batch("val", 0, timeout=10, poll_interval=0.05))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await handle.record_trajectory(prompt_ids=[1], response_ids=[4])
        await handle.complete()
        batch = await asyncio.wait_for(waiting, 10)
        assert batch.batch_size[0] == 2
        assert batch["rm_scores"].sum(-1).tolist() == [1.0, 0.0]


async def test_batch_timeout_names_the_unsettled_uids(sqlite_url: str) -> None:
    async with Ledger.open(sqlite_url) as ledger:
        await _open_group(ledger)
        with pytest.raises(TimeoutError, match="slow"):
            await ledger.batch("val", 0, timeout=0.1, poll_interval=0.05)


# ------------------------------------------------------------------------------------------
# 6. follow mode
# ------------------------------------------------------------------------------------------


async def _record(ledger: Ledger, sid: str, uid: str) -> None:
    async with ledger.session(
        sid, uid=uid, session_index=0, group_size=1, partition="train", global_step=0
    ) as s:
        await s.record_trajectory(prompt_ids=[1], response_ids=[2])
        await s.post_reward(0.5)


async def _wait_for_tag(ledger: Ledger, uid: str, within: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline:
        if any(q["kind"] == "tag" and q["uid"] == uid for q in await all_queue_rows(ledger.engine)):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the follower did not project {uid} within {within}s")


async def test_follow_picks_up_new_sessions_and_stops(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        await _record(ledger, "before-0", "before")
        stop = asyncio.Event()
        pages: list[int] = []
        # a long poll: in-process appends must wake the follower, not the poll
        follower = asyncio.create_task(
            ledger.projector.follow(
                stop, poll_interval=30, on_page=lambda r: pages.append(r.events)
            )
        )
        await _wait_for_tag(ledger, "before", 5)
        for i in range(3):
            await asyncio.sleep(0.05)
            await _record(ledger, f"after{i}-0", f"after{i}")
            await _wait_for_tag(ledger, f"after{i}", 3)
        stop.set()
        total = await asyncio.wait_for(follower, 3)
        assert total == sum(pages) == len(await read_events(ledger.engine))
        assert (await stored_metrics(ledger.engine))[("default", "train", 0, None)][
            "sessions/succeeded"
        ] == 4


async def test_follow_sees_a_commit_landing_between_its_run_and_its_wait(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit that lands after the follower's last read but before it starts waiting must still wake it."""
    async with Ledger.open(db_url) as ledger:
        projector = ledger.projector
        real_run = Projector.run
        calls = 0

        async def run_then_commit(self: Projector, **kwargs: Any) -> int:
            nonlocal calls
            calls += 1
            projected = await real_run(self, **kwargs)
            if calls == 1:  # the log's end was read; now another coroutine commits
                await _record(ledger, "late-0", "late")
            return projected

        monkeypatch.setattr(Projector, "run", run_then_commit)
        stop = asyncio.Event()
        follower = asyncio.create_task(projector.follow(stop, poll_interval=30))
        try:
            await _wait_for_tag(ledger, "late", 3)
        finally:
            stop.set()
            await asyncio.wait_for(follower, 3)
