"""Property: the fast replay (one-pass fold, bulk copy) stores exactly what the incremental Projector does.

Random logs are written straight to the event store — several runs, train and val, steps and no
step, data sources or none, groups of launches 1-3 or none (a later launch taking a step over, an
earlier one's straggling in after it) with the runs' `RunLaunched` records, groups of 1-3 sessions whose outcomes cover success (with, without
and with an absent score, all or only the last trajectory selected), failure with the placeholder
emitted or dropped, cancellation, and sessions left open; trajectories at schema v1 (upcast) and
v2; every session's events interleaved at random with the others'. The incremental Projector
projects the log in random pages, some of it before the rest is appended; `replay` rebuilds it
into an empty database. Every row of every read model and of the log must be equal with every
column, surrogate ids included (queue_rows.id, which the projector assigns 1, 2, … in projection
order); of the checkpoint everything but `updated_at` (the projection's wall time). The audit of
the incrementally projected database must pass. Replay and audit fold in one process or in 2-3
worker processes at random (`workers`). Runs on SQLite and on PostgreSQL (one pair of
databases per module, wiped per example).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from sessions import events as ev
from sessions import tokens
from sessions.audit import replay as replay_module
from sessions.audit.auditing import AuditReport, audit
from sessions.audit.replay import replay
from sessions.projection.projector import Projector
from store import create_engine
from store.log.event_store import EventStore
from store.log.records import NewEvent
from store.schema.migrate import upgrade
from store.schema.tables import checkpoints, events
from tests.audit.test_replay_audit import TABLES, table_rows
from tests.conftest import backend_of, wipe

OUTCOMES = (
    "succeed",
    "succeed",
    "succeed_last",
    "succeed_no_reward",
    "fail_emit",
    "fail_drop",
    "cancel",
    "open",
    "created",
)
T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)


@dataclass
class Log:
    """Each session's events in its own order, and the order in which streams take turns."""

    streams: dict[str, list[NewEvent]] = field(default_factory=dict)
    turns: list[str] = field(default_factory=list)

    def interleaved(self) -> list[NewEvent]:
        cursor = {sid: 0 for sid in self.streams}
        out = []
        for sid in self.turns:
            out.append(self.streams[sid][cursor[sid]])
            cursor[sid] += 1
        return out


def _trajectory(rnd: random.Random, index: int, v1: bool) -> tuple[dict[str, Any], bytes]:
    prompt = np.array([rnd.randrange(1, 500) for _ in range(rnd.randint(1, 4))], dtype=np.int32)
    response = np.array([rnd.randrange(1, 500) for _ in range(rnd.randint(1, 5))], dtype=np.int32)
    mask = np.array([rnd.choice([0, 1, 1]) for _ in response], dtype=np.uint8)
    logprobs = (
        np.array([-rnd.random() for _ in response], dtype=np.float32)
        if rnd.random() < 0.3
        else None
    )
    payload = tokens.encode(tokens.TokenArrays(prompt, response, mask, logprobs))
    data: dict[str, Any] = {
        "index": index,
        "num_turns": rnd.randint(1, 4),
        "prompt_len": len(prompt),
        "response_len": len(response),
        "has_logprobs": logprobs is not None,
        "materialization_reason": rnd.choice([None, "complete", "truncated"]),
        "extra": {"turns": rnd.randint(0, 3)} if rnd.random() < 0.5 else {},
    }
    if not v1:
        data["trainable_tokens"] = int(mask.sum())
    return data, payload


def _schema_3(rnd: random.Random, data: dict[str, Any]) -> dict[str, Any]:
    """A v2 trajectory's data as schema 3 writes it for a trajectory handed over whole: its
    versions (rows assembled from calls must be what the calls assemble, which the audit checks:
    tests/domain/test_calls.py generates those)."""
    low = rnd.choice([None, 0, 3])
    return {
        **data,
        "min_version": low,
        "max_version": None if low is None else low + rnd.randint(0, 2),
        "from_calls": [],
    }


def _calls(rnd: random.Random, add: Any) -> None:
    """A few model calls of an attempt: intents, each recorded or failed, or left open."""
    for c in range(rnd.randint(1, 3)):
        cid = f"c{c}"
        add("ModelCallStarted", {"call_id": cid, "turn": c, "sampling": {}, "version": None})
        fate = rnd.random()
        if fate < 0.7:
            prompt = np.array([rnd.randrange(1, 500) for _ in range(rnd.randint(0, 3))], "<i4")
            response = np.array([rnd.randrange(1, 500) for _ in range(rnd.randint(1, 3))], "<i4")
            payload = tokens.encode(
                tokens.TokenArrays(prompt, response, np.ones(len(response), np.uint8), None)
            )
            version = rnd.choice([None, 1, 2])
            add(
                "ModelCallRecorded",
                {
                    "call_id": cid,
                    "prompt_shared": 0 if c == 0 else rnd.randint(0, 2),
                    "prompt_len": len(prompt),
                    "response_len": len(response),
                    "has_logprobs": False,
                    "finish_reason": rnd.choice([None, "stop"]),
                    "min_version": version,
                    "max_version": version,
                    "latency_s": rnd.choice([None, 0.5]),
                    "server": None,
                    "text": rnd.choice([None, "ok"]),
                },
                payload,
            )
        elif fate < 0.9:
            add(
                "ModelCallFailed",
                {
                    "call_id": cid,
                    "error_type": "ConnectionError",
                    "message": "reset",
                    "latency_s": None,
                },
            )


def random_log(rnd: random.Random) -> Log:
    log = Log()
    clock = iter(T0 + timedelta(microseconds=7 * i) for i in range(10**6))
    for g in range(rnd.randint(1, 6)):
        run = rnd.choice(["alpha", "beta"])
        uid = f"u{g}x{rnd.randrange(10**6)}"
        partition = rnd.choice(["train", "val"])
        step = rnd.choice([None, 0, 1, 2])
        source = rnd.choice([None, "gsm8k", "swe"])
        size = rnd.randint(1, 3)
        # The launch that ran the group (None: none recorded): a later launch's group takes the
        # step over; an earlier launch's arriving after it (a straggler) is superseded at once.
        launch = rnd.choice([None, None, 1, 2, 3])
        for index in range(size):
            sid = f"{uid}-s{index}"
            items: list[tuple[ev.Event | None, str, int, dict[str, Any], bytes | None]] = []

            def add(
                type_: str,
                data: dict[str, Any],
                payload: bytes | None = None,
                schema: int | None = None,
                items: list[Any] = items,
            ) -> None:
                items.append(
                    (None, type_, schema or ev.EVENT_TYPES[type_].SCHEMA_VERSION, data, payload)
                )

            add(
                "SessionCreated",
                {
                    "run": run,
                    "uid": uid,
                    "session_index": index,
                    "group_size": size,
                    "partition": partition,
                    "global_step": step,
                    "data_source": source,
                    "runner": rnd.choice([None, "swe-agent"]),
                    "sample_index": None,
                    "metadata": {"seed": rnd.randrange(100)},
                    **({"min_valid": rnd.choice([0, 1, 3])} if rnd.random() < 0.3 else {}),
                    **({"launch": launch} if launch is not None or rnd.random() < 0.5 else {}),
                },
                schema=2 if launch is not None or rnd.random() < 0.5 else 1,
            )
            outcome = rnd.choice(OUTCOMES)
            if outcome != "created":
                add(
                    "SessionStarted",
                    {"attempt": rnd.choice([None, 1]), "timeout_s": rnd.choice([None, 60.0])},
                )
                recorded = 0  # trajectory indices count across attempts
                for attempt in range(
                    1, rnd.choice([1, 1, 2, 3]) + 0
                ):  # superseded attempts, with their work
                    for _ in range(rnd.randint(0, 2)):
                        data, payload = _trajectory(rnd, recorded, False)
                        add("TrajectoryRecorded", data, payload, 2)
                        recorded += 1
                    if rnd.random() < 0.5:
                        add("RewardPosted", {"reward": 1.0, "info": {"superseded": attempt}})
                    add(
                        "AttemptFailed",
                        {
                            "attempt": attempt,
                            "reason": rnd.choice(["sandbox_error", "tool_quota"]),
                            "origin": "infra",
                            "error_type": None,
                            "message": "flaky",
                            "discarded_trajectories": 0,
                            "retry_in_s": 0.0,
                        },
                    )
                    add("SessionStarted", {"attempt": attempt + 1, "timeout_s": None})
                if rnd.random() < 0.4:
                    _calls(rnd, add)
                count = rnd.randint(0, 3)
                rewards: list[float | None] = []
                for t in range(recorded, recorded + count):
                    v1 = rnd.random() < 0.3
                    data, payload = _trajectory(rnd, t, v1)
                    if not v1 and rnd.random() < 0.5:
                        add("TrajectoryRecorded", _schema_3(rnd, data), payload, 3)
                    else:
                        add("TrajectoryRecorded", data, payload, 1 if v1 else 2)
                    if rnd.random() < 0.6 and outcome != "succeed_no_reward":
                        reward = rnd.choice(
                            [None, 0.0, 1.0, round(rnd.uniform(-1, 1), 6), rnd.random()]
                        )
                        rewards.append(reward)
                        add(
                            "RewardPosted",
                            {"reward": reward, "info": {"acc": rnd.choice([0, 1]), f"k{t}": t}},
                        )
                if outcome.startswith("succeed") and count == 0:
                    outcome = "fail_emit"  # complete() without a trajectory is a failure
                if outcome.startswith("succeed"):
                    selected = (
                        list(range(recorded, recorded + count))
                        if outcome != "succeed_last"
                        else [recorded + count - 1]
                    )
                    score = rewards[-1] if rewards else None
                    add(
                        "SessionSucceeded",
                        {
                            "selected": selected,
                            "trajectory_selection": "longest"
                            if outcome == "succeed_last"
                            else "all",
                            "score": score,
                            "score_source": "reward_info" if score is not None else "absent",
                            "finished": True,
                        },
                    )
                elif outcome.startswith("fail"):
                    reason = rnd.choice([*ev.FAILURE_REASONS, "tool_quota"])
                    decision = "drop" if outcome == "fail_drop" else "emit"
                    failed = {
                        "reason": reason,
                        "error_type": rnd.choice([None, "RuntimeError"]),
                        "message": "boom",
                        "discarded_trajectories": count,
                        "placeholder": decision,
                    }
                    v1 = (
                        reason != "tool_quota" and rnd.random() < 0.3
                    )  # schema 1: no origin, metric or partial work
                    if not v1:
                        failed.update(
                            origin=rnd.choice(["infra", "policy"]),
                            metric=rnd.choice(["zero", "zero", "exclude"]),
                            selected=[],
                            score=None,
                        )
                        if (
                            decision == "emit" and count and rnd.random() < 0.4
                        ):  # keep_partial: the last trajectory, graded
                            failed.update(
                                placeholder="keep_partial",
                                selected=[recorded + count - 1],
                                score=rewards[-1] if rewards and rewards[-1] is not None else 0.5,
                                discarded_trajectories=count - 1,
                            )
                            decision = "keep_partial"
                    add("SessionFailed", failed, schema=1 if v1 else 2)
                    if decision == "emit":
                        placeholder = {
                            "reason": reason,
                            "token_id": rnd.choice([0, 2]),
                            "reward": 0.0,
                            "finished": False,
                            "materialization_reason": "session_failed",
                            "reward_info": {"acc": 0},
                        }
                        lengths = rnd.random() < 0.5
                        if lengths:
                            placeholder.update(
                                prompt_len=rnd.randint(1, 4), response_len=rnd.randint(1, 4)
                            )
                        add("PlaceholderEmitted", placeholder, schema=2 if lengths else 1)
                elif outcome == "cancel":
                    add("SessionCancelled", {"message": rnd.choice([None, "shutdown"])})
            log.streams[sid] = [
                NewEvent(
                    str(uuid.UUID(int=rnd.getrandbits(128))),
                    sid,
                    version,
                    type_,
                    schema,
                    run,
                    uid,
                    partition,
                    step,
                    data,
                    payload,
                    next(clock),
                )
                for version, (_e, type_, schema, data, payload) in enumerate(items, start=1)
            ]
    for run in ("alpha", "beta"):  # a run's configuration stream, sometimes resumed with another
        if rnd.random() < 0.5:
            stream = f"@run:{run}"
            records: list[tuple[str, dict[str, Any]]] = [
                (
                    "RunConfigured",
                    {
                        "digest": f"{k:064x}",
                        "config": {"user": {"k": k}},
                        "change": None if k == 0 else {"previous": f"{k - 1:064x}"},
                    },
                )
                for k in range(rnd.randint(1, 2))
            ]
            records += [  # its launches (the rules read them off the sessions; the audit checks them)
                (
                    "RunLaunched",
                    {"launch": f"job-{n}", "number": n, "resumed": n > 1, "last_steps": {}},
                )
                for n in range(1, rnd.randint(1, 3))
            ]
            log.streams[stream] = [
                NewEvent(
                    str(uuid.UUID(int=rnd.getrandbits(128))),
                    stream,
                    version,
                    type_,
                    1,
                    run,
                    "",
                    "",
                    None,
                    data,
                    None,
                    next(clock),
                )
                for version, (type_, data) in enumerate(records, start=1)
            ]
    log.turns = [sid for sid, stream in log.streams.items() for _ in stream]
    rnd.shuffle(log.turns)  # a random interleaving that keeps each stream's own order
    return log


async def _append(store: EventStore, batch: list[NewEvent], versions: dict[str, int]) -> None:
    for event in batch:
        versions[event.session_id] = await store.append(
            event.session_id, versions.get(event.session_id, 0), [event]
        )


async def _record_and_project(url: str, log: Log, rnd: random.Random) -> None:
    """Append the log in a few slices, projecting in random pages between and after them."""
    engine = create_engine(url)
    store = EventStore(engine)
    try:
        await upgrade(engine)
        ordered = log.interleaved()
        cuts = sorted(rnd.sample(range(len(ordered) + 1), k=min(2, len(ordered) + 1)))
        versions: dict[str, int] = {}
        start = 0
        for cut in [*cuts, len(ordered)]:
            await _append(store, ordered[start:cut], versions)
            start = cut
            await Projector(engine, page_size=rnd.randint(1, 9)).run()
    finally:
        await store.close()
        await engine.dispose()


async def check_equivalence(source_url: str, target_url: str) -> AuditReport:
    """`replay` of the source into the (empty) target reproduces every table row for row, every
    column included but the checkpoint's wall time (`TABLES`); the source's audit finds nothing
    but the events the projector quarantined (docs/design.md §7). Returns that audit."""
    source, target = create_engine(source_url), create_engine(target_url)
    try:
        await upgrade(target)
        want = await table_rows(source)
        rnd = random.Random(len(want["events"]))
        # Queue rows are written while the fold goes on a few at a time too, not only at the end.
        with mock.patch.object(
            replay_module, "EARLY_QUEUE_ROWS", rnd.choice([1, 3, replay_module.EARLY_QUEUE_ROWS])
        ):
            report = await replay(
                source, target, page_size=rnd.randint(1, 50), workers=rnd.choice(WORKERS)
            )
        got = await table_rows(target)
        assert report.events == len(want["events"])
        for name in TABLES:
            assert len(got[name]) == len(want[name]), (
                f"{name}: {len(got[name])} rows replayed, {len(want[name])} projected"
            )
            for index, (a, b) in enumerate(zip(want[name], got[name])):
                assert a == b, f"{name} row {index}: projected {a} != replayed {b}"
        if want["queue_rows"]:  # ids compared, and numbered 1, 2, … in queue order
            assert [r["id"] for r in got["queue_rows"]] == list(
                range(1, len(got["queue_rows"]) + 1)
            )
        if want["events"]:
            assert [(c["name"], c["position"]) for c in got["checkpoints"]] == [
                ("projector", want["events"][-1]["position"])
            ]
            async with target.connect() as conn:
                assert (
                    await conn.execute(select(checkpoints.c.updated_at))
                ).scalar_one() is not None
        audited = await audit(source, workers=rnd.choice(WORKERS))
        assert [e["position"] for e in audited.quarantined] == [
            e["position"] for e in want["projection_errors"]
        ]
        unexplained = [
            d
            for d in audited.divergences
            if not (
                d.table == "events" and d.position in {e["position"] for e in audited.quarantined}
            )
        ]
        assert not unexplained, unexplained[:3]
        return audited
    finally:
        await source.dispose()
        await target.dispose()


#: The fold's processes: 1 folds in the caller's, more fold the log's steps apart and merge
#: (sessions.audit.parallel_fold): every figure above must be the same either way.
WORKERS = (1, 2, 3)

SETTINGS = settings(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
#: Examples per backend: PostgreSQL examples cost ~3x SQLite's (server round trips), so fewer
#: (about 0.5 s and 1.7 s each; 25 s for the file within the suite's 15-minute budget).
EXAMPLES = {"sqlite": 25, "postgres": 8}


def test_replay_reproduces_every_row_and_id_of_the_incremental_projection(
    module_db_pair: tuple[str, str],
) -> None:
    source, target = module_db_pair

    @settings(SETTINGS, max_examples=EXAMPLES[backend_of(source)])
    @given(seed=st.integers(0, 2**32 - 1))
    def replays_byte_for_byte(seed: int) -> None:
        for url in module_db_pair:
            asyncio.run(wipe(url))
        rnd = random.Random(seed)
        asyncio.run(_record_and_project(source, random_log(rnd), rnd))
        assert asyncio.run(check_equivalence(source, target)).ok  # random logs are all projectable

    replays_byte_for_byte()


@pytest.mark.parametrize(
    "module_db_pair", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_fast_replay_across_backends_equals_projection(
    module_db_pair: tuple[str, str], tmp_path: Any
) -> None:
    """SQLite -> PostgreSQL and back: timestamps and JSON cross the backends' storage forms."""
    sqlite_url = f"sqlite+aiosqlite:///{tmp_path / 'source.db'}"
    back = f"sqlite+aiosqlite:///{tmp_path / 'back.db'}"
    for url in module_db_pair:
        asyncio.run(wipe(url))
    rnd = random.Random(7)
    asyncio.run(_record_and_project(sqlite_url, random_log(rnd), rnd))
    assert asyncio.run(check_equivalence(sqlite_url, module_db_pair[0])).ok
    assert asyncio.run(check_equivalence(module_db_pair[0], back)).ok


def test_the_generator_covers_every_outcome() -> None:
    """The logs above are only as good as their variety: check that it is there."""
    seen: dict[str, set[Any]] = {
        "types": set(),
        "schemas": set(),
        "placeholder": set(),
        "partition": set(),
        "runs": set(),
    }
    for seed in range(60):
        for event in random_log(random.Random(seed)).interleaved():
            seen["types"].add(event.type)
            seen["schemas"].add((event.type, event.schema_version))
            seen["partition"].add(event.partition)
            seen["runs"].add(event.run)
            if event.type == "SessionFailed":
                seen["placeholder"].add(event.data["placeholder"])
    # A prune is no event a generated log can hold alone (it replaces payloads and drops queue
    # rows as it is recorded): tests/runs/test_retention.py replays and audits pruned logs. Nor
    # is a breaker's trip (the audit holds it to the fold of the run's ends, which a generated
    # log does not make): the golden v5 log and tests/runs/test_breaker.py replay and audit them.
    assert seen["types"] == set(ev.EVENT_TYPES) - {"PayloadsPruned", "BreakerTripped"}
    assert {
        ("TrajectoryRecorded", 1),
        ("TrajectoryRecorded", 2),
        ("TrajectoryRecorded", 3),
        ("SessionFailed", 1),
        ("SessionFailed", 2),
        ("PlaceholderEmitted", 1),
        ("PlaceholderEmitted", 2),
    } <= seen["schemas"]
    assert seen["placeholder"] == {"emit", "drop", "keep_partial"}
    assert {"train", "val"} <= seen["partition"] and len(seen["runs"]) == 2


def _damaged(kind: str) -> list[NewEvent]:
    """A one-session log the projector cannot project as written, in one of three ways."""
    stream = next(
        s
        for seed in range(100)
        for s in random_log(random.Random(seed)).streams.values()
        if any(e.type == "SessionSucceeded" for e in s) and any(e.type == "RewardPosted" for e in s)
    )
    if kind == "no-created":
        return stream[1:]
    if kind == "missing-trajectory":
        succeeded = next(e for e in stream if e.type == "SessionSucceeded")
        return [
            e
            if e is not succeeded
            else NewEvent(**{**vars_of(e), "data": {**e.data, "selected": [7]}})
            for e in stream
        ]
    reward = next(e for e in stream if e.type == "RewardPosted")
    return [e if e is not reward else NewEvent(**{**vars_of(e), "data": {}}) for e in stream]


def vars_of(event: NewEvent) -> dict[str, Any]:
    return {name: getattr(event, name) for name in NewEvent.__dataclass_fields__}


@pytest.mark.parametrize("kind", ["no-created", "missing-trajectory", "missing-field"])
@pytest.mark.parametrize("page_size", [1, 100])
def test_replay_quarantines_what_the_projector_quarantines(
    kind: str, page_size: int, module_db_pair: tuple[str, str]
) -> None:
    """A damaged log stops neither the projector nor replay (docs/design.md §7): both list the same events
    in projection_errors and store the same rows, ids included."""
    source_url, target_url = module_db_pair

    async def main() -> None:
        for url in module_db_pair:
            await wipe(url)
        source = create_engine(source_url)
        try:
            async with source.begin() as conn:  # written as stored, past the store's checks
                await conn.execute(events.insert(), [vars_of(e) for e in _damaged(kind)])
            await Projector(source, page_size=page_size).run()
        finally:
            await source.dispose()
        audited = await check_equivalence(source_url, target_url)
        assert audited.quarantined and not audited.ok, "the damage must be listed and reported"

    asyncio.run(main())
